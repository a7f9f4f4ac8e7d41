"""A chat session's file: mlx-lm's prompt-cache safetensors, opened only as a
regular file and checked whole, its cached tensors included.

mlx-lm's `save_prompt_cache` stores the cache's tensors and string metadata; a
flipped byte in a tensor would restore silently and change every later turn, so
the metadata also carries a CRC-32 of every tensor's bytes, computed when saved
and compared when restored. The path is opened non-blocking and must be a regular
file before mlx reads it, so a FIFO named as the session is refused, not waited on.
"""

import os
import stat
import zlib
from pathlib import Path
from typing import Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from deltafin_mlx.errors import SessionError

CHECKSUM_KEY = "tensors_crc32"


def tensors_checksum(cache) -> str:
    """CRC-32 over the bytes of every tensor of `cache`'s state, in order."""
    crc = 0
    for c in cache:
        for _, a in tree_flatten(c.state):
            if not isinstance(a, mx.array):
                continue
            if a.dtype == mx.bfloat16:  # numpy has no bfloat16: its bits, as uint16
                a = a.view(mx.uint16)
            crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1), crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def write_session(path: Path, cache, metadata: dict):
    """Save `cache` with `metadata` (and the tensors' checksum) atomically: a
    temporary file beside `path`, renamed over it when complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.safetensors")
    mx.eval([c.state for c in cache])
    try:
        save_prompt_cache(str(tmp), cache, {**metadata, CHECKSUM_KEY: tensors_checksum(cache)})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_session(path: Path) -> Tuple[list, dict]:
    """(cache, metadata) of the session file at `path`, a regular file whose
    tensors have the checksum recorded with them; SessionError otherwise."""
    _check_regular(path)
    try:
        cache, meta = load_prompt_cache(str(path), return_metadata=True)
    except Exception as e:
        raise SessionError(f"{path}: not a Deltafin chat session ({e})") from None
    want = meta.get(CHECKSUM_KEY)
    if want is not None and tensors_checksum(cache) != want:
        raise SessionError(f"{path}: damaged (its cached tensors do not match their checksum); "
                           "start a new session file")
    return cache, meta


def _check_regular(path: Path):
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise SessionError(f"{path}: cannot open ({e.strerror or e})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SessionError(f"{path}: not a regular file (a session is a .safetensors file)")
    finally:
        os.close(fd)
