"""The one safetensors header reader (format/safetensors.py): a file written by MLX
reads back as it was written, and every damaged file is one line naming it, raised
as the caller's error class."""

import json
import os
import struct

import mlx.core as mx
import numpy as np
import pytest

from deltafin_mlx.errors import ConvertError, ModelError
from deltafin_mlx.format.safetensors import MAX_HEADER_BYTES, read_header, read_header_bytes


def _file(path, header: dict, data: bytes = b"") -> str:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def test_a_file_mlx_wrote_reads_back_as_written(tmp_path):
    path = str(tmp_path / "w.safetensors")
    arrays = {"a": mx.arange(6, dtype=mx.float32).reshape(2, 3),
              "b": mx.ones((4,), dtype=mx.bfloat16), "c": mx.zeros((0, 5), dtype=mx.uint8)}
    mx.save_safetensors(path, arrays, metadata={"format": "mlx"})
    header = read_header(path)
    assert set(header) == {"a", "b", "c"}  # __metadata__ is not a tensor
    assert (header["a"].dtype, header["a"].shape, header["a"].nbytes) == ("F32", (2, 3), 24)
    assert (header["b"].dtype, header["b"].shape, header["b"].nbytes) == ("BF16", (4,), 8)
    assert header["c"].nbytes == 0
    raw = open(path, "rb").read()
    a = np.frombuffer(raw, np.float32, 6, header["a"].offset)
    assert a.tolist() == list(range(6))
    stored, size = read_header_bytes(path)
    assert size == len(raw) and raw.startswith(stored) and header["a"].offset >= len(stored)


GOOD = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


def _damaged(tmp_path, kind):
    p = tmp_path / "bad.safetensors"
    if kind == "empty":
        p.write_bytes(b"")
    elif kind == "truncated prefix":
        p.write_bytes(b"\x10\x00\x00")
    elif kind == "length past the file":
        p.write_bytes(struct.pack("<Q", 1000) + b"{}")
    elif kind == "oversized length":
        p.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 8) + b"{}")
    elif kind == "not JSON":
        p.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    elif kind == "non-dict header":
        _file(p, [1, 2])  # type: ignore[arg-type]
    elif kind == "non-dict entry":
        _file(p, {"t": [1]}, b"\0" * 8)
    elif kind == "float dimension":
        _file(p, {"t": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 8]}}, b"\0" * 8)
    elif kind == "bool offset":
        _file(p, {"t": {"dtype": "U8", "shape": [1], "data_offsets": [False, 1]}}, b"\0")
    elif kind == "unknown dtype":
        _file(p, {"t": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8)
    elif kind == "negative dimension":
        _file(p, {"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8)
    elif kind == "offsets not the shape's bytes":
        _file(p, {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8)
    elif kind == "offsets past the file":
        _file(p, GOOD, b"\0" * 4)
    elif kind == "huge dimensions":
        _file(p, {"t": {"dtype": "F32", "shape": [10**30] * 5000, "data_offsets": [0, 8]}},
              b"\0" * 8)
    elif kind == "overlapping tensors":
        _file(p, {"t": GOOD["t"], "u": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},
              b"\0" * 8)
    elif kind == "a directory":
        p.mkdir()
    elif kind == "a FIFO":
        os.mkfifo(p)
    elif kind == "missing":
        pass
    return str(p)


KINDS = {  # what the one line says, beside the file's name
    "empty": "truncated safetensors file",
    "truncated prefix": "truncated safetensors file",
    "length past the file": "corrupt safetensors header",
    "oversized length": "corrupt safetensors header",
    "not JSON": "corrupt safetensors header",
    "non-dict header": "corrupt safetensors header",
    "non-dict entry": "corrupt safetensors header entry 't'",
    "float dimension": "corrupt safetensors header entry 't'",
    "bool offset": "corrupt safetensors header entry 't'",
    "unknown dtype": "unsupported dtype Q4",
    "negative dimension": "negative dimension",
    "offsets not the shape's bytes": "spans 4 bytes, its shape needs 8",
    "offsets past the file": "truncated safetensors file",
    "huge dimensions": "its shape needs more",
    "overlapping tensors": "tensors t and u overlap",
    "a directory": "not a regular file",
    "a FIFO": "not a regular file",  # and no hang: it is never read
    "missing": "cannot read",
}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("error", [ModelError, ConvertError])
def test_a_damaged_file_is_one_line_naming_it(tmp_path, kind, error):
    path = _damaged(tmp_path, kind)
    with pytest.raises(error) as e:
        read_header(path, error)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ") and KINDS[kind] in msg and "\n" not in msg, msg
    assert len(msg) < 400


def test_empty_tensors_overlap_nothing_and_hide_no_overlap(tmp_path):
    """An empty tensor sorted between two others neither overlaps them nor hides
    that they overlap each other."""
    p = tmp_path / "e.safetensors"
    empty = {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}
    _file(p, {"t": GOOD["t"], "e": empty}, b"\0" * 8)
    assert read_header(str(p))["e"].nbytes == 0
    _file(p, {"a": {"dtype": "U8", "shape": [6], "data_offsets": [0, 6]}, "e": empty,
              "b": {"dtype": "U8", "shape": [4], "data_offsets": [5, 9]}}, b"\0" * 9)
    with pytest.raises(ModelError, match="tensors a and b overlap"):
        read_header(str(p))
