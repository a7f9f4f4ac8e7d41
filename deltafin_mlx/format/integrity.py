"""File integrity of a model directory: where a named file really is, what kind of
file it is, how much of it may be read, and whether its bytes are the ones the
converter wrote.

A model directory comes from strangers. Every file it names — the manifest,
config.json, tokenizer files, trunk files, banks, the drop-in module — must
resolve (after symlinks) inside the directory, be a regular file (a FIFO would
block a read forever, /dev/zero would never end one), and is read with a bound
on its size. The manifest records a checksum of every file (`checksums`, see
docs/FORMAT.md): small files are checked at every load, the rest by
`deltafin-run verify` and, with `--verify`, as they are read.

The checksum is zlib's CRC-32, as the bank records use: faster on one core than
the disk reads (docs/PERFORMANCE.md), with no new dependency.
It finds damage, not an adversary: whoever can edit a file can reseal the
manifest, so what a file says is also validated on its own (tokenizer, config).
"""

import json
import os
import stat
import zlib
from pathlib import Path
from typing import Callable, Optional

from deltafin_mlx.errors import ModelError

CHECKSUM_ALGORITHM = "crc32"
# Files up to this size are checksummed at every load (a small share of a load's
# time: docs/PERFORMANCE.md).
SMALL_FILE_BYTES = 64 << 20
MANIFEST_MAX_BYTES = 256 << 20
CONFIG_MAX_BYTES = 16 << 20
TOKENIZER_MAX_BYTES = 256 << 20
CHUNK = 16 << 20
# Read by fixed name by a tokenizer loader (ours, mlx-lm's, transformers'),
# whether or not the manifest lists them.
TOKENIZER_FILE_NAMES = (
    "tiktoken.model", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
    "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "merges.txt", "added_tokens.json",
)


def resolve_inside(root, rel, error=ModelError, inside="the model directory",
                   within=None) -> "tuple[Path, os.stat_result]":
    """The real path of `root/rel` and its stat, if it is a regular file inside
    the real `root` (or the real `within`, a folder holding `root`: a hub cache
    snapshot's files resolve into the repository's blobs/); otherwise `error`
    saying what it is instead (the converter passes its own error for a source)."""
    root = Path(root)
    shown = root / rel
    real_root = os.path.realpath(within if within is not None else root)
    real = os.path.realpath(os.path.join(os.path.realpath(root), rel))
    if os.path.commonpath([real_root, real]) != real_root:
        raise error(f"{shown}: resolves to {real}, outside {inside}")
    try:
        st = os.stat(real)
    except (OSError, ValueError):
        raise error(f"{shown}: missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{shown}: not a regular file ({file_kind(st.st_mode)})")
    return Path(real), st


def write_json(path: Path, obj):
    """`obj` as JSON at `path`, written whole: a temporary file beside it, fsynced,
    renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_kind(mode) -> str:
    """What a file that is not a regular one is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def open_inside(root, rel, limit: int, inside="the model directory"):
    """An open binary file for `root/rel`, checked as `resolve_inside` does and at
    most `limit` bytes long. Opened non-blocking, so a file swapped for a FIFO
    after the check still cannot block; the open file is checked again."""
    real, st = resolve_inside(root, rel, inside=inside)
    if st.st_size > limit:
        raise ModelError(f"{Path(root) / rel}: {st.st_size} bytes, more than the "
                         f"{limit} bytes such a file may have")
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise ModelError(f"{Path(root) / rel}: cannot open ({e.strerror})") from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise ModelError(f"{Path(root) / rel}: not a regular file")
    return f


def read_inside(root, rel, limit: int, inside="the model directory") -> bytes:
    """All of `root/rel`, a regular file inside `root` of at most `limit` bytes."""
    with open_inside(root, rel, limit, inside) as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise ModelError(f"{Path(root) / rel}: cannot read ({e.strerror})") from None
    if len(data) > limit:
        raise ModelError(f"{Path(root) / rel}: grew past {limit} bytes while being read")
    return data


def check_if_present(manifest, rel, limit: int) -> bool:
    """For a file read by fixed name (tokenizer files, generation_config.json): absent
    is fine; one present must be listed in the manifest (so its checksum is checked
    at load: an added file would change the output unseen) and be a regular file
    inside the model directory within `limit` bytes."""
    root = manifest.path
    if not os.path.lexists(Path(root) / rel):
        return False
    if rel not in manifest.files:
        raise ModelError(f"{Path(root) / rel}: not listed in the manifest (added after "
                         "conversion?); remove it or reconvert the model")
    with open_inside(root, rel, limit):
        pass
    return True


def format_checksum(crc: int) -> str:
    return f"{CHECKSUM_ALGORITHM}:{crc:08x}"


def parse_checksum(value) -> Optional[int]:
    """The CRC of a manifest checksum string, or None if it is not one."""
    if not isinstance(value, str) or not value.startswith(CHECKSUM_ALGORITHM + ":"):
        return None
    digits = value[len(CHECKSUM_ALGORITHM) + 1:]
    if len(digits) != 8 or any(c not in "0123456789abcdef" for c in digits):
        return None
    return int(digits, 16)


def file_checksum(path, progress: Optional[Callable[[int], None]] = None) -> int:
    """CRC-32 of a whole file, read in 16 MB chunks into one reused buffer."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    crc = 0
    with open(path, "rb") as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return crc
            crc = zlib.crc32(view[:n], crc)
            if progress:
                progress(n)


def check_file(manifest, rel: str, progress=None):
    """`rel` of the model has the checksum the manifest records. ModelError names
    the file otherwise."""
    want = manifest.checksums[rel]
    real, _ = resolve_inside(manifest.path, rel)
    got = file_checksum(real, progress)
    if got != parse_checksum(want):
        raise ModelError(f"{manifest.path / rel}: modified since conversion (damaged or "
                         f"edited: CRC-32 {got:08x}, the manifest says {want.split(':', 1)[1]})")


def bank_files(manifest) -> set:
    return {entry["bank"] for entry in manifest.experts["layers"].values() if "bank" in entry}


def check_small_files(manifest, limit: int = SMALL_FILE_BYTES):
    """The load-time check: every file of at most `limit` bytes has its checksum.
    Banks are left to their per-record CRCs, checked as records are read (with
    --verify) and by `deltafin-run verify`, which names the damaged record."""
    banks = bank_files(manifest)
    for rel, size in manifest.files.items():
        if size <= limit and rel not in banks:
            check_file(manifest, rel)


def check_all_files(manifest, progress=None, skip=()):
    for rel in manifest.files:
        if rel not in skip:
            check_file(manifest, rel, progress)
