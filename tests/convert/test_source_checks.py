"""The source and output directories checked before converting: overlaps, devices, shards
outside the source, overlapping or doubled tensors, odd config.json, index and headers."""

import json
import os
import shutil
import struct
import subprocess
from pathlib import Path

import mlx.core as mx
import pytest

from deltafin_mlx.convert.source import ConvertError, open_source
from deltafin_mlx.format.safetensors import MAX_HEADER_BYTES

from helpers import BIN, no_hang, only_stderr_line, run_measured


def convert_cli_run(*args):
    p = subprocess.run([str(BIN / "deltafin-convert"), *map(str, args), "--quiet"],
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stderr


def test_out_equal_to_src_is_refused_even_with_force(src_copy):
    before = (src_copy / "config.json").read_bytes()
    for extra in ([], ["--force"]):
        code, err = convert_cli_run(src_copy, src_copy, *extra)
        line = only_stderr_line(err)
        assert code == 1 and "is the source directory" in line and "--force" not in line
    code, err = convert_cli_run(src_copy, src_copy / ".." / src_copy.name, "--force")
    assert code == 1 and "--force" not in only_stderr_line(err)
    assert (src_copy / "config.json").read_bytes() == before


def test_src_inside_out_is_refused_even_with_force(sources, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(sources("kimi_k3"), out / "trunk")  # --force would remove OUT/trunk
    code, err = convert_cli_run(out / "trunk", out, "--force")
    assert code == 1 and "holds the source directory" in only_stderr_line(err)
    assert (out / "trunk" / "config.json").exists()


def test_out_inside_src_converts_and_leaves_the_source_alone(src_copy):
    files = {p.name: p.read_bytes() for p in src_copy.iterdir()}
    code, err = convert_cli_run(src_copy, src_copy / "deltafin")
    assert code == 0, err
    assert {p.name: p.read_bytes() for p in src_copy.iterdir() if p.is_file()} == files


def _first_shard(src: Path) -> str:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))[0]


@pytest.mark.parametrize("what", ["config_fifo", "shard_fifo", "shard_dev_zero",
                                  "index_fifo"])
def test_fifos_and_devices_in_the_source_are_refused(src_copy, what):
    name = {"config_fifo": "config.json", "index_fifo": "model.safetensors.index.json"}.get(
        what, _first_shard(src_copy))
    (src_copy / name).unlink()
    if what == "shard_dev_zero":
        os.symlink("/dev/zero", src_copy / name)
    else:
        os.mkfifo(src_copy / name)
    with no_hang(20), pytest.raises(ConvertError, match="not a regular file|outside the source"):
        open_source(str(src_copy))


def test_index_naming_a_shard_outside_src_is_refused(src_copy, tmp_path):
    index = json.loads((src_copy / "model.safetensors.index.json").read_text())
    shard = _first_shard(src_copy)
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(src_copy / shard, tmp_path / "elsewhere" / shard)
    index["weight_map"] = {k: (f"../elsewhere/{shard}" if v == shard else v)
                           for k, v in index["weight_map"].items()}
    (src_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConvertError, match="outside the source directory"):
        open_source(str(src_copy))


def _rewrite_header(path: Path, edit):
    raw = path.read_bytes()
    (n,) = __import__("struct").unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n
    path.write_bytes(raw[:8] + new + raw[8 + n:])


def test_overlapping_tensor_data_in_a_shard_is_refused(src_copy):
    shard = src_copy / _first_shard(src_copy)

    def overlap(h):
        a, b = [k for k in h if k != "__metadata__"][:2]
        if h[a]["dtype"] == h[b]["dtype"] and h[a]["shape"] == h[b]["shape"]:
            h[b]["data_offsets"] = h[a]["data_offsets"]
        else:  # give b a's first bytes, keeping b's length
            s = h[a]["data_offsets"][0]
            length = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
            h[b]["data_offsets"] = [s, s + length]

    _rewrite_header(shard, overlap)
    with pytest.raises(ConvertError, match="overlap"):
        open_source(str(src_copy))


def test_a_tensor_defined_in_two_shards_is_refused(src_copy):
    shards = sorted(set(json.loads((src_copy / "model.safetensors.index.json").read_text())
                        ["weight_map"].values()))
    first = mx.load(str(src_copy / shards[0]))
    name = next(iter(first))
    second = dict(mx.load(str(src_copy / shards[1])))
    second[name] = first[name]
    mx.save_safetensors(str(src_copy / shards[1]), second)
    with pytest.raises(ConvertError, match=f"tensor {name} is defined in two shards"):
        open_source(str(src_copy))


@pytest.mark.parametrize("config", [
    "[" * 100000 + "]" * 100000,
    "[1, 2]",
    '{"model_type": "kimi_k3", "text_config": [1]}',
    '{"model_type": ["kimi_k3"]}',
    "NOT JSON",
])
def test_oddly_shaped_config_json_is_one_line(src_copy, tmp_path, config):
    (src_copy / "config.json").write_text(config)
    code, err = convert_cli_run(src_copy, tmp_path / "out")
    assert code == 1
    only_stderr_line(err)


@pytest.mark.parametrize("field,value", [("num_experts_per_tok", "16"),
                                         ("num_experts_per_tok", [4]),
                                         ("num_hidden_layers", {"a": 1}),
                                         ("vocab_size", True),
                                         ("quantization_config", [1])])
def test_oddly_typed_config_values_are_one_line(src_copy, tmp_path, field, value):
    config = json.loads((src_copy / "config.json").read_text())
    target = config.get("text_config", config)
    target[field] = value
    (src_copy / "config.json").write_text(json.dumps(config))
    code, err = convert_cli_run(src_copy, tmp_path / "out")
    assert code == 1
    only_stderr_line(err)


@pytest.mark.parametrize("index", ['{"weight_map": [1, 2]}', '{"weight_map": {"a": 5}}',
                                   "[" * 50000, '{"weight_map": {"a": ""}}', "[]"])
def test_oddly_shaped_index_is_one_line(src_copy, tmp_path, index):
    (src_copy / "model.safetensors.index.json").write_text(index)
    code, err = convert_cli_run(src_copy, tmp_path / "out")
    assert code == 1
    only_stderr_line(err)


@pytest.mark.parametrize("entry", [[1, 2], {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]},
                                   {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]},
                                   {"dtype": "F32", "shape": [1], "data_offsets": {"a": 1}},
                                   {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}])
def test_oddly_typed_safetensors_header_values_are_one_line(src_copy, entry):
    shard = src_copy / _first_shard(src_copy)

    def damage(h):
        h[next(k for k in h if k != "__metadata__")] = entry

    _rewrite_header(shard, damage)
    with pytest.raises(ConvertError, match="corrupt safetensors header"):
        open_source(str(src_copy))


def _extra_shard(src: Path, header: bytes):
    """A shard beside the source's, globbed (the index would leave it out)."""
    (src / "model.safetensors.index.json").unlink()
    (src / "model-extra.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)


def test_a_source_listing_more_tensors_than_its_config_holds_is_one_line_in_bounded_memory(
        src_copy, tmp_path):
    entries = b",".join(b'"x.%d":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}' % i
                        for i in range(100_000))
    _extra_shard(src_copy, b"{" + entries + b"}")
    code, err, peak, _ = run_measured([src_copy, tmp_path / "out", "--quiet"],
                                      tool="deltafin-convert")
    assert code == 1
    assert "model-extra.safetensors: the safetensors headers list more than" in \
        only_stderr_line(err)
    assert peak < 200 << 20, f"{peak / 2**20:.0f} MiB"


def test_a_safetensors_header_larger_than_any_checkpoints_is_refused_unparsed(src_copy,
                                                                              tmp_path):
    _extra_shard(src_copy, b"{" + b" " * (MAX_HEADER_BYTES + 1) + b"}")
    code, err = convert_cli_run(src_copy, tmp_path / "out")
    assert code == 1
    assert "model-extra.safetensors: a safetensors header of 8,388,611 bytes, more than any " \
        "checkpoint's" in only_stderr_line(err)
