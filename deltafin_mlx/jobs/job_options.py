"""A job's options, recorded beside its output and checked when it resumes.

A resumed job appends to what an earlier run wrote, so the two runs must have
asked for the same thing: a rerun with another `-n`, `--temp` or `--top-logprobs`
would leave an output whose lines mean different things, with nothing in them to
tell which. The options that shape the results (not the budget or batch size,
which never change a greedy token) are written once, as `OUT.options.json`, when
the output is started, and a rerun with any of them different is refused, naming
them. An output written before options were recorded resumes unchecked (it says
so) and gets its record from that run. stdout (`-o -`) has no resume, so no record.
"""

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

from deltafin_mlx.errors import JobError
from deltafin_mlx.jobs.results_file import STDOUT, read_regular, write_failed

SUFFIX = ".options.json"
# A record holds a few flags (stop strings the longest): far below this.
RECORD_MAX_BYTES = 1 << 20


def activation_record(choice: str) -> dict:
    """--activation-dtype, which changes tokens and log-probabilities, in a record:
    only where not `auto`, so that records from before it resume."""
    return {} if choice == "auto" else {"--activation-dtype": choice}


def record_path(out_path) -> Path:
    return Path(f"{out_path}{SUFFIX}")


def _shown(flag: str, value) -> str:
    if value is True:
        return flag
    if value is False or value is None:
        return f"no {flag}"
    if isinstance(value, list):
        return " ".join(f"{flag} {json.dumps(v)}" for v in value) or f"no {flag}"
    return f"{flag} {value}"


def check_options(out_path, options: dict, started: bool, record: bool = True) -> Optional[str]:
    """Check `options` ({flag: value}, JSON-able) against OUT's record, or write the
    record; `started`: OUT already holds results. Returns a note to show, if any;
    raises JobError when the record differs. `record=False`: only check (before
    OUT's lines are read, so that a file of other lines gets no record)."""
    if out_path == STDOUT:  # no resume, so no record
        return None
    path = record_path(out_path)
    wanted = json.loads(json.dumps(options))  # as it reads back (tuples as lists)
    recorded = _read(path) if os.path.lexists(path) else None
    if started and recorded is not None:
        differ = [k for k in sorted(set(wanted) | set(recorded))
                  if wanted.get(k) != recorded.get(k)]
        if differ:
            was = ", ".join(_shown(k, recorded.get(k)) for k in differ)
            now = ", ".join(_shown(k, wanted.get(k)) for k in differ)
            raise JobError(f"{out_path} was written with {was}; this run asks for {now}: "
                             "rerun with the same options, or write to another output file")
        return None
    if not record:
        return None
    _write(path, wanted)
    if started:
        return (f"{out_path} records no options (written before they were recorded): "
                "resuming without checking them, and recording this run's")
    return None


def _read(path: Path) -> dict:
    """The record at `path`: a regular file (a FIFO or device is refused unread) of a
    JSON object, {flag: value}."""
    data = read_regular(path, "options record", RECORD_MAX_BYTES)
    try:
        recorded = json.loads(data)
        if not isinstance(recorded, dict):
            raise ValueError(f"a JSON {type(recorded).__name__}, not an object")
    except (ValueError, RecursionError) as e:
        raise JobError(f"{path}: not the options this output was written with "
                       f"({str(e)[:200]}); delete it to resume without checking them") from None
    return recorded


def _write(path: Path, options: dict):
    """The record, written whole: a temporary file of this process's own (removed
    if the write fails), renamed over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(options, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise write_failed(path, e) from None
        raise
