"""Linked experts (format version 3): where each expert's bytes lie in the source
checkpoint's safetensors files, instead of a copy of them in a bank.

`deltafin-convert --link-experts` writes one link table per MoE layer,
`experts/layer-L.links` (docs/FORMAT.md, "Linked experts"): for every expert and
every record section, the source file and the offset of its bytes (their size is the
section's), and a CRC-32 of the expert's bytes computed during the conversion. The
manifest records the source root (its real path) and, for every source file a table
names, its size, mtime and the SHA-256 of its safetensors header (the fingerprint).

Files outside the model directory are read only under that root: each is checked as a
regular file resolving inside it with its recorded fingerprint before anything is
read, so a source that was edited, truncated, moved or deleted is refused with one
line, and so is a record pointing past its file or outside the root.
"""

import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np

from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.bank import Section
from deltafin_mlx.format.safetensors import read_header_bytes
from deltafin_mlx.units import is_int

MAGIC = b"DFLINK\x00\x01"
LINKED_VERSION = 3
# One table entry per (expert, section): file index, reserved, offset in the file.
ENTRY = np.dtype([("file", "<u4"), ("reserved", "<u4"), ("offset", "<u8")])


def _align8(n: int) -> int:
    return (n + 7) // 8 * 8


def source_fingerprint(path) -> dict:
    """What a linked source file must still be: size, mtime and its header's hash."""
    raw, _ = read_header_bytes(path, ModelError)
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "header_sha256": hashlib.sha256(raw).hexdigest()}


def write_links(path, layer: int, section_names: Sequence[str], files: Sequence[str],
                entries: np.ndarray, checksums: np.ndarray):
    """Write one layer's link table (`entries`: ENTRY of shape (experts, sections))."""
    meta = json.dumps({"format_version": LINKED_VERSION, "layer": layer,
                       "num_experts": int(entries.shape[0]), "sections": list(section_names),
                       "files": list(files), "checksum": "crc32"}, sort_keys=True).encode()
    head = MAGIC + struct.pack("<I", len(meta)) + meta
    head += b"\0" * (_align8(len(head)) - len(head))
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(head)
        f.write(np.ascontiguousarray(entries, dtype=ENTRY).tobytes())
        f.write(np.ascontiguousarray(checksums, dtype="<u4").tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Run:
    """One contiguous stretch of a source file holding some of an expert's sections."""

    file: int
    start: int
    end: int
    parts: List[Tuple[str, int]]  # (section name, its offset within the run)


@dataclass
class LinkedLayout:
    """One layer's link table, checked against the manifest and its source files."""

    layer: int
    num_experts: int
    record_size: int  # the slot layout's (as a bank record would be)
    sections: list  # the record's sections (bank.Section): the slots' layout
    files: List[str]  # relative to the source root
    entries: np.ndarray  # ENTRY (num_experts, len(sections))
    checksums: np.ndarray  # uint32 (num_experts,): over the sections' bytes in order
    slices: int = 1

    @property
    def held_sections(self):
        return self.sections

    @cached_property
    def section_by_name(self):
        return {s.name: s for s in self.sections}

    def runs(self, expert: int) -> List[Run]:
        """The expert's sections grouped into contiguous runs, as the offsets say
        (never assumed): one read per run."""
        row = self.entries[expert]
        order = sorted(range(len(self.sections)),
                       key=lambda i: (int(row[i]["file"]), int(row[i]["offset"])))
        runs: List[Run] = []
        for i in order:
            f, off, s = int(row[i]["file"]), int(row[i]["offset"]), self.sections[i]
            if runs and runs[-1].file == f and runs[-1].end == off:
                runs[-1].parts.append((s.name, off - runs[-1].start))
                runs[-1].end = off + s.nbytes
            else:
                runs.append(Run(f, off, off + s.nbytes, [(s.name, 0)]))
        return runs


def read_links(path, manifest_experts: dict, layer: int, linked_files: Dict[str, dict]):
    """Parse and check one link table: its sections are the manifest's, every file
    it names is a linked file of the manifest and every section lies inside it."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ModelError(f"{path}: cannot read link table ({e.strerror})") from None
    if raw[:8] != MAGIC or len(raw) < 12:
        raise ModelError(f"{path}: not a Deltafin link table (bad magic)")
    (jlen,) = struct.unpack("<I", raw[8:12])
    if 12 + jlen > len(raw):
        raise ModelError(f"{path}: corrupt link table (header length {jlen})")
    try:
        meta = json.loads(raw[12:12 + jlen])
        if not isinstance(meta, dict) or meta.get("format_version") != LINKED_VERSION:
            raise ValueError(f"format version {meta.get('format_version')!r:.40}")
        files, names, n = meta["files"], meta["sections"], meta["num_experts"]
        if not (isinstance(files, list) and all(isinstance(x, str) for x in files)):
            raise ValueError("files must be a list of paths")
        for key in ("layer", "num_experts"):  # true == 1, 8.0 == 8 would compare equal
            if not is_int(meta.get(key)):
                raise ValueError(f"{key} {meta.get(key)!r:.40} is not an integer")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ModelError(f"{path}: corrupt link table ({e})") from None
    sections = [Section.from_dict(d) for d in manifest_experts["sections"]]
    if (meta.get("layer") != layer or n != manifest_experts["num_experts"]
            or names != [s.name for s in sections] or meta.get("checksum") != "crc32"):
        raise ModelError(f"{path}: link table does not match the manifest (layer, experts "
                         "or sections)")
    start = _align8(12 + jlen)
    table = n * len(sections) * ENTRY.itemsize
    if len(raw) != start + table + 4 * n:
        raise ModelError(f"{path}: link table is {len(raw)} bytes, its header says "
                         f"{start + table + 4 * n} (truncated or modified)")
    entries = np.frombuffer(raw, ENTRY, n * len(sections), start).reshape(n, len(sections))
    sums = np.frombuffer(raw, "<u4", n, start + table).copy()
    for f in files:
        if f not in linked_files:
            raise ModelError(f"{path}: names {f!r:.200}, not a linked source file of the "
                             "manifest")
    if entries.size and int(entries["file"].max()) >= len(files):
        raise ModelError(f"{path}: corrupt link table (file index out of range)")
    sizes = np.array([linked_files[f]["size"] for f in files], dtype=np.uint64)
    nbytes = np.array([s.nbytes for s in sections], dtype=np.uint64)
    ends = entries["offset"] + nbytes[None, :]
    bad = np.argwhere((ends > sizes[entries["file"]]) | (ends < entries["offset"]))
    if len(bad):
        e, s = (int(x) for x in bad[0])
        raise ModelError(f"{path}: expert {e} {sections[s].name} lies past the end of "
                         f"{files[int(entries[e, s]['file'])]} (corrupt link table)")
    return LinkedLayout(layer, n, manifest_experts["record_size"], sections, list(files),
                        entries.copy(), sums)


def check_linked_file(root: str, rel: str, recorded: dict) -> Path:
    """The real path of linked source file `rel`, if it resolves inside the source
    root, is a regular file and still has its recorded fingerprint; ModelError
    saying which of these fails otherwise."""
    shown = os.path.join(root, rel)
    if (not isinstance(rel, str) or not rel or os.path.isabs(rel) or "\x00" in rel
            or ".." in Path(rel).parts):
        raise ModelError(f"linked source file {rel!r:.200} leaves the source root {root}")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, rel))
    if os.path.commonpath([real_root, real]) != real_root:
        raise ModelError(f"{shown}: resolves to {real}, outside the linked source root "
                         f"{real_root} (refused)")
    try:
        st = os.stat(real)
    except OSError:
        raise ModelError(f"{shown}: the linked source file is gone (moved or deleted since "
                         "the conversion; convert again)") from None
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"{shown}: linked source file is not a regular file")
    if st.st_size != recorded.get("size"):
        raise ModelError(f"{shown}: linked source file is {st.st_size} bytes, "
                         f"{recorded.get('size')} at conversion (truncated or changed; "
                         "convert again)")
    try:
        now = source_fingerprint(real)
    except ModelError as e:  # its header no longer reads: changed too
        raise ModelError(f"{e} (the linked source file changed since the conversion; "
                         "convert again)") from None
    if now != {k: recorded.get(k) for k in now}:
        raise ModelError(f"{shown}: linked source file changed since the conversion (its "
                         "mtime or header differs; convert again)")
    return Path(real)


def check_linked_sources(linked: dict) -> Dict[str, Path]:
    """Every linked source file of a manifest, checked: rel -> real path."""
    return {rel: check_linked_file(linked["root"], rel, rec)
            for rel, rec in sorted(linked["files"].items())}
