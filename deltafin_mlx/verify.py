"""`deltafin-run verify MODEL`: check every byte of a model directory.

Every file the manifest lists must resolve inside the directory, be a regular
file of its recorded size and have its recorded checksum; every bank record its
CRC-32 (so a damaged bank names the layer and expert). One pass over each file.

    deltafin-run verify MODEL [--json] [--debug]
"""

import json
import sys
import time
import zlib

from .integrity import CHUNK, bank_files, parse_checksum, resolve_inside
from .manifest import ModelError, read_manifest


def verify_model(path, progress=None) -> dict:
    """Check every file of the model at `path`. Returns a report (files, bytes,
    seconds, whether whole-file checksums were recorded); raises ModelError naming
    the first damaged file (and record). `progress(done_bytes, total_bytes, rel)`
    is called as bytes are checked."""
    from .bank import BankError, read_layout

    start = time.perf_counter()
    m = read_manifest(path, check_files=False)
    from .manifest import check_model_files

    check_model_files(m)  # inside, regular, sizes
    total = sum(m.files.values())
    done = [0]

    def advance(n, rel):
        done[0] += n
        if progress:
            progress(done[0], total, rel)

    banks = {entry["bank"]: int(layer) for layer, entry in m.experts["layers"].items()}
    for rel in sorted(m.files):
        real, _ = resolve_inside(m.path, rel)
        want = parse_checksum(m.checksums.get(rel)) if m.checksums else None
        if rel in banks:
            try:
                layout = read_layout(real)
            except BankError as e:
                raise ModelError(str(e)) from None
            crc = _check_bank(real, rel, banks[rel], layout, lambda n: advance(n, rel))
        else:
            crc = _crc_file(real, lambda n: advance(n, rel))
        if want is not None and crc != want:
            raise ModelError(f"{m.path / rel}: modified since conversion (damaged or edited: "
                             f"CRC-32 {crc:08x}, the manifest says {want:08x})")
    return {
        "model": str(m.path),
        "files": len(m.files),
        "bytes": total,
        "banks": len(bank_files(m)),
        "whole_file_checksums": bool(m.checksums),
        "seconds": time.perf_counter() - start,
    }


def _crc_file(real, advance) -> int:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    crc = 0
    with open(real, "rb") as f:
        while True:
            n = f.readinto(buf)
            if not n:
                return crc & 0xFFFFFFFF
            crc = zlib.crc32(view[:n], crc)
            advance(n)


def _check_bank(real, rel, layer, layout, advance) -> int:
    """The whole file's CRC-32, checking each record's own CRC on the way."""
    rs = layout.record_size
    per_chunk = max(1, CHUNK // rs)
    buf = bytearray(per_chunk * rs)
    view = memoryview(buf)
    with open(real, "rb") as f:
        header = f.read(layout.header_size)
        crc = zlib.crc32(header)
        advance(len(header))
        expert = 0
        while expert < layout.num_experts:
            want = min(per_chunk, layout.num_experts - expert) * rs
            n = f.readinto(view[:want])
            if n != want:
                raise ModelError(f"{real}: truncated at record {expert + n // rs}")
            for i in range(n // rs):
                rec = view[i * rs:(i + 1) * rs]
                if zlib.crc32(rec) & 0xFFFFFFFF != int(layout.checksums[expert + i]):
                    raise ModelError(f"{real}: record {expert + i} (layer {layer} expert "
                                     f"{expert + i}) is damaged (CRC-32 mismatch)")
            crc = zlib.crc32(view[:n], crc)
            advance(n)
            expert += n // rs
    return crc & 0xFFFFFFFF


def parser():
    from .cli import Parser  # one-line usage errors, as every deltafin-run command

    p = Parser(prog="deltafin-run verify",
                                description="Check every file and expert record of a model.")
    p.add_argument("model")
    p.add_argument("--json", action="store_true")
    p.add_argument("--debug", action="store_true")
    return p


def cmd_verify(argv) -> int:
    args = parser().parse_args(argv)
    bar = None
    if sys.stderr.isatty() and not args.json:
        from tqdm import tqdm

        bar = tqdm(unit="B", unit_scale=True, desc="verifying", leave=False)

    def progress(done, total, rel):
        if bar is not None:
            bar.total = total
            bar.set_postfix_str(rel, refresh=False)
            bar.update(done - bar.n)

    try:
        report = verify_model(args.model, progress)
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        print(json.dumps(report))
    else:
        note = "" if report["whole_file_checksums"] else (
            " (an older manifest without whole-file checksums: sizes and expert records "
            "checked)")
        print(f"ok: {report['files']} files, {report['bytes'] / 1e9:.3f} GB verified in "
              f"{report['seconds']:.1f} s{note}")
    return 0
