"""mlx-lm's private surface as Deltafin uses it. Every private or undocumented
mlx-lm name Deltafin reads or overrides is listed in compat.PRIVATE, exists in the
installed mlx-lm (a release that renames one fails here, in one line naming it)
and is reached from compat.py alone; and what compat.py makes of mlx-lm's
hooks behaves as serve needs it: the turn-taking batch generator runs mlx-lm's own
steps in turns, with the same tokens."""

import ast
import re
from pathlib import Path

import pytest

from deltafin_mlx import compat

ROOT = Path(__file__).resolve().parents[2] / "deltafin_mlx"


@pytest.mark.parametrize("module,name", compat.PRIVATE, ids=[n for _, n in compat.PRIVATE])
def test_each_private_name_exists_in_the_installed_mlx_lm(module, name):
    assert compat.missing([(module, name)]) == [], (
        f"mlx-lm no longer has {module}:{name} (compat.PRIVATE)")


def test_a_renamed_name_is_reported():
    assert compat.missing([("mlx_lm.server", "APIHandler._no_such_hook"),
                           ("mlx_lm.utils", "_no_such_function")]) == [
        "mlx_lm.server:APIHandler._no_such_hook", "mlx_lm.utils:_no_such_function"]


def test_make_samplers_chain_is_readable():
    """KeyedSampler draws mlx-lm's own filter chain with its own key: the chain is
    read from make_sampler's closure, which a release may change."""
    from mlx_lm.sample_utils import make_sampler

    filters, temp = compat.sampler_chain(make_sampler(0.7, top_p=0.9, top_k=5))
    assert temp == 0.7 and len(filters) == 2
    assert compat.sampler_chain(make_sampler(0.0)) == ([], None)


def test_the_float_tag_is_mlx_lms():
    import mlx_lm.utils

    assert compat.FLOAT_TAG == mlx_lm.utils._FLOAT_TAG_KEY
    assert compat.decode_tagged_floats({"a": {"__float__": "NaN"}}, b'"__float__"')["a"] != 0


# --- only compat.py reaches mlx-lm's private names ----------------------------------


def test_only_compat_reaches_into_mlx_lm_private_names():
    """`mlx_lm.anything._private` is spelled in compat.py alone."""
    spelled = {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py")
               if re.search(r"\bmlx_lm(\.\w+)*\._[a-z]\w*", p.read_text())}
    assert spelled <= {"compat.py"}, spelled


def _names(pattern, files):
    return {n for p in files for n in re.findall(pattern, p.read_text(), re.M)}


def test_no_private_mlx_lm_attribute_is_read_outside_compat():
    """A `_name` that mlx-lm defines (a method, an attribute its methods set, a
    module global) and Deltafin does not define for itself is read in compat.py
    only (`obj._name`, `getattr(obj, "_name")`, `super()._name`)."""
    import mlx_lm

    theirs_files = list(Path(mlx_lm.__file__).parent.rglob("*.py"))
    # `def _name(`, `_name = ...`, `self._name = ...` or `self._a, self._name = ...`
    defines = r"(?:\bdef |^\s*|self\.)(_[a-z]\w*)(?=\s*\(|(?:\s*,\s*self\.\w+)*\s*[:=][^=])"
    theirs = _names(defines, theirs_files)
    ours_files = [p for p in ROOT.rglob("*.py") if p.name != "compat.py"]
    ours = _names(defines, ours_files)
    found = []
    for p in ours_files:
        for i, line in enumerate(p.read_text().splitlines(), 1):
            for name in re.findall(r"super\(\)\.(_[a-z]\w*)", line):
                found.append(f"{p.relative_to(ROOT)}:{i}: super().{name}")
            for name in re.findall(r"\.(_[a-z]\w*)\b|[\"'](_[a-z]\w*)[\"']", line):
                name = "".join(name)
                if name in theirs and name not in ours:
                    found.append(f"{p.relative_to(ROOT)}:{i}: {name}")
    assert found == []


def test_no_class_is_made_inside_a_function_in_the_server_or_compat():
    files = [ROOT / "compat.py", *sorted((ROOT / "server").glob("*.py"))]
    nested = []
    for p in files:
        for fn in ast.walk(ast.parse(p.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested += [f"{p.name}: {fn.name} makes a class" for c in ast.walk(fn)
                           if isinstance(c, ast.ClassDef) or isinstance(c, ast.Call)
                           and getattr(c.func, "id", None) == "type" and len(c.args) == 3]
    assert nested == []


def _server_classes():
    from deltafin_mlx.server.generation import (LoadedModelProvider, ResilientGenerator,
                                                TurnTakingBatchGenerator)
    from deltafin_mlx.server.handler import DeltafinHandler

    return [DeltafinHandler, ResilientGenerator, TurnTakingBatchGenerator, LoadedModelProvider]


# http.server's handler API, which a handler is meant to override
HTTP_SERVER_API = {"__init__", "setup", "handle_one_request", "parse_request", "log_message",
                   "do_GET", "do_POST", "do_OPTIONS"}


@pytest.mark.parametrize("cls", _server_classes(), ids=lambda c: c.__name__)
def test_what_the_servers_classes_override_of_mlx_lm_is_listed(cls):
    """Every name the server's classes define that mlx-lm's class (or
    http.server's) also has overrides its internals: it is in PRIVATE, and a
    private one is overridden by compat.py's mixins alone."""
    listed = {n for _, n in compat.PRIVATE}
    theirs = [c for c in cls.__mro__ if not c.__module__.startswith("deltafin_mlx")
              and c is not object]
    wrong = []
    for own in cls.__mro__:
        if not own.__module__.startswith("deltafin_mlx"):
            continue
        for name in vars(own):
            if name.startswith("__") and name != "__init__" or name in HTTP_SERVER_API:
                continue
            for base in theirs:
                if name not in vars(base):
                    continue
                listed_as = f"{base.__name__}.{name}"
                if not base.__module__.startswith("mlx_lm") or listed_as not in listed:
                    wrong.append(f"{own.__name__}.{name} overrides {base.__module__}.{listed_as}")
                elif name.startswith("_") and own.__module__ != "deltafin_mlx.compat":
                    wrong.append(f"{own.__module__}.{own.__name__}.{name}: not in compat")
    assert wrong == []


def test_every_hook_the_drop_in_wraps_is_listed():
    """dropin/guard.py wraps mlx-lm's APIHandler methods in place: each is listed."""
    import mlx_lm.server as server

    listed = {n for _, n in compat.PRIVATE}
    wrapped = re.findall(r"^\s+def (\w+)\(self", (ROOT / "dropin/guard.py").read_text(), re.M)
    assert wrapped and [n for n in wrapped if f"APIHandler.{n}" not in listed
                        or n not in vars(server.APIHandler)] == []


# --- behaviour of compat's hooks ---------------------------------------------------


def _two_layer_model(calls):
    """A two-layer llama of random weights whose every forward pass is recorded in
    `calls`: "P<tokens>" for a prompt chunk, "D<sequences>" for a decode step."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    class Recorded(llama.Model):
        def __call__(self, inputs, cache=None, **kwargs):
            b, n = inputs.shape
            calls.append(f"P{n}" if n > 1 else f"D{b}")
            return super().__call__(inputs, cache=cache, **kwargs)

    mx.random.seed(3)
    model = Recorded(llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97))
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.5, model.parameters()))
    mx.eval(model.parameters())
    return model


def _steps_after_a_second_prompt(cls, steps):
    """Sequence A (3 prompt tokens) generates; then B's prompt (13 tokens, passes
    of 4) arrives: each of the next `steps` calls of `next()` as the forward
    passes it ran and which sequences got a token ("->AB")."""
    calls = []
    gen = cls(_two_layer_model(calls), completion_batch_size=4, prefill_batch_size=1,
              prefill_step_size=4)
    names = dict(zip(gen.insert([[1, 2, 3]], [30]), "A"))
    while not gen.next()[1]:
        pass
    names.update(zip(gen.insert([list(range(5, 18))], [30]), "B"))
    seen = []
    for _ in range(steps):
        calls.clear()
        got = "".join(names[r.uid] for r in gen.next()[1])
        seen.append(" ".join(calls) + (f" ->{got}" if got else ""))
    return seen


def test_decode_steps_and_prefill_passes_take_turns():
    """mlx-lm's step runs A's decode step and then a pass of B's prompt, and hands
    out A's token only after that pass; the turn-taking generator runs each alone,
    so A's token goes out before B's next pass, and B's first token in the step
    right after its prompt is done."""
    from mlx_lm.generate import BatchGenerator

    from deltafin_mlx.server.generation import TurnTakingBatchGenerator

    assert _steps_after_a_second_prompt(BatchGenerator, 5) == [
        "D1 P4 ->A", "D1 P4 ->A", "D1 P4 ->A", "D1 D1 ->A", "D2 ->AB"]
    assert _steps_after_a_second_prompt(TurnTakingBatchGenerator, 9) == [
        "D1 ->A", "P4", "D1 ->A", "P4", "D1 ->A", "P4", "D1 ->A", "D1", "D2 ->AB"]


def test_taking_turns_changes_no_token():
    from mlx_lm.generate import BatchGenerator

    from deltafin_mlx.server.generation import TurnTakingBatchGenerator

    def tokens(cls):
        gen = cls(_two_layer_model([]), completion_batch_size=4, prefill_batch_size=1,
                  prefill_step_size=4)
        out = {}
        gen.insert([[1, 2, 3]], [10])
        for i in range(40):
            if i == 3:
                gen.insert([list(range(5, 18))], [6])
            for r in gen.next()[1]:
                out.setdefault(r.uid, []).append(r.token)
        return out

    turns = tokens(TurnTakingBatchGenerator)
    assert turns == tokens(BatchGenerator)
    assert [len(t) for t in turns.values()] == [10, 6] and len(set(turns[0])) > 1


def test_a_chat_prompt_is_split_as_split_prompt_says_in_mlx_lms_tokenizing():
    """ResponseGeneratorHooks hands mlx-lm's own segments of a chat prompt to
    `split_prompt` and returns what it gives back, in `_tokenize`'s tuple."""
    from types import SimpleNamespace

    from mlx_lm.server import CompletionRequest, ResponseGenerator

    class Tokenizer:  # what mlx-lm's _tokenize reads of a tokenizer with a template
        has_chat_template, has_thinking, response_initial_state = True, False, None

        def apply_chat_template(self, messages, add_generation_prompt, tools, tokenize):
            text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
            return [ord(c) for c in "<preamble>" + text + "<assistant>"]

    class Splitting(compat.ResponseGeneratorHooks, ResponseGenerator):
        def __init__(self):  # no generation thread
            self.model_provider = SimpleNamespace(
                processor=None, cli_args=SimpleNamespace(chat_template_args={}))
            self.seen = []

        def split_prompt(self, tokenizer, request, args, segments, types):
            self.seen.append((segments, types))
            return [segments[0][:10], segments[0][10:], *segments[1:]], ["system", *types]

    gen = Splitting()
    request = CompletionRequest("chat", "", [{"role": "user", "content": "hi"}], None, None)
    prompt, segments, types, state, vision = gen._tokenize(
        Tokenizer(), request, SimpleNamespace(chat_template_kwargs=None))
    assert bytes(prompt).decode() == "<preamble><user>hi<assistant>"
    assert gen.seen == [([prompt], ["user"])]  # mlx-lm's: one user segment
    assert segments == [prompt[:10], prompt[10:]] and types == ["system", "user"]
    assert (state, vision) == ("normal", None)
