"""The one safetensors header reader: the converter's source shards (local, or read
from the hub by range), the trunk files the streamer reads, and the fingerprints of
linked source files all go through it.

A file is 8 bytes of little-endian header length, that many bytes of JSON, then the
tensors' bytes. Reads go where a header says, so a header is checked before anyone
uses it: a bounded length inside the file, a JSON object, every entry well typed and
of a known dtype, each tensor's bytes exactly its shape's, inside the file and not
overlapping another's. Every failure is one line naming the file, raised as the
caller's error class (ConvertError in the converter, ModelError when loading).
"""

import json
import os
import stat
import struct
from dataclasses import dataclass
from typing import Dict, Tuple

from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.dtypes import ITEMSIZE, SAFETENSORS
from deltafin_mlx.units import is_int

# Far above any real header (docs/LEARNED.md has K3's), far below memory.
MAX_HEADER_BYTES = 8 << 20


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file, as its (checked) header says."""

    dtype: str  # safetensors' code, e.g. "BF16" (format/dtypes.py SAFETENSORS names it)
    shape: Tuple[int, ...]
    offset: int  # where its bytes start in the file (after the header)
    nbytes: int


def header_length(where, head: bytes, size: int, error=ModelError) -> int:
    """The JSON length the first 8 bytes `head` of a `size`-byte file give."""
    if len(head) < 8:
        raise error(f"{where}: truncated safetensors file ({size} bytes)")
    (n,) = struct.unpack("<Q", head[:8])
    if MAX_HEADER_BYTES < n <= size - 8:  # parsing it would take gigabytes
        raise error(f"{where}: a safetensors header of {n:,} bytes, more than any checkpoint's "
                    f"({MAX_HEADER_BYTES:,} at most)")
    if n > size - 8:
        raise error(f"{where}: corrupt safetensors header (length {n} in a {size}-byte file)")
    return n


def read_header_bytes(path, error=ModelError) -> Tuple[bytes, int]:
    """The header as stored (length prefix and JSON) and the file's size. The file
    must be a regular file (opened without blocking: a FIFO would hang the read)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            head = f.read(8)
            n = header_length(path, head, st.st_size, error)
            raw = f.read(n)
        if len(raw) != n:  # it shrank since fstat
            raise error(f"{path}: truncated safetensors file (header cut short)")
        return head + raw, st.st_size
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)


def parse_header(where, raw: bytes, size: int, error=ModelError) -> Dict[str, Entry]:
    """The header JSON `raw` (the bytes after the length) of a `size`-byte file,
    checked; `where` names the file (a path, or a hub file read by range)."""
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise error(f"{where}: corrupt safetensors header ({type(e).__name__}: "
                    f"{str(e)[:200]})") from None
    data_start = 8 + len(raw)
    out, spans = {}, []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise error(f"{where}: corrupt safetensors header entry {name!r:.200}")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if (not isinstance(dtype, str) or not isinstance(shape, list)
                or not all(is_int(x) for x in shape) or not isinstance(offsets, list)
                or len(offsets) != 2 or not all(is_int(x) for x in offsets)):
            raise error(f"{where}: corrupt safetensors header entry {name!r:.200}")
        if dtype not in SAFETENSORS:
            raise error(f"{where}: tensor {name:.200} has unsupported dtype {dtype:.40}")
        if any(s < 0 for s in shape):
            raise error(f"{where}: tensor {name:.200} has a negative dimension")
        nbytes = 0 if 0 in shape else ITEMSIZE[SAFETENSORS[dtype]]
        for s in shape:
            nbytes *= s
            if nbytes > size:  # past the file: no need for a number of a million digits
                break
        start, end = offsets
        if start < 0 or end - start != nbytes:
            raise error(f"{where}: tensor {name:.200} spans {end - start} bytes, "
                        f"its shape needs {nbytes if nbytes <= size else 'more'}")
        if data_start + end > size:
            raise error(f"{where}: truncated safetensors file ({size} bytes, "
                        f"its header needs {data_start + end})")
        if nbytes:  # an empty tensor overlaps nothing
            spans.append((start, end, name))
        out[name] = Entry(dtype, tuple(shape), data_start + start, nbytes)
    # Sorted by start, non-empty spans overlap somewhere only if two neighbours do.
    spans.sort()
    for (_, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise error(f"{where}: tensors {n0:.200} and {n1:.200} overlap in the file "
                        f"(bytes {s1}..{min(e0, e1)})")
    return out


def read_header(path, error=ModelError) -> Dict[str, Entry]:
    """name -> Entry for every tensor of a local safetensors file, checked."""
    raw, size = read_header_bytes(path, error)
    return parse_header(path, raw[8:], size, error)
