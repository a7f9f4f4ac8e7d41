"""Every MoE type the installed mlx-lm runs converts and streams to mlx-lm's own tokens.

The types are enumerated from mlx-lm's `models/` folder at test time (testing/zoo.py:
a type whose module builds on `switch_layers`, and MODEL_REMAPPING's aliases of one),
so a release that adds a type fails here until the zoo has a config for it. For each,
a tiny random model built with mlx-lm's own class from a config.json holding only the
keys the type's classes declare is saved as `mlx_lm.convert` saves it, float and 4-bit affine, converted with the default options and streamed with an
expert cache holding a quarter of its experts: the greedy tokens are those of
`mlx_lm.load` of the same directory (float32 on the CPU, as the other exactness tests
compute; a float directory quantized by mlx-lm as the default options say), and with
`--activation-dtype model` those of stock mlx-lm, computing in the saved bf16. Every
command that runs a model (`run`, `chat`, `score`, `batch`, `perplexity`) then runs
each 4-bit conversion, through the command line's own `main` (in this process: one
import for all of them).
"""

import io
import json
import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model, quantize_model

from deltafin_mlx.cli.main import main
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.model.config import SUPPORTED_TYPES
from deltafin_mlx.testing import zoo
from deltafin_mlx.testing.decode import greedy, greedy_streamed
from helpers import zoo_conversions

TYPES = zoo.moe_types()

# mlx-lm 0.32.2's models/ folder: 53 modules that build on switch_layers, and seven
# MODEL_REMAPPING aliases of them (kimi_k2, joyai_llm_flash, minimax_m2, phi-msft,
# llava, deepseek_v41_text, gemma4_unified).
EXPECTED_TYPES = 60

# The types no test here can run, each with why (at most three, none a family the
# project names as supported).
CANNOT_PASS = {
    "prism_hadamard_qwen35": "its checkpoints are Hadamard-rotated 2-bit packs made by an "
                             "external tool with a packed-module manifest, which "
                             "mlx_lm.convert cannot write; ModelArgs refuses any other",
    "muse_spark": "mlx-lm's attention runs Metal-only kernels (qk_norm, qk_norm_rope), no CPU "
                  "path, so mlx-lm itself cannot compute the oracle on this CPU",
}
# What mlx-lm itself says when it is asked to (test below: once it no longer does,
# the type leaves CANNOT_PASS).
MLX_LM_SAYS = {"prism_hadamard_qwen35": "Unsupported Hadamard pack",
               "muse_spark": "No Metal back-end"}
NAMED_FAMILIES = {
    "gpt_oss", "glm4_moe", "glm_moe_dsa", "deepseek_v32", "qwen3_5_moe", "qwen3_next",
    "minimax", "llama4", "mistral4", "olmoe", "qwen2_moe", "ernie4_5_moe", "granitemoe",
    "step3p5", "lfm2_moe", "dots1", "bailing_moe", "phimoe", "kimi_linear", "deepseek_v3",
    "kimi_k2", "kimi_k3", "qwen3_moe", "mixtral",
}


def test_the_enumeration_finds_every_moe_type_of_mlx_lm():
    assert len(TYPES) == EXPECTED_TYPES, TYPES
    assert set(zoo.OVERRIDES) <= set(TYPES), "a config for a type mlx-lm no longer has"
    assert NAMED_FAMILIES <= set(TYPES)
    assert set(CANNOT_PASS) <= set(TYPES) and len(CANNOT_PASS) <= 3
    assert not set(CANNOT_PASS) & NAMED_FAMILIES
    # the table deltafin-convert --help and the README list: what the tests below run
    assert list(SUPPORTED_TYPES) == [t for t in TYPES if t not in CANNOT_PASS]


# Names families give one number: a config carrying two of a group carries another
# family's key, which would hide a Deltafin that reads that family's name only.
ALIASES = ({"num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "moe_top_k",
            "top_k_experts"},
           {"n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts"})


@pytest.mark.parametrize("model_type", TYPES)
def test_each_types_config_carries_only_its_own_keys(model_type):
    """As the family's published config.json: the keys its ModelArgs (or its language
    model's) declares, transformers' own and those set for it; no alias of another
    family's."""
    cfg = zoo.config(model_type, 256)
    for keys, own in zip((set(cfg), set(cfg.get("text_config") or ())),
                         zoo.own_keys(model_type)):
        assert keys <= own, sorted(keys - own)
        for names in ALIASES:
            assert len(keys & names) <= 1, sorted(keys & names)


@pytest.mark.parametrize("model_type", sorted(CANNOT_PASS))
def test_the_types_that_cannot_pass_are_those_mlx_lm_cannot_run_here(model_type, tmp_path):
    with pytest.raises(Exception, match=MLX_LM_SAYS[model_type]):
        src = zoo.write(tmp_path / "src", model_type)
        greedy(oracle(src), prompt(zoo.vocab(src)), 2)


def prompt(vocab):
    rng = np.random.default_rng(0)
    return mx.array(rng.integers(1, vocab - 4, size=(1, 12)).astype(np.int32))


def oracle(src, rolled=False, dtype=mx.float32):
    """mlx-lm's load of `src` at float32 (`dtype` None: as loaded, stock mlx-lm); a
    float directory quantized as `mlx_lm.convert -q` does with the default options
    (4-bit, group 64). `rolled`: every switch module's experts moved one place
    (expert e runs e+1's weights)."""
    model, config = load_model(src, lazy=True)
    if "quantization" not in config:
        model, _ = quantize_model(model, config, 64, 4)
    if dtype is not None:
        model.set_dtype(dtype)
    if rolled:
        for name in zoo.switch_modules(model):
            module = model
            for part in name.split("."):
                module = module[int(part)] if part.isdigit() else getattr(module, part)
            module.update(zoo.roll_experts(module.parameters()))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def conversion(tmp_path_factory):
    """(source, conversion) of a type at `bits`, written once for the tests below."""
    return zoo_conversions(tmp_path_factory.mktemp("every_type"))


@pytest.mark.parametrize("model_type", SUPPORTED_TYPES)
def test_every_moe_type_streams_to_mlx_lms_tokens(model_type, conversion, steps=8):
    for bits in (None, 4):
        src, out = conversion(model_type, bits)
        expected = oracle(src)
        assert zoo.switch_modules(expected), "the built model has no switch modules"
        x = prompt(zoo.vocab(src))
        want, want_logits = greedy(expected, x, steps)
        if bits is None:
            # The experts decide the tokens: a converter that misplaces them fails.
            moved, _ = greedy(oracle(src, rolled=True), x, steps)
            assert moved.tolist() != want.tolist()
        carried = read_manifest(out).quantization["experts"].get("carried_over", False)
        assert carried == (bits is not None)
        tokens, logits = greedy_streamed(out, x, steps)  # asserts experts were read
        assert tokens.tolist() == want.tolist(), bits
        assert mx.allclose(logits, want_logits, atol=1e-4).item(), bits
        # --activation-dtype model: stock mlx-lm's tokens, computing in the saved bf16.
        stock, _ = greedy(oracle(src, dtype=None), x, steps)
        tokens, _ = greedy_streamed(out, x, steps, activation_dtype="model")
        assert tokens.tolist() == stock.tolist(), (bits, "model")


@pytest.mark.parametrize("model_type", ["mixtral", "bailing_moe", "phixtral", "nemotron_h",
                                        "longcat_flash_ngram"])
@pytest.mark.parametrize("tied", [False, True])
def test_body_and_head_compose_as_the_models_own_call(model_type, tied):
    """What score and perplexity run (compat.body_and_head), on the types whose
    embedding, body or head mlx-lm names otherwise, with a tied embedding too."""
    from deltafin_mlx.compat import body_and_head

    model = zoo.build({**zoo.config(model_type, 300), "tie_word_embeddings": tied})
    body, head = body_and_head(model)
    x = prompt(300)
    assert mx.array_equal(head(body(x, None)), model(x)).item()


@pytest.mark.parametrize("model_type", SUPPORTED_TYPES)
def test_every_moe_type_runs_through_every_command(model_type, conversion, tmp_path, capsys,
                                                   monkeypatch):
    _, out = conversion(model_type, 4)
    capsys.readouterr()  # what writing the source printed (mlx-lm's quantization line)
    model, budget = str(out), ["--budget", "200MB"]
    text = "the experts stream from disk while the trunk stays in memory " * 4
    (tmp_path / "texts.jsonl").write_text(json.dumps({"id": 1, "text": text}) + "\n")
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"id": 1, "prompt": text}) + "\n")
    (tmp_path / "text.txt").write_text(text)
    failed = {}

    def ran(name, *argv):
        """The command's stdout if it succeeded; else its one error line is kept."""
        code = main([*argv, *budget])
        captured = capsys.readouterr()
        if code == 0:
            return captured.out
        # (a chat's error line follows its prompt, "> ")
        (line,) = [l for l in captured.err.splitlines() if "deltafin-run: " in l]
        failed[name] = line
        return None

    said = ran("run", model, "The router", "-n", "3", "--json")
    if said is not None:
        assert len(json.loads(said)["tokens"]) == 3
    # two turns: the second continues from the cache the first left (a sliding window full)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nand what do the experts read\n"))
    ran("chat", model, "--chat", "-n", "3")
    for command, lines in (("score", "texts.jsonl"), ("batch", "prompts.jsonl")):
        result = tmp_path / f"{command}.jsonl"
        if ran(command, command, model, str(tmp_path / lines), "-o", str(result),
               "--no-progress") is not None:
            (line,) = map(json.loads, result.read_text().splitlines())
            assert "error" not in line, (command, line)
    said = ran("perplexity", "perplexity", model, str(tmp_path / "text.txt"), "-c", "16",
               "--json", "--no-progress")
    if said is not None:
        assert math.isfinite(json.loads(said)["perplexity"])
    assert not failed, failed
