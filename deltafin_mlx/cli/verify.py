"""`deltafin-run verify MODEL`: check every file and every expert record of a
converted model (deltafin_mlx/format/verify.py says what is checked); each problem
is one line on stderr, and the exit code is 1 when there is any."""

import json
import sys

from deltafin_mlx.cli.common import printable
from deltafin_mlx.cli.options import Parser
from deltafin_mlx.format.verify import verify_model
from deltafin_mlx.units import human_bytes


def verify_parser():
    p = Parser(prog="deltafin-run verify", description="Check a converted model: every "
               "file's size and checksum, every expert record's CRC-32.")
    p.add_argument("model", help="a directory written by deltafin-convert")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def cmd_verify(argv) -> int:
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
                          "bytes_checked": report.bytes_checked,
                          "problems": report.problems, "dangerous": report.dangers}))
    else:
        for danger in report.dangers:
            print(f"deltafin-run verify: DANGEROUS: {printable(danger)}", file=sys.stderr)
        for problem in report.problems:
            print(f"deltafin-run verify: damaged: {printable(problem)}", file=sys.stderr)
        summary = (f"{report.files_checked} files, {report.records_checked} expert records "
                   f"({human_bytes(report.bytes_checked)}) checked")
        if report.ok:
            print(f"{printable(str(report.path))}: OK: {summary}")
        else:
            print(f"{printable(str(report.path))}: {len(report.problems) + len(report.dangers)} "
                  f"problem(s) found; {summary}", file=sys.stderr)
    return 0 if report.ok else 1
