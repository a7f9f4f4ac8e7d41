"""`deltafin-convert --expert-bits float`: float experts are kept in their float
dtype, byte for byte, and run to exactly the tokens and logits of mlx-lm's own
model of the float source; the conversion's last line says what became of the
experts."""

import json

import mlx.core as mx
import numpy as np
import pytest

from helpers import one_line_error, reference_model, run_tool
from deltafin_mlx.cli.main import main
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.format.bank import read_layout
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.testing.decode import greedy, greedy_streamed, load_resident

PROMPT = mx.array([[1, 5, 9, 200, 17, 33, 2, 8, 100, 64]])


def source_tensors(src) -> dict:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def test_float_experts_are_kept_byte_for_byte(sources, tmp_path, capsys):
    src, out = sources("qwen3_moe"), tmp_path / "out"
    convert(str(src), out, ConvertOptions(expert_bits="float", progress=False))
    m = read_manifest(out)
    assert m.quantization["experts"] == {"mode": "float", "dtype": "bfloat16"}
    saved = source_tensors(src)
    for layer in m.moe_layers:
        layout = read_layout(m.bank_path(layer))
        assert [s.name for s in layout.sections] == [
            "gate_proj.weight", "up_proj.weight", "down_proj.weight"]
        data = np.fromfile(m.bank_path(layer), dtype=np.uint8)
        for e in range(layout.num_experts):
            record = layout.split_record(data[layout.record_offset(e):][:layout.record_size])
            for s in layout.sections:
                want = saved[f"model.layers.{layer}.mlp.experts.{e}.{s.name}"]
                assert want.dtype == mx.bfloat16
                assert record[s.name].tobytes() == np.asarray(want.view(mx.uint16)).tobytes()
    # mlx-lm reads them as float: its quantization block lists them as not quantized.
    quantization = json.loads((out / "config.json").read_text())["quantization"]
    switch = m.switch_path(m.moe_layers[0])
    assert quantization[f"{switch}.gate_proj"] is False
    # info and list say so.
    assert main(["info", str(out)]) == 0
    assert "bfloat16, kept unquantized" in capsys.readouterr().out
    assert main(["list", str(tmp_path)]) == 0
    assert "experts bfloat16" in capsys.readouterr().out
    # `plan` of the source with the same option sizes the records it wrote.
    record = {}
    for what, flags in (("converted", [out]), ("float", [src, "--expert-bits", "float"]),
                        ("4-bit", [src])):
        assert main(["plan", *map(str, flags), "--json", "--budget", "50MB", "--disk-gbps",
                     "2", "--compute-gwps", "3", "--layer-ms", "0.1"]) == 0
        record[what] = json.loads(capsys.readouterr().out)["expert_record_bytes"]
    assert record["converted"] == record["float"] > record["4-bit"]


@pytest.mark.parametrize("trunk_bits", [4, None], ids=["4bit-trunk", "float-trunk"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_float_experts_give_mlx_lms_tokens_and_logits(arch, trunk_bits, sources, tmp_path):
    src, out = sources(arch), tmp_path / "out"
    convert(str(src), out, ConvertOptions(bits=trunk_bits, expert_bits="float", progress=False))
    if trunk_bits is None:  # nothing quantized: config.json is a float model's
        assert "quantization" not in json.loads((out / "config.json").read_text())
    expected = reference_model(src, trunk_bits=trunk_bits, expert_bits="float")
    want_tokens, want_logits = greedy(expected, PROMPT, 12)
    tokens, logits = greedy_streamed(out, PROMPT, 12)
    assert (tokens == want_tokens).all()
    assert mx.array_equal(logits, want_logits).item()
    assert mx.array_equal(load_resident(out)(PROMPT), expected(PROMPT)).item()
    # The same experts quantized give other logits: the comparison can tell.
    quantized = reference_model(src, trunk_bits=trunk_bits)
    assert not mx.array_equal(quantized(PROMPT), expected(PROMPT)).item()


def test_the_last_line_says_what_became_of_the_experts(sources, tmp_path):
    src = sources("qwen3_moe")
    kept = run_tool("deltafin-convert", src, tmp_path / "kept", "--expert-bits", "float")
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout.strip().splitlines()[-1].endswith("; experts: bfloat16, kept")
    quantized = run_tool("deltafin-convert", src, tmp_path / "q", "--quiet")
    assert quantized.stdout.strip().splitlines()[-1].endswith(
        "; experts: 4-bit affine (group size 64), quantized from bfloat16")
    err = one_line_error(run_tool("deltafin-convert", src, tmp_path / "bad",
                                  "--expert-bits", "half"))
    assert "--expert-bits" in err and "float" in err


def test_carried_experts_are_never_kept_as_float(sources, tmp_path):
    err = one_line_error(run_tool("deltafin-convert", sources("kimi_k3"), tmp_path / "out",
                                  "--expert-bits", "float"))
    assert "carried over as they are" in err
    err = one_line_error(run_tool("deltafin-convert", sources("qwen3_moe"), tmp_path / "out",
                                  "--expert-bits", "float", "--link-experts"))
    assert "--link-experts" in err
