"""deltafin-convert: the output is mlx-lm's own quantization, byte for byte; a run
can be interrupted and resumed; memory stays bounded; bad input is one clear line."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from helpers import make_source, reference_model
from deltafin_mlx.cli import convert as cli
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.format.bank import read_layout
from deltafin_mlx.testing.decode import load_resident
from deltafin_mlx.format.manifest import MANIFEST_NAME, PARTIAL_NAME, read_manifest
from deltafin_mlx.testing.synthetic import ARCHITECTURES

PROMPT = mx.array([[1, 5, 9, 200, 17, 33, 2, 8, 100, 64]])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_gathered_back_model_equals_mlx_lm_bit_for_bit(arch, converted, references):
    model = load_resident(converted(arch))
    expected = references(arch)(PROMPT)
    got = model(PROMPT)
    assert mx.array_equal(got, expected).item()


def test_unquantized_trunk_with_other_expert_settings_equals_mlx_lm(tmp_path, sources):
    src = sources("qwen3_moe")
    out = tmp_path / "out"
    convert(str(src), out, ConvertOptions(bits=None, expert_bits=8, expert_group_size=32,
                                          progress=False))
    m = read_manifest(out)
    assert m.quantization["trunk"] is None
    assert m.quantization["experts"] == {"mode": "affine", "bits": 8, "group_size": 32}
    expected = reference_model(src, trunk_bits=None, expert_bits=8, expert_group_size=32)
    assert mx.array_equal(load_resident(out)(PROMPT), expected(PROMPT)).item()


def test_k3_mxfp4_experts_are_carried_over_byte_for_byte(converted, sources):
    out, src = converted("kimi_k3"), sources("kimi_k3")
    m = read_manifest(out)
    assert m.quantization["experts"]["mode"] == "mxfp4"
    assert m.quantization["experts"]["carried_over"]
    layer = m.moe_layers[0]
    layout = read_layout(m.bank_path(layer))
    data = np.fromfile(m.bank_path(layer), dtype=np.uint8)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    for expert in (0, layout.num_experts - 1):
        rec = data[layout.record_offset(expert):][: layout.record_size]
        tensors = layout.split_record(rec)
        for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            name = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}"
            shard = mx.load(str(src / index[name + ".weight_packed"]))
            packed = np.asarray(shard[name + ".weight_packed"])
            scale = np.asarray(shard[name + ".weight_scale"])
            assert tensors[f"{proj}.weight"].view(np.uint8).tobytes() == packed.tobytes()
            assert tensors[f"{proj}.scales"].tobytes() == scale.tobytes()


def test_k3_layout_vision_skipped_and_tokenizer_copied(converted, capsys):
    m = read_manifest(converted("kimi_k3"))
    assert not any(k.startswith(("vision_tower", "mm_projector")) for k in m.tensors)
    assert m.tokenizer["kind"] == "kimi_tiktoken"
    assert (m.path / "tiktoken.model").exists()
    assert m.source["fingerprint"]


def test_every_record_has_a_matching_checksum(converted):
    import zlib

    m = read_manifest(converted("mixtral"))
    for layer in m.moe_layers:
        layout = read_layout(m.bank_path(layer))
        data = np.fromfile(m.bank_path(layer), dtype=np.uint8)
        assert data.size == layout.file_size
        for e in range(layout.num_experts):
            off = layout.record_offset(e)
            assert off % 4096 == 0
            assert zlib.crc32(data[off : off + layout.record_size]) == layout.checksums[e]


def test_manifest_records_quantization_of_every_tensor(converted):
    m = read_manifest(converted("kimi_k3"))
    q = {k: v["quantization"] for k, v in m.tensors.items()}
    assert q["language_model.model.layers.1.mlp.gate.weight"] == {"group_size": 64, "bits": 8}
    assert q["language_model.lm_head.weight"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert q["language_model.model.layers.1.self_attention_res_proj.weight"] is None
    for rel, size in m.files.items():
        assert (m.path / rel).stat().st_size == size


# --- interruption and resume -------------------------------------------------


def test_interrupted_conversion_resumes_to_the_same_bytes(tmp_path, sources, converted, monkeypatch):
    from deltafin_mlx.convert.experts import SanitizedExperts as experts

    src = sources("kimi_k3")
    out = tmp_path / "out"
    calls = {"n": 0}
    real = experts.record

    def crash_on_third_layer(self, layer, expert):
        if layer == 3:  # layer 3's experts
            raise KeyboardInterrupt
        calls["n"] += 1
        return real(self, layer, expert)

    monkeypatch.setattr(experts, "record", crash_on_third_layer)
    with pytest.raises(KeyboardInterrupt):
        convert(str(src), out, ConvertOptions(progress=False))
    assert not (out / MANIFEST_NAME).exists()
    state = json.loads((out / PARTIAL_NAME).read_text())
    assert set(state["done"]) == {"0", "1", "2"}
    with pytest.raises(Exception, match="conversion not finished"):
        read_manifest(out)

    done_before = calls["n"]
    resumed = []
    monkeypatch.setattr(experts, "record", lambda self, layer, e: resumed.append(layer)
                        or real(self, layer, e))
    convert(str(src), out, ConvertOptions(progress=False))
    assert set(resumed) == {3}  # finished layers were not redone
    assert done_before > 0
    ref = converted("kimi_k3")
    for rel in read_manifest(ref).files:
        assert (out / rel).read_bytes() == (ref / rel).read_bytes(), rel


def test_killed_conversion_resumes(tmp_path, sources, converted):
    """SIGKILL part-way (no cleanup runs at all), then rerun."""
    src = sources("kimi_k3")
    out = tmp_path / "out"
    code = (
        "import os, deltafin_mlx.convert.convert as c\n"
        "from deltafin_mlx.convert.experts import SanitizedExperts as experts\n"
        "real = experts.record\n"
        "def f(self, layer, expert):\n"
        "    if layer == 2 and expert == 5: os.kill(os.getpid(), 9)\n"
        "    return real(self, layer, expert)\n"
        "experts.record = f\n"
        f"c.convert({str(src)!r}, {str(out)!r}, c.ConvertOptions(progress=False))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert p.returncode == -9
    assert not (out / MANIFEST_NAME).exists()
    assert cli.main([str(src), str(out), "--quiet"]) == 0
    ref = converted("kimi_k3")
    for rel in read_manifest(ref).files:
        assert (out / rel).read_bytes() == (ref / rel).read_bytes(), rel
    assert not list(out.rglob("*.tmp"))


# --- bounded memory -----------------------------------------------------------


def test_peak_memory_is_bounded_by_the_largest_layer(tmp_path):
    """A checkpoint many times the size of its largest layer converts with peak RSS
    about twice the largest layer plus a constant (imports, MLX)."""
    src = make_checkpoint_big(tmp_path / "src")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    sizes = {}
    for f in set(index["weight_map"].values()):
        sizes[f] = (src / f).stat().st_size
    largest, total = max(sizes.values()), sum(sizes.values())
    assert total > 8 * largest
    code = (
        "import resource, sys\n"
        "import deltafin_mlx.convert.convert as c, mlx.core as mx\n"
        "mx.eval(mx.zeros(4) + 1)\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        f"c.convert({str(src)!r}, {str(tmp_path / 'out')!r}, c.ConvertOptions(progress=False))\n"
        "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "print(base, peak)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base, peak = map(int, p.stdout.split()[-2:])
    assert peak - base < 2 * largest + (64 << 20), (peak - base, largest, total)


def make_checkpoint_big(path):
    # K3 layout with wide experts: ~10 MB per layer, 12 layers.
    return make_source(path, "kimi_k3", num_layers=12, num_experts=32,
                       routed_expert_hidden_size=512, moe_intermediate_size=512,
                       hidden_size=256, intermediate_size=512)


# --- bad input: one clear line, non-zero exit ------------------------------------


def run_cli(args, capsys):
    code = cli.main([str(a) for a in args])
    err = capsys.readouterr().err.strip()
    return code, err


def assert_one_error_line(code, err, *words):
    assert code != 0
    # A progress bar may have been drawn (and cleared) before the error.
    last = err.splitlines()[-1] if err else ""
    assert last.startswith("deltafin-convert: error:"), err
    assert "Traceback" not in err and "\n" not in err.split("\r")[-1], err
    for w in words:
        assert w in err, err


def test_an_architecture_without_switch_modules_is_refused_saying_so(tmp_path, sources, copy_of,
                                                                     capsys):
    src = copy_of(sources("mixtral"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli([src, tmp_path / "o"], capsys)
    assert_one_error_line(code, err, "llama: not a Mixture of Experts", "mlx-lm runs")


def test_a_tokenizer_the_model_cannot_run_with_is_refused_before_any_work(
        tmp_path, sources, copy_of, capsys):
    """`deltafin-run` refuses a tokenizer with ids beyond the embedding table (or a
    byte it cannot encode); the converter reads the source's the same way, so it
    refuses at once instead of writing a model that cannot run."""
    src = copy_of(sources("qwen3_moe"))
    rows = json.loads((src / "config.json").read_text())["vocab_size"]
    d = json.loads((src / "tokenizer.json").read_text())
    d["model"]["vocab"]["zqzq"] = rows + 5
    (src / "tokenizer.json").write_text(json.dumps(d))
    code, err = run_cli([src, tmp_path / "o"], capsys)
    assert_one_error_line(code, err, "the source's tokenizer", f"beyond the {rows} rows")
    assert not (tmp_path / "o" / MANIFEST_NAME).exists()
    assert not (tmp_path / "o" / "experts").exists()


def test_shard_named_in_index_but_missing(tmp_path, sources, copy_of, capsys):
    src = copy_of(sources("mixtral"))
    shard = sorted(src.glob("*.safetensors"))[1]
    shard.unlink()
    code, err = run_cli([src, tmp_path / "o"], capsys)
    assert_one_error_line(code, err, shard.name, "missing")


def test_truncated_shard(tmp_path, sources, copy_of, capsys):
    src = copy_of(sources("mixtral"))
    shard = sorted(src.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    code, err = run_cli([src, tmp_path / "o"], capsys)
    assert_one_error_line(code, err, shard.name, "truncated")


def test_corrupt_shard_header(tmp_path, sources, copy_of, capsys):
    src = copy_of(sources("mixtral"))
    shard = sorted(src.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[8:20] = b"{not json!!!"
    shard.write_bytes(bytes(data))
    code, err = run_cli([src, tmp_path / "o"], capsys)
    assert_one_error_line(code, err, shard.name, "corrupt")


def test_tensor_with_unexpected_shape(tmp_path, sources, capsys):
    src = make_source(tmp_path / "src", "mixtral")
    cfg = json.loads((src / "config.json").read_text())
    cfg["hidden_size"] = cfg["hidden_size"] * 2  # config no longer matches the tensors
    (src / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli([src, tmp_path / "o"], capsys)
    assert_one_error_line(code, err, "shape")


def test_expert_with_unexpected_dtype(tmp_path, capsys):
    src = make_source(tmp_path / "src", "kimi_k3")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["text_config"]["quantization_config"]  # now experts must be floats
    (src / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli([src, tmp_path / "o", "--expert-group-size", "32"], capsys)
    assert_one_error_line(code, err, "expected")


def test_too_little_disk_states_bytes_needed(tmp_path, sources, capsys, monkeypatch):
    import deltafin_mlx.convert.convert as conv

    monkeypatch.setattr(conv, "free_bytes", lambda p: 1000)
    code, err = run_cli([sources("mixtral"), tmp_path / "o"], capsys)
    assert_one_error_line(code, err, "not enough free disk space", "bytes", "1000 bytes")


def test_out_holding_something_else_is_refused_even_with_force(tmp_path, sources, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for extra in ([], ["--force"]):
        code, err = run_cli([sources("mixtral"), out, *extra], capsys)
        assert_one_error_line(code, err, "holds no Deltafin model or conversion")
        assert "--force" not in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_unfinished_conversion_of_another_source_is_refused(tmp_path, sources, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / PARTIAL_NAME).write_text(json.dumps({"fingerprint": "x", "options": {}, "done": {}}))
    code, err = run_cli([sources("mixtral"), out], capsys)
    assert_one_error_line(code, err, "unfinished conversion of another source")


def test_finished_output_of_another_conversion_is_not_overwritten(tmp_path, sources, capsys):
    out = tmp_path / "o"
    assert run_cli([sources("mixtral"), out, "--quiet"], capsys)[0] == 0
    code, err = run_cli([sources("mixtral"), out, "--bits", "8"], capsys)
    assert_one_error_line(code, err, "already holds a converted model", "other options")
    code, err = run_cli([sources("qwen3_moe"), out, "--quiet"], capsys)
    assert_one_error_line(code, err, "already holds a converted model", "another source")


def test_missing_source_and_offline_hub_id(tmp_path, capsys, monkeypatch):
    code, err = run_cli([tmp_path / "nope", tmp_path / "o"], capsys)
    assert_one_error_line(code, err, "no such directory")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, err = run_cli(["someone/some-model", tmp_path / "o"], capsys)
    assert_one_error_line(code, err, "someone/some-model", "hub")


def test_bad_option_is_rejected_by_argparse(tmp_path, sources):
    p = subprocess.run(
        [sys.executable, "-m", "deltafin_mlx.cli.convert", str(sources("mixtral")), str(tmp_path / "o"),
         "--expert-bits", "5"],
        capture_output=True, text=True,
    )
    assert p.returncode == 2 and "invalid choice" in p.stderr and "Traceback" not in p.stderr
