"""`--activation-dtype model` computes as stock mlx-lm computes on this machine: the
greedy tokens `deltafin-run --activation-dtype model --json` prints are those of
`mlx_lm.stream_generate` with a greedy sampler on the SAME source checkpoint loaded
with stock `mlx_lm.load` (bf16, as `mlx_lm.convert` saves it), float and 4-bit, for
several families. The default, `auto` (float32 on this CPU), gives other tokens on
the same sources, so the comparison tells the dtypes apart; the stats say which one
ran. (`auto` keeps its own oracle, mlx-lm's model cast to float32, logits bit for bit:
tests/convert/test_every_moe_type.py and the other exactness tests.)"""

import json
import os
import subprocess
import sys

import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import quantize_model

from deltafin_mlx.cli.main import main
from helpers import zoo_conversions

FAMILIES = ("mixtral", "gpt_oss", "glm4_moe", "deepseek_v3", "llama4")
PROMPT = "the experts stream from disk while the trunk stays in memory"
STEPS = 12
RATES = ("--disk-gbps", 1, "--compute-gwps", 1, "--prefill-gwps", 1, "--layer-ms", 1)  # unmeasured


@pytest.fixture(scope="module")
def conversion(tmp_path_factory):
    """(source, conversion) of a family at `bits` (None: bf16), written once."""
    return zoo_conversions(tmp_path_factory.mktemp("activation_dtype"))


def stock_tokens(src):
    """Stock mlx-lm's greedy tokens on `src`, computing as `mlx_lm.load` leaves it; a
    bf16 source quantized as the conversion's defaults say (`mlx_lm.convert -q`)."""
    model, tokenizer = mlx_lm.load(str(src))
    if "quantization" not in json.loads((src / "config.json").read_text()):
        model, _ = quantize_model(model, {}, 64, 4)
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=STEPS,
                                                     sampler=make_sampler(temp=0.0))]


def deltafin(capsys, *argv):
    """deltafin-run's --json output."""
    capsys.readouterr()
    code = main([*map(str, argv), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def deltafin_run(capsys, out, *flags):
    """deltafin-run's reply (tokens and stats) under a budget that holds three
    experts beyond the floor `plan` gives: the experts stream."""
    context = ["--context", "64", *flags]
    plan = deltafin(capsys, "plan", out, *context, *RATES)
    budget = plan["floor_bytes"] + 3 * plan["expert_cache_bytes"] // plan["expert_cache_slots"]
    reply = deltafin(capsys, out, PROMPT, "--raw", "-n", STEPS, "--budget", budget, *context)
    assert reply["stats"]["misses"] > 0, "no expert was read: nothing streamed"
    return reply


def check_model_dtype(conversion, capsys, model_type, bits):
    src, out = conversion(model_type, bits)
    reply = deltafin_run(capsys, out, "--activation-dtype", "model")
    assert reply["tokens"] == stock_tokens(src)
    assert reply["stats"]["activation_dtype"] == "bfloat16"


@pytest.mark.parametrize("bits", [None, 4], ids=["bf16", "4bit"])
def test_model_dtype_gives_stock_mlx_lms_greedy_tokens(bits, conversion, capsys):
    check_model_dtype(conversion, capsys, "qwen3_moe", bits)


@pytest.mark.parametrize("bits", [None, 4], ids=["bf16", "4bit"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_model_dtype_gives_stock_mlx_lms_greedy_tokens_on_more_families(
        model_type, bits, conversion, capsys):
    """(e2e; tests/convert/test_every_moe_type.py holds every type to it in-process)"""
    check_model_dtype(conversion, capsys, model_type, bits)


def test_the_default_computes_in_float32_and_its_tokens_differ_from_stock(conversion, capsys):
    """Where float32's tokens and bf16's part, a wrong dtype at `model` fails above."""
    parted = []
    for bits in (None, 4):
        src, out = conversion("qwen3_moe", bits)
        reply = deltafin_run(capsys, out)
        assert reply["stats"]["activation_dtype"] == "float32"
        parted.append(reply["tokens"] != stock_tokens(src))
    assert any(parted)


def test_the_drop_in_computes_as_told_and_refuses_a_bad_dtype_in_one_line(conversion):
    """DELTAFIN_ACTIVATION_DTYPE=model: `mlx_lm.load` of the conversion (the drop-in)
    gives stock mlx-lm's tokens on the source; a name it does not know is one line."""
    src, out = conversion("qwen3_moe", None)
    code = ("import json, mlx_lm\n"
            "from mlx_lm.sample_utils import make_sampler\n"
            f"model, tok = mlx_lm.load({str(out)!r}, trust_remote_code=True)\n"
            f"print(json.dumps([r.token for r in mlx_lm.stream_generate(model, tok, {PROMPT!r}, "
            f"max_tokens={STEPS}, sampler=make_sampler(temp=0.0))]))\n")
    for dtype in ("model", "bf16"):
        env = {**os.environ, "DELTAFIN_BUDGET": "200MB", "DELTAFIN_ACTIVATION_DTYPE": dtype}
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=600, env=env)
        if dtype == "model":
            assert p.returncode == 0, p.stderr[-2000:]
            assert json.loads(p.stdout.splitlines()[-1]) == stock_tokens(src)
        else:
            assert p.returncode == 1 and p.stderr.strip() == (
                "deltafin: error: DELTAFIN_ACTIVATION_DTYPE='bf16': not one of auto, model, "
                "float32, bfloat16, float16")


def test_a_bad_activation_dtype_is_one_line_listing_the_choices(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["no-such-model", "hi", "--activation-dtype", "bf16"])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    for choice in ("auto", "model", "float32", "bfloat16", "float16"):
        assert f"'{choice}'" in err
