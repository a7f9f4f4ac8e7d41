"""Writes safetensors files of generated tensors, streamed in bounded memory.

A `Tensor` names its header entry and an init that generates its values; a
shard's values are a function of the seed and each tensor's name only.
"""

import json
import math
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from deltafin_mlx.format.dtypes import ITEMSIZE, NUMPY, SAFETENSORS

# Rows of a tensor generated at once: bounds memory for huge embeddings.
_CHUNK_ELEMENTS = 1 << 22



@dataclass
class Tensor:
    """One tensor to write: its header entry, and how to generate its values."""

    name: str
    shape: Tuple[int, ...]
    dtype: str  # safetensors dtype
    # (rng, shape, dtype) -> float32 array, or the stored dtype (bf16 as
    # uint16 bits). Big tensors are generated in row chunks, so the values
    # must not depend on the row offset.
    init: Callable[[np.random.Generator, Tuple[int, ...], str], np.ndarray]

    @property
    def nbytes(self) -> int:
        return ITEMSIZE[SAFETENSORS[self.dtype]] * math.prod(self.shape)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    # Round to nearest even, as torch does when casting float32 to bfloat16.
    bits = x.astype(np.float32, copy=False).view(np.uint32)
    bits = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (bits >> np.uint32(16)).astype(np.uint16)


def _tensor_chunks(t: Tensor, seed: int):
    # One generator per tensor, keyed by its name: a tensor's values do not
    # depend on what else is in the checkpoint or in which order it is written.
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    rows, row_shape = t.shape[0], tuple(t.shape[1:])
    step = max(1, _CHUNK_ELEMENTS // max(1, math.prod(row_shape)))
    for start in range(0, rows, step):
        shape = (min(step, rows - start),) + row_shape
        x = t.init(rng, shape, t.dtype)
        if t.dtype == "BF16" and x.dtype == np.float32:
            x = _bf16_bits(x)
        want = NUMPY[SAFETENSORS[t.dtype]]
        if x.dtype != want or x.shape != shape:
            raise TypeError(f"{t.name}: init gave {x.dtype}{x.shape} for {t.dtype}")
        yield np.ascontiguousarray(x)


def write_safetensors(
    path: Path, tensors: Sequence[Tensor], seed: int, metadata: Optional[dict]
) -> int:
    """Write one shard; returns the bytes of tensor data written."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the safetensors library aligns to 8
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for t in tensors:
            for chunk in _tensor_chunks(t, seed):
                f.write(chunk.data)
    return offset


_TABLE_SIZE = 1 << 16


def normal(std: float, mean: float = 0.0):
    """A Tensor init drawing from N(mean, std^2)."""

    def init(rng, shape, dtype):
        if math.prod(shape) <= _TABLE_SIZE:
            x = rng.standard_normal(shape, dtype=np.float32)
            return x * np.float32(std) + np.float32(mean)
        # Big tensors draw from a table of 64K normal samples, several times
        # faster than sampling each value: multi-GB benchmark checkpoints are
        # bound by this.
        table = rng.standard_normal(_TABLE_SIZE, dtype=np.float32)
        table = table * np.float32(std) + np.float32(mean)
        if dtype == "BF16":
            table = _bf16_bits(table)
        return table[rng.integers(0, _TABLE_SIZE, size=shape, dtype=np.uint16)]

    return init
