"""What the demo wrote in its folder, so that `rm --demo` deletes that and nothing else.

The demo's folder (`--demo-dir DIR`, by default ~/.cache/deltafin/demo) may be any
folder a user names, holding anything. The demo records in `DIR/deltafin-demo.json`
what it writes there, before writing it:

    {"kind": "deltafin demo", "model": "model" or null,
     "source": {"config.json": 1234, ...} or null, "writing": ".source-XXXX" or null,
     "writing_id": "device:inode" or null}

`model`: DIR/model is a conversion the demo started (a model found there already is
used, never claimed); `source`: the synthetic checkpoint in DIR/source, file by file
with its size; `writing`: the folder of its own (mkdtemp) the checkpoint is being
written in, renamed to DIR/source once complete (`writing_id`: its identity; any
other folder of that name is never deleted). `rm --demo` checks everything first
and deletes only what the marker names: without a marker, or with anything in a
claimed folder the demo did not write (a file added, a size changed, a link), it
deletes nothing.
"""

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from deltafin_mlx.errors import ModelError

MARKER_NAME = "deltafin-demo.json"
KIND = "deltafin demo"
MARKER_MAX_BYTES = 1 << 20
MODEL, SOURCE = "model", "source"


def read_marker(root: Path) -> Optional[dict]:
    """The marker in `root`, or None when there is none; ModelError for one that is
    not a demo marker (nothing is deleted on its word)."""
    path = Path(root) / MARKER_NAME
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ModelError(f"{path}: cannot read the demo's record ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ModelError(f"{path}: not a regular file; not the demo's record")
        raw = os.read(fd, MARKER_MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        d = json.loads(raw) if len(raw) <= MARKER_MAX_BYTES else None
    except (ValueError, RecursionError):
        d = None
    source = d.get("source") if isinstance(d, dict) else None
    if (not isinstance(d, dict) or d.get("kind") != KIND
            or d.get("model") not in (None, MODEL)
            or not (source is None or isinstance(source, dict) and all(
                isinstance(k, str) and _plain_rel(k) and type(v) is int
                for k, v in source.items()))
            or not (d.get("writing") is None or isinstance(d["writing"], str)
                    and d["writing"].startswith(".source-") and "/" not in d["writing"])
            or not isinstance(d.get("writing_id"), (str, type(None)))):
        raise ModelError(f"{path}: not a record the demo wrote; nothing removed")
    return d


def _plain_rel(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and "\x00" not in rel and all(p not in ("", ".", "..") for p in parts)


def write_marker(root: Path, marker: dict):
    """Record `marker` (written whole: a temporary file renamed over the old one)."""
    marker = {"kind": KIND, "model": None, "source": None, "writing": None, **marker}
    fd, tmp = tempfile.mkstemp(prefix=f".{MARKER_NAME}.", suffix=".tmp", dir=root)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(marker, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, Path(root) / MARKER_NAME)
    except BaseException:
        os.unlink(tmp)
        raise


def file_sizes(folder: Path) -> Dict[str, int]:
    """{relative path: size} of the regular files under `folder` (links not followed)."""
    out = {}
    for top, _, files in os.walk(folder):
        for name in files:
            full = Path(top) / name
            out[full.relative_to(folder).as_posix()] = full.lstat().st_size
    return out


def _folder_id(path: Path) -> Optional[str]:
    """A folder's identity, "device:inode" (None: no folder there; links not followed)."""
    st = os.lstat(path) if os.path.lexists(path) else None
    return f"{st.st_dev}:{st.st_ino}" if st and stat.S_ISDIR(st.st_mode) else None


def _foreign_writing(root: Path, marker: dict) -> bool:
    """The marker's `writing` names something there that is not the folder the demo made."""
    name = marker.get("writing")
    return bool(name) and os.path.lexists(root / name) and (
        marker.get("writing_id") is None or _folder_id(root / name) != marker["writing_id"])


def start_source(root: Path) -> Path:
    """A fresh folder of the demo's own to write the checkpoint in, recorded before
    anything is written to it; finish_source makes it DIR/source. A folder an
    interrupted demo left (recorded as `writing`) is deleted first: it was ours."""
    root = Path(root)
    marker = read_marker(root) or {}
    if marker.get("writing") and not _foreign_writing(root, marker):
        shutil.rmtree(root / marker["writing"], ignore_errors=True)
    if os.path.lexists(root / SOURCE):
        raise ModelError(f"{root / SOURCE}: already there and not a checkpoint the demo "
                         "finished writing; not touched (choose another --demo-dir, or "
                         "remove it yourself)")
    work = Path(tempfile.mkdtemp(prefix=".source-", dir=root))
    write_marker(root, {**marker, "writing": work.name, "writing_id": _folder_id(work)})
    return work


def finish_source(root: Path, work: Path):
    """Record the checkpoint written in `work`, file by file, then rename it DIR/source."""
    root = Path(root)
    marker = read_marker(root) or {}
    write_marker(root, {**marker, "source": file_sizes(work), "writing": work.name})
    os.rename(work, root / SOURCE)
    write_marker(root, {**marker, "source": file_sizes(root / SOURCE), "writing": None})


def claim_model(root: Path):
    """Record that the demo writes its model in DIR/model (called before converting,
    only when nothing is there yet)."""
    root = Path(root)
    write_marker(root, {**(read_marker(root) or {}), "model": MODEL})


def source_is_complete(root: Path) -> bool:
    """DIR/source is the checkpoint the demo wrote, every file there as recorded."""
    marker = read_marker(root)
    return (marker is not None and marker.get("source") is not None
            and not _source_problems(Path(root), marker["source"]))


def _source_problems(root: Path, recorded: Dict[str, int]) -> List[str]:
    src = root / SOURCE
    if src.is_symlink() or not src.is_dir():
        return [f"{src} is not a folder"]
    problems = []
    for top, dirs, files in os.walk(src):
        for name in dirs + files:
            full = Path(top) / name
            rel = full.relative_to(src).as_posix()
            if full.is_symlink() or not (full.is_dir() or full.is_file()):
                problems.append(rel)
            elif full.is_file() and recorded.get(rel) != full.lstat().st_size:
                problems.append(rel)
    return sorted(problems)


def check_demo_files(root: Path) -> dict:
    """The marker of `root`, if everything it claims may be deleted: ModelError for
    a folder without one, or a claimed folder holding anything the demo did not
    write (nothing is deleted then)."""
    from deltafin_mlx.format.catalog import check_removable

    root = Path(root)
    marker = read_marker(root)
    if marker is None:
        raise ModelError(f"{root}: no {MARKER_NAME} here, so nothing in it is known to be the "
                         "demo's; nothing removed")
    if _foreign_writing(root, marker):
        raise ModelError(f"{root / marker['writing']}: not the folder the demo was writing in; "
                         "nothing removed")
    if marker["model"] == MODEL and os.path.lexists(root / MODEL):
        check_removable(root / MODEL)
    if marker["source"] is not None and os.path.lexists(root / SOURCE):
        foreign = _source_problems(root, marker["source"])
        if foreign:
            more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
            raise ModelError(f"{root / SOURCE}: holds files the demo did not write ("
                             f"{', '.join(foreign[:3])}{more}); nothing removed")
    return marker


def remove_demo_files(root: Path) -> int:
    """Delete what the demo's marker names in `root` (check_demo_files first), then
    the marker, and `root` when nothing else is left; returns the bytes freed."""
    from deltafin_mlx.format.catalog import dir_bytes, remove_model_dir

    root = Path(root)
    marker = check_demo_files(root)
    freed = 0
    if marker["model"] == MODEL and os.path.lexists(root / MODEL):
        freed += remove_model_dir(root / MODEL)
    if marker["source"] is not None and os.path.lexists(root / SOURCE):
        freed += dir_bytes(root / SOURCE)
        shutil.rmtree(root / SOURCE)
    if marker["writing"]:
        shutil.rmtree(root / marker["writing"], ignore_errors=True)
    (root / MARKER_NAME).unlink()
    if not any(root.iterdir()):
        root.rmdir()
    return freed
