"""A chat session's file: mlx-lm's prompt-cache safetensors, opened only as a
regular file and checked whole: its metadata, its cache's layer types, scalars and
tensors.

mlx-lm's `save_prompt_cache` stores the cache's tensors and scalars, its layer
types and string metadata (the conversation, its tokens, options); an edited
message, token id or flipped tensor byte would restore silently and change every
later turn (and be written back on the next save), so the metadata also carries a
CRC-32 of all of it, computed when saved and compared when restored. The path is
opened non-blocking and must be a regular file before mlx reads it, so a FIFO named
as the session is refused, not waited on.
"""

import errno
import json
import os
import stat
import zlib
from pathlib import Path
from typing import Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from deltafin_mlx import compat
from deltafin_mlx.errors import SessionError, SessionSaveError
from deltafin_mlx.format.dtypes import to_numpy
from deltafin_mlx.format.safetensors import read_header_bytes

CHECKSUM_KEY = "content_crc32"


def content_checksum(cache, metadata: dict) -> str:
    """CRC-32 over everything a session file holds: its metadata (but this checksum),
    the cache's layer types, and each layer's state (every scalar's value and every
    tensor's name, dtype, shape and bytes), in order."""
    text = json.dumps({k: v for k, v in metadata.items() if k != CHECKSUM_KEY},
                      sort_keys=True, ensure_ascii=False)
    crc = zlib.crc32(text.encode())
    crc = zlib.crc32(json.dumps([type(c).__name__ for c in cache]).encode(), crc)
    for c in cache:
        for name, a in tree_flatten(c.state):
            if not isinstance(a, mx.array):
                if isinstance(a, float):  # stored as a float32 array
                    a = float(np.float32(a))
                crc = zlib.crc32(f"{name}={json.dumps(a)};".encode(), crc)
                continue
            crc = zlib.crc32(f"{name}:{a.dtype}{tuple(a.shape)};".encode(), crc)
            crc = zlib.crc32(np.ascontiguousarray(to_numpy(a)).view(np.uint8).reshape(-1), crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def write_session(path: Path, cache, metadata: dict):
    """Save `cache` with `metadata` (and the content's checksum) atomically: a
    temporary file beside `path`, renamed over it when complete; over a session
    only (`/save model` beside a checkpoint must not replace its weights)."""
    if os.path.lexists(path) and session_format(path) != metadata["format"]:
        raise SessionSaveError(f"session not saved: {path} is there and is not a chat "
                               "session; save under another name")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp.safetensors")
    mx.eval([c.state for c in cache])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_prompt_cache(str(tmp), cache,
                          {**metadata, CHECKSUM_KEY: content_checksum(cache, metadata)})
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # mlx's failed write is a RuntimeError
        why = save_failure(path, cache, metadata, e)
        raise SessionSaveError(f"session not saved: {why}; {path} keeps the conversation as "
                               "last saved, the chat goes on") from None
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


def session_format(path: Path):
    """The session format a file's safetensors header names (read alone); or None."""
    try:
        raw, _ = read_header_bytes(path, error=SessionError)
        return compat.prompt_cache_metadata(json.loads(raw[8:])["__metadata__"])["format"]
    except Exception:  # any file that is not a session: its header may hold anything
        return None


def save_failure(path: Path, cache, metadata: dict, e: Exception) -> str:
    """Why a save failed, in words: "disk full" when the filesystem has less room
    than the file takes, its tensors and metadata (mlx's message says only that a
    write failed)."""
    needed = (sum(getattr(v, "nbytes", 0) for c in cache for _, v in tree_flatten(c.state))
              + sum(len(str(k)) + len(str(v)) for k, v in metadata.items()))
    try:
        st = os.statvfs(path.parent if path.parent.exists() else ".")
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = None
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (
            free is not None and free < needed):
        return f"disk full ({free or 0:,} bytes free beside {path.name})"
    return (getattr(e, "strerror", None) or str(e).strip().splitlines()[0])[:200]


def read_session(path: Path, format: str, version: int) -> Tuple[list, dict]:
    """(cache, metadata) of the session file at `path`: a regular file, of `format`
    at `version` (metadata "format", "version"), whose content has the checksum
    recorded with it; SessionError otherwise."""
    _check_regular(path)
    try:
        cache, meta = load_prompt_cache(str(path), return_metadata=True)
    except Exception as e:
        raise SessionError(f"{path}: not a Deltafin chat session ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != format:
        raise SessionError(f"{path}: not a Deltafin chat session")
    if meta.get("version") != str(version):
        raise SessionError(f"{path}: session format version {str(meta.get('version'))[:40]}, this "
                           f"Deltafin reads version {version}; start a new session file")
    if content_checksum(cache, meta) != meta.get(CHECKSUM_KEY):
        raise SessionError(f"{path}: damaged or edited (its content does not match its "
                           "checksum); start a new session file")
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
