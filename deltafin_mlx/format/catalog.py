"""The converted models on disk, for `deltafin-run list` and `rm`: finding every
model directory under a folder, and removing one only when it is exactly what
deltafin-convert wrote (its manifest, the files the manifest lists, and the
bytecode Python may cache for its `deltafin_model.py`), so a mistyped path can
never delete anything else."""

import os
import shutil
from pathlib import Path
from typing import Iterator, List

from deltafin_mlx.format.manifest import MANIFEST_NAME, ModelError, read_manifest

# What may sit in a model directory besides the manifest's files.
CACHED_BYTECODE = "__pycache__"


def find_model_dirs(root, depth: int = 4) -> Iterator[Path]:
    """Every directory under `root` (itself included, `depth` levels down, symlinks
    not followed) holding a Deltafin manifest, in sorted order; a model's own
    folders are not searched."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise ModelError(f"{root}: not a directory")
    for top, dirs, files in os.walk(root):
        here = Path(top)
        if MANIFEST_NAME in files:
            dirs[:] = []
            yield here
            continue
        level = len(here.relative_to(root).parts)
        dirs[:] = sorted(d for d in dirs if level < depth and not d.startswith("."))


def foreign_files(path: Path, listed) -> List[str]:
    """Paths in the model directory `path` that deltafin-convert did not write
    (anything not a regular file counts: a symlink, a FIFO, a device)."""
    allowed = set(listed) | {MANIFEST_NAME}
    out = []
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            full = Path(top) / name
            rel = full.relative_to(path).as_posix()
            if full.is_symlink():
                out.append(rel)
            elif full.is_dir():
                continue
            elif rel.split("/")[0] == CACHED_BYTECODE and rel.endswith(".pyc") and full.is_file():
                continue
            elif rel not in allowed or not full.is_file():
                out.append(rel)
    return sorted(out)


def check_removable(path) -> Path:
    """The model directory `path` as an absolute path, if `rm` may delete it: a
    path that means one directory (no symlink in it after which a `..` would
    climb somewhere else: `B/experts/..` with B/experts a link is not B), itself
    not a symlink, whose manifest reads and which holds nothing but what that
    manifest lists. ModelError saying which fails otherwise."""
    given = Path(path).expanduser()
    path = Path(os.path.abspath(given))  # `.` and `x/..` as the directory they name
    if ".." in given.parts and os.path.realpath(given) != os.path.realpath(path):
        raise ModelError(f"{given}: resolves to {os.path.realpath(given)}, not "
                         f"{os.path.realpath(path)} (a '..' after a symlink); give the "
                         "model directory's own path")
    if path.is_symlink():
        raise ModelError(f"{given}: a symlink; remove the link, or give its target")
    manifest = read_manifest(path, check_files=False)
    foreign = foreign_files(path, manifest.files)
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise ModelError(f"{given}: holds files deltafin-convert did not write ("
                         f"{', '.join(foreign[:3])}{more}); not removed")
    return path


def remove_model_dir(path) -> int:
    """Delete the converted model at `path` (checked by check_removable first);
    returns the bytes freed."""
    path = check_removable(path)
    freed = dir_bytes(path)
    shutil.rmtree(path)
    return freed


def dir_bytes(path) -> int:
    """The bytes of the regular files under `path` (symlinks not followed)."""
    total = 0
    for top, _, files in os.walk(path):
        for name in files:
            full = os.path.join(top, name)
            if not os.path.islink(full):
                total += os.path.getsize(full)
    return total


def demo_root(where=None) -> Path:
    """Where `deltafin-run --demo` keeps its synthetic checkpoint (`source/`) and the
    model converted from it (`model/`): `where`, or ~/.cache/deltafin/demo."""
    if where:
        return Path(where).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deltafin" / "demo"
