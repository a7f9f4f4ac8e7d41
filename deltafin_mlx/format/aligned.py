"""Buffers whose start is 4096-aligned, as O_DIRECT reads need (bank.ALIGN)."""

import numpy as np

from deltafin_mlx.format.bank import ALIGN


def aligned_empty(nbytes: int) -> np.ndarray:
    """A uint8 numpy buffer whose start is 4096-aligned."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + nbytes]
