"""Check every byte of a converted model against what its format records (the
library of `deltafin-run verify MODEL`, deltafin_mlx/cli/verify.py).

What is checked: the manifest parses; every file it lists resolves inside the model
directory (after symlinks) and is a regular file, and config.json passes the rules
every command reads it with (format/model_dir.py; else the check stops: the
directory itself is hostile or edited); each file has its recorded size and its
recorded whole-file CRC-32;
every bank header matches the manifest, and every expert record the CRC-32 its bank
header holds for it; config.json names no code outside the directory for mlx-lm or
transformers to execute (a danger, reported as such: no check can stop mlx-lm
executing it). Each problem names the file (and the record); checking goes on
past a damaged file, so one run lists all the damage.
"""

import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

from deltafin_mlx.format.bank import BankError, read_layout
from deltafin_mlx.format.integrity import (CHUNK, check_file, file_checksum, parse_checksum,
                                          resolve_inside)
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.format.model_dir import code_named, read_config
from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.links import check_linked_sources, read_links


@dataclass
class VerifyReport:
    path: Path
    files_checked: int = 0
    records_checked: int = 0
    bytes_checked: int = 0
    problems: List[str] = field(default_factory=list)
    dangers: List[str] = field(default_factory=list)  # code config.json names outside

    @property
    def ok(self) -> bool:
        return not self.problems and not self.dangers


def verify_model(path, progress: Optional[Callable[[int, int], None]] = None) -> VerifyReport:
    """Check every file of the model at `path`, every byte of it.

    progress(bytes_done, bytes_total) is called as bytes are checked. A manifest that
    cannot be read, or a listed file that resolves outside the directory or is not a
    regular file, raises ModelError; any other damage is a problem in the report."""
    path = Path(path).expanduser()
    m = read_manifest(path, check_files=False)
    report = VerifyReport(path)
    real = {rel: resolve_inside(m.path, rel) for rel in m.files}  # raises on escapes
    report.dangers = code_named(m.path)
    try:
        _check_config(m)
    except ModelError as e:
        if not report.dangers:
            raise
        report.problems.append(str(e))  # the dangers are what to say first

    sound = []
    for rel, size in sorted(m.files.items()):
        report.files_checked += 1
        actual = real[rel][1].st_size
        if actual != size:
            report.problems.append(f"{rel}: {actual} bytes, the manifest says {size} "
                                   "(truncated or modified)")
        else:
            sound.append(rel)

    banks = {entry["bank"]: int(layer) for layer, entry in m.experts["layers"].items()
             if "bank" in entry}
    layouts = {}
    for rel in sound:
        if rel in banks:
            layer = banks[rel]
            entry = m.experts["layers"][str(layer)]
            try:
                layouts[rel] = read_layout(real[rel][0], expect={
                    "layer": layer, "num_experts": m.experts["num_experts"],
                    "record_size": m.layer_experts(layer)["record_size"],
                    "header_size": entry["header_size"],
                    "sections": m.layer_experts(layer)["sections"]})
            except BankError as e:
                report.problems.append(f"{rel}: {str(e).split(': ', 1)[-1]}")
    sound = [rel for rel in sound if rel not in banks or rel in layouts]

    total = sum(m.files[rel] for rel in sound)
    if m.linked is not None:  # the experts' bytes, read where they lie in the source
        total += m.experts["num_experts"] * sum(
            sec["nbytes"] for layer in m.moe_layers for sec in m.layer_experts(layer)["sections"])
    done = [0]

    def advance(n):
        done[0] += n
        report.bytes_checked += n
        if progress:
            progress(done[0], total)

    if progress:
        progress(0, total)
    for rel in sound:
        before = len(report.problems)
        try:
            if rel in layouts:
                crc = _check_bank(real[rel][0], rel, banks[rel], layouts[rel], report, advance)
            else:
                crc = file_checksum(real[rel][0], advance)
        except OSError as e:
            report.problems.append(f"{rel}: cannot read ({e.strerror})")
            continue
        want = parse_checksum(m.checksums[rel])
        if crc != want and len(report.problems) == before:
            report.problems.append(f"{rel}: modified since conversion (damaged or edited: "
                                   f"CRC-32 {crc:08x}, the manifest says {want:08x})")
    if m.linked is not None:
        _check_linked(m, report, advance)
    return report


def _check_config(m):
    """config.json by the rules every command reads it with (model_dir.read_config:
    its hash in the manifest's source, its `model_file`), so verify never passes a
    model that run refuses; a refusal raises, in the line run gives. Bytes that do not
    match their listed checksum are damage, reported with the other files'."""
    if "config.json" in m.files:
        try:
            check_file(m, "config.json")
        except ModelError:
            return
    read_config(m.path, m)


def _check_linked(m, report: VerifyReport, advance):
    """Linked experts: every source file still as recorded, and every expert's
    bytes where its table says, against the CRC-32 taken during the conversion."""
    try:
        real = check_linked_sources(m.linked)
    except ModelError as e:
        report.problems.append(str(e))
        return
    fds = {rel: os.open(p, os.O_RDONLY) for rel, p in real.items()}
    try:
        for layer in m.moe_layers:
            try:
                layout = read_links(m.links_path(layer), m.layer_experts(layer), layer,
                                    m.linked["files"])
            except ModelError as e:
                report.problems.append(str(e))
                continue
            by_name = layout.section_by_name
            for e in range(layout.num_experts):
                got = {}
                for run in layout.runs(e):
                    fd = fds[layout.files[run.file]]
                    data = memoryview(os.pread(fd, run.end - run.start, run.start))
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, run.start, len(data), os.POSIX_FADV_DONTNEED)
                    for name, off in run.parts:
                        got[name] = data[off:off + by_name[name].nbytes]
                    advance(len(data))
                crc = 0
                for sec in layout.sections:
                    crc = zlib.crc32(got[sec.name], crc)
                report.records_checked += 1
                if crc & 0xFFFFFFFF != int(layout.checksums[e]):
                    report.problems.append(
                        f"{m.links_path(layer).name}: layer {layer} expert {e}: its bytes in "
                        f"the linked source ({', '.join(sorted({layout.files[r.file] for r in layout.runs(e)}))}) "
                        "changed since the conversion (CRC-32 mismatch)")
    finally:
        for fd in fds.values():
            os.close(fd)


def _check_bank(real: Path, rel: str, layer: int, layout, report: VerifyReport, advance) -> int:
    """The whole file's CRC-32, checking each record's own CRC on the way (read in
    large sequential chunks, without filling the page cache)."""
    rs = layout.record_size
    per_chunk = max(1, CHUNK // rs)
    fd = os.open(real, os.O_RDONLY)
    try:
        header = os.pread(fd, layout.header_size, 0)
        crc = zlib.crc32(header)
        advance(len(header))
        for first in range(0, layout.num_experts, per_chunk):
            n = min(per_chunk, layout.num_experts - first)
            offset = layout.record_offset(first)
            data = os.pread(fd, n * rs, offset)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)
            view = memoryview(data)
            for i in range(n):
                rec = view[i * rs:(i + 1) * rs]
                report.records_checked += 1
                if zlib.crc32(rec) & 0xFFFFFFFF != int(layout.checksums[first + i]):
                    report.problems.append(f"{rel}: record {first + i} (layer {layer} expert "
                                           f"{first + i}) is damaged (CRC-32 mismatch)")
            crc = zlib.crc32(view, crc)
            advance(len(data))
        return crc & 0xFFFFFFFF
    finally:
        os.close(fd)

