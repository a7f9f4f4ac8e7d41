"""`deltafin-run verify MODEL`: check a converted model against what its format
records, reading every byte of every expert bank.

What is checked: the manifest parses; every file it lists exists with its recorded
size; config.json matches the checksum recorded at conversion; every bank header
matches the manifest; and every expert record matches the CRC-32 its bank header
holds for it. Each problem names the file (and the record); checking goes on past
a damaged file, so one run lists all the damage.
"""

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

from .bank import BankError, crc32, read_layout
from .manifest import read_manifest

CHUNK = 64 << 20  # bytes read at a time (whole records)


@dataclass
class VerifyReport:
    path: Path
    files_checked: int = 0
    records_checked: int = 0
    bytes_checked: int = 0
    problems: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_model(path, progress: Optional[Callable[[int, int], None]] = None) -> VerifyReport:
    """Check every file size, config.json's checksum and every expert record's CRC-32.

    progress(bytes_done, bytes_total) is called as bank bytes are checked. A manifest
    that cannot be read at all raises ModelError; any other damage is a problem in
    the report."""
    path = Path(path).expanduser()
    m = read_manifest(path, check_files=False)
    report = VerifyReport(path)
    damaged = set()
    for rel, size in m.files.items():
        report.files_checked += 1
        try:
            actual = (path / rel).stat().st_size
        except OSError:
            report.problems.append(f"{rel}: missing (the manifest lists it)")
            damaged.add(rel)
            continue
        if actual != size:
            report.problems.append(f"{rel}: {actual} bytes, the manifest says {size} "
                                   "(truncated or modified)")
            damaged.add(rel)
    want = m.source.get("config_sha256")
    if want and "config.json" not in damaged:
        try:
            got = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
        except OSError as e:
            got = f"unreadable ({e.strerror})"
        if got != want:
            report.problems.append("config.json: modified since conversion (its SHA-256 differs)")

    banks = []
    for layer in m.moe_layers:
        entry = m.experts["layers"][str(layer)]
        if entry["bank"] in damaged:
            continue
        try:
            layout = read_layout(path / entry["bank"], expect={
                "layer": layer, "num_experts": m.experts["num_experts"],
                "record_size": m.experts["record_size"], "header_size": entry["header_size"],
                "sections": m.experts["sections"]})
        except BankError as e:
            report.problems.append(f"{entry['bank']}: {str(e).split(': ', 1)[-1]}")
            continue
        banks.append((layer, entry["bank"], layout))

    total = sum(layout.num_experts * layout.record_size for _, _, layout in banks)
    done = 0
    if progress:
        progress(0, total)
    for layer, rel, layout in banks:
        try:
            for expert, ok, nbytes in _check_records(path / rel, layout):
                report.records_checked += 1
                report.bytes_checked += nbytes
                done += nbytes
                if not ok:
                    report.problems.append(
                        f"{rel}: record {expert} (expert {expert} of layer {layer}) does not "
                        "match its CRC-32")
                if progress:
                    progress(done, total)
        except OSError as e:
            report.problems.append(f"{rel}: cannot read ({e.strerror})")
    return report


def _check_records(path: Path, layout):
    """(expert, CRC matches, bytes) for each record of a bank, in order."""
    per_read = max(1, CHUNK // layout.record_size)
    fd = os.open(path, os.O_RDONLY)
    try:
        for first in range(0, layout.num_experts, per_read):
            n = min(per_read, layout.num_experts - first)
            offset = layout.record_offset(first)
            data = os.pread(fd, n * layout.record_size, offset)
            if hasattr(os, "posix_fadvise"):  # a verify pass should not fill the page cache
                os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)
            view = memoryview(data)
            for i in range(n):
                rec = view[i * layout.record_size : (i + 1) * layout.record_size]
                ok = len(rec) == layout.record_size and crc32(rec) == int(layout.checksums[first + i])
                yield first + i, ok, len(rec)
    finally:
        os.close(fd)


def verify_parser():
    from .cli import Parser

    p = Parser(prog="deltafin-run verify", description="Check a converted model: every "
               "file's size, config.json's checksum, every expert record's CRC-32.")
    p.add_argument("model", help="a directory written by deltafin-convert")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def run_verify(argv) -> int:
    import json
    import sys

    from .cliutil import human_bytes

    args = verify_parser().parse_args(argv)
    bar = None
    progress = None
    if sys.stderr.isatty() and not args.json:
        from tqdm import tqdm

        bar = tqdm(total=0, unit="B", unit_scale=True, desc="verifying", leave=False,
                   file=sys.stderr, dynamic_ncols=True)

        def progress(done, total):
            bar.total = total
            bar.n = done
            bar.refresh()

    try:
        report = verify_model(args.model, progress)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps({"model": str(report.path), "ok": report.ok,
                          "files_checked": report.files_checked,
                          "records_checked": report.records_checked,
                          "bytes_checked": report.bytes_checked, "problems": report.problems}))
    else:
        for problem in report.problems:
            print(f"deltafin-run verify: damaged: {problem}", file=sys.stderr)
        summary = (f"{report.files_checked} files, {report.records_checked} expert records "
                   f"({human_bytes(report.bytes_checked)}) checked")
        if report.ok:
            print(f"{report.path}: OK: {summary}")
        else:
            print(f"{report.path}: {len(report.problems)} problem(s) found; {summary}",
                  file=sys.stderr)
    return 0 if report.ok else 1
