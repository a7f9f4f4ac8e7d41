"""The mlx-lm drop-in: a converted directory loads with `mlx_lm.load`,
`mlx_lm.generate --model DIR --trust-remote-code` and `mlx_lm.server`.

deltafin-convert writes `deltafin_model.py` into the model directory and names it
as `model_file` in config.json; mlx-lm imports it (with --trust-remote-code) and
builds its `Model`, which loads the directory with `deltafin_mlx.load` and holds the
streaming model as `_inner` (an underscore attribute, so mlx-lm's strict weight
loading sees no parameters to fill).

Importing this module changes nothing in mlx-lm. Building the classes does
(`patch_mlx_lm`, once per process, as mlx-lm loads a Deltafin directory and before
it loads its tokenizer): mlx-lm's tokenizer loading then uses Deltafin's tokenizer
for Deltafin directories (K3 ships no tokenizer.json, only a tiktoken vocabulary)
and every other directory's as before, and inside mlx_lm.server Deltafin's request
checks are installed.

Under `mlx.launch` with more than one rank, the model is sharded (tensor parallel,
see model/shard.py) and its loading waits for mlx-lm's `shard(group)` call (mlx_lm.server's
`sharded_load` builds the model class twice; only the second one loads).

Environment: DELTAFIN_BUDGET (e.g. "8GB") sets the memory budget (per rank);
DELTAFIN_CONTEXT (default 4096) the tokens of prompt plus reply planned for;
DELTAFIN_SEQUENCES (a number or "auto", default 1) the sequences whose KV/recurrent
state it must hold — mlx_lm.server decodes at most that many together;
DELTAFIN_ACTIVATION_DTYPE (default auto) what it computes in, as --activation-dtype
(`model`: as mlx_lm.load of the source would, so its tokens).

From the model's side the drop-in refuses what it can see: token ids outside the
vocabulary (at the embedding) and a conversation longer than the planned context
(the cache's tokens plus the call's, across calls). Inside
mlx_lm.server it also installs Deltafin's request checks (dropin/guard.py:
logit_bias ids, every value's type and range, content other than text, prompts
beyond the context) and fits mlx-lm's batching to the plan; what
it cannot do there is listed in that module and in `deltafin-run serve --help`.
mlx-lm executes the `model_file` config.json names before any Deltafin code
runs, so a config.json edited to name a file elsewhere is out of Deltafin's
reach on that path; `deltafin-run verify` and every deltafin-run command refuse
it (format/model_dir.py: config.json's hash is in the manifest, and its
`model_file` must be this drop-in, listed in the manifest).
"""

import os
from dataclasses import dataclass
from pathlib import Path

import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs

from deltafin_mlx.format.manifest import MANIFEST_NAME



def make_classes(path: Path):
    """mlx-lm's (Model, ModelArgs) for the Deltafin directory `path`; mlx-lm is
    taught Deltafin's directories first (patch_mlx_lm)."""
    path = Path(path)
    patch_mlx_lm()

    @dataclass
    class ModelArgs(BaseModelArgs):
        model_type: str = "deltafin"

        @classmethod
        def from_dict(cls, params):
            return cls(model_type=params.get("model_type", "deltafin"))

    class Model(nn.Module):
        def __init__(self, args: ModelArgs):
            super().__init__()
            from deltafin_mlx.model.shard import detect_group

            self.model_type = args.model_type
            self.args = args
            self._loaded = None
            if detect_group() is None:
                self._load(None)

        def _load(self, group):
            self._loaded = load_for_mlx_lm(path, group)

        @property
        def _inner(self):
            if self._loaded is None:
                self._load("auto")
            return self._loaded

        def shard(self, group=None):
            """mlx-lm's tensor-parallel entry point (sharded_load, mlx_lm.server)."""
            from deltafin_mlx.engine.runtime import find_runtime

            if self._loaded is None:
                self._load(group or "auto")
            elif getattr(find_runtime(self._loaded), "group", None) is None and group is not None \
                    and group.size() > 1:
                raise ValueError("this Deltafin model was loaded whole; shard() must come first")

        def __call__(self, inputs, cache=None, **kwargs):
            check_call_length(self._inner, inputs, cache)
            return self._inner(inputs, cache=cache, **kwargs)

        @property
        def layers(self):
            return self._inner.layers

        def make_cache(self):
            from mlx_lm.models.cache import make_prompt_cache

            return make_prompt_cache(self._inner)

        def sanitize(self, weights):
            return {}

        @property
        def _deltafin(self):
            return self._inner._deltafin

    return Model, ModelArgs


def check_call_length(model, inputs, cache=None):
    """A call that takes the conversation past the planned context, the prompt
    cache's tokens plus the call's (mlx-lm hands a prompt over in passes of its
    prefill step, one call each), is refused before any work, as deltafin-run
    refuses it."""
    from deltafin_mlx.engine.runtime import find_runtime
    from deltafin_mlx.errors import ContextError
    from deltafin_mlx.generation.stream import cached_tokens

    state = find_runtime(model)
    n = inputs.shape[-1] if getattr(inputs, "ndim", 0) else 0
    held = cached_tokens(cache) if state is not None else 0
    if state is not None and held + n > state.plan.context:
        raise ContextError(f"{held + n} tokens ({held} in the prompt cache, {n} in this call), "
                           f"beyond the planned context of {state.plan.context} tokens "
                           "(DELTAFIN_CONTEXT=N plans for more)")


def load_for_mlx_lm(path: Path, group=None):
    """The Deltafin model for mlx-lm's loaders. A model or budget that cannot be
    used is one line on stderr and exit status 1 (SystemExit), not a traceback
    from inside mlx-lm's CLI."""
    import sys

    from deltafin_mlx.engine.load import LoadOptions, load
    from deltafin_mlx.errors import BudgetError, ModelError
    from deltafin_mlx.format.dtypes import ACTIVATION_DTYPES

    def env(name, default, ok, what):
        value = os.environ.get(name) or default
        if not ok(value):
            print(f"deltafin: error: {name}={value!r:.60}: {what}", file=sys.stderr)
            raise SystemExit(1)
        return value

    seqs = env("DELTAFIN_SEQUENCES", "1", lambda s: s == "auto" or s.isascii() and s.isdigit()
               and int(s) >= 1,
               "not a positive number or 'auto'")
    context = env("DELTAFIN_CONTEXT", "4096", lambda c: c.isascii() and c.isdigit()
                  and 1 <= int(c) <= 1 << 24, "not a number of tokens")
    dtype = env("DELTAFIN_ACTIVATION_DTYPE", "auto", lambda d: d in ACTIVATION_DTYPES,
                f"not one of {', '.join(ACTIVATION_DTYPES)}")
    try:
        options = LoadOptions(memory_budget=os.environ.get("DELTAFIN_BUDGET") or None,
                              tokenizer=False, group=group, context=int(context),
                              sequences=seqs if seqs == "auto" else int(seqs),
                              activation_dtype=dtype)
        model, _ = load(path, options=options)
    except BudgetError as e:
        print(f"deltafin: error: DELTAFIN_BUDGET={os.environ.get('DELTAFIN_BUDGET', '')!r:.60}: "
              f"{e}", file=sys.stderr)
        raise SystemExit(1) from None
    except ModelError as e:
        print(f"deltafin: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    from deltafin_mlx.dropin.guard import fit_batching

    fit_batching(model)  # inside mlx_lm.server: batching within the plan
    return model


# mlx-lm's own load_tokenizer, kept when patch_mlx_lm replaces it.
_mlx_lm_load_tokenizer = None


def patch_mlx_lm():
    """Teach mlx-lm Deltafin's directories, once per process: its `load_tokenizer`
    opens Deltafin's tokenizer for them, and inside mlx_lm.server Deltafin's request
    checks wrap its handler (dropin/guard.py). Called as mlx-lm builds a Deltafin
    model (make_classes), never at import: a process that imports Deltafin but
    never loads one through mlx-lm keeps mlx-lm as it is."""
    global _mlx_lm_load_tokenizer
    import mlx_lm.utils

    if mlx_lm.utils.load_tokenizer is not load_tokenizer:
        _mlx_lm_load_tokenizer = mlx_lm.utils.load_tokenizer
        mlx_lm.utils.load_tokenizer = load_tokenizer
    from deltafin_mlx.dropin.guard import install_checks

    install_checks()  # inside mlx_lm.server: its checks are in place before the model is


def load_tokenizer(model_path, tokenizer_config_extra=None, eos_token_ids=None):
    """mlx_lm.utils.load_tokenizer, once patch_mlx_lm has run: Deltafin's tokenizer
    for a Deltafin directory, mlx-lm's own for any other."""
    p = Path(model_path)
    if os.path.lexists(p / MANIFEST_NAME):
        import sys

        from deltafin_mlx.engine.load import open_tokenizer
        from deltafin_mlx.errors import ModelError

        try:
            return open_tokenizer(p)
        except ModelError as e:
            print(f"deltafin: error: {e}", file=sys.stderr)
            raise SystemExit(1) from None
    return _mlx_lm_load_tokenizer(model_path, tokenizer_config_extra, eos_token_ids)
