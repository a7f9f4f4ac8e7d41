"""The files of a batch job: its input read line by line, its output appended to
under an exclusive lock, and the output's resume state found by a streaming scan.

A job may run for days and its output may hold hundreds of thousands of results,
so nothing here holds more than one line (at most `LINE_MAX_BYTES`) in memory, and
only the ids of answered requests are kept. Input and output must be regular
files (a FIFO would block, /dev/zero never end, /dev/full never hold a result);
`-` as the output is stdout, written without resume. Two jobs on one output would
both answer everything: the second is refused while the first holds its lock.
"""

import errno
import fcntl
import json
import os
import shutil
import stat
import sys
import tempfile
from typing import Callable, Iterator, Optional, Set, Tuple

from deltafin_mlx.errors import JobError
from deltafin_mlx.units import human_bytes
from deltafin_mlx.format.integrity import file_kind

# One line of input or output at most: a result holds its text, tokens and, with
# --logprobs, a number per token, so a long reply stays well below this.
LINE_MAX_BYTES = 64 << 20
STDOUT = "-"
STDIN = "-"


def open_regular(path, flags: int, what: str) -> int:
    """A descriptor for `path`, a regular file; opened non-blocking so that a FIFO
    cannot hold the open, and checked after opening so nothing is swapped in. Every
    file a job reads or writes by name opens here (perplexity's text and references,
    options records too)."""
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), 0o644)
    except OSError as e:
        raise JobError(f"{path}: cannot open the {what} ({e.strerror or e})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise JobError(f"{path}: the {what} must be a regular file (this is {file_kind(mode)})")
    os.set_blocking(fd, True)
    return fd


def read_regular(path, what: str, limit: int) -> bytes:
    """All of `path`, a regular file (open_regular) of at most `limit` bytes: a
    larger one is refused unread."""
    with os.fdopen(open_regular(path, os.O_RDONLY, what), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            data = f.read(limit + 1) if size <= limit else b""
        except OSError as e:
            raise JobError(f"{path}: cannot read the {what} ({e.strerror or e})") from None
    if size > limit or len(data) > limit:
        raise JobError(f"{path}: the {what} is {human_bytes(max(size, len(data)))}, more "
                       f"than the {human_bytes(limit)} it may have")
    return data


def check_regular(path, what: str, missing_ok: bool = False):
    """Refuse early (before a model loads) a `path` that is not a regular file
    (open_regular). `missing_ok`: an output not made yet. `-` (stdin, for an
    input) is read as it comes."""
    if (path == STDIN and what == "input") or (missing_ok and not os.path.exists(path)):
        return
    os.close(open_regular(path, os.O_RDONLY, what))


def check_not_input(in_path, out_path):
    """Refuse an output that is the input itself (the same file under any name): its
    lines would all read as answered and nothing would be done."""
    if out_path == STDOUT or in_path == STDIN:
        return
    try:
        same = os.path.samefile(in_path, out_path)
    except (OSError, ValueError):
        return  # an output not made yet (or unreadable: the open says so)
    if same:
        raise JobError(f"{out_path}: this is the input file {in_path}; results are "
                         "appended to the output, so give another output file")


def write_failed(path, e: OSError) -> JobError:
    """A failed write as one line naming the file it was for: "disk full" when that
    is why (a rerun resumes where the job stopped)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return JobError(f"{path}: disk full, no space left to write it; free space and "
                          "rerun to resume")
    return JobError(f"{path}: cannot write ({e.strerror or e}); rerun to resume")


def read_lines(f, limit: Optional[int] = None) -> Iterator[Tuple[int, Optional[bytes], bool]]:
    """(line number, bytes without the newline, whether a newline ended it) for each
    line of binary file `f`; None in place of a line longer than `limit`, skipped
    without being held (`limit`: LINE_MAX_BYTES)."""
    limit = LINE_MAX_BYTES if limit is None else limit
    n = 0
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        n += 1
        if len(raw) > limit:
            while raw and not raw.endswith(b"\n"):  # the rest of the long line
                raw = f.readline(1 << 20)
            yield n, None, raw.endswith(b"\n")
            continue
        complete = raw.endswith(b"\n")
        yield n, raw[:-1] if complete else raw, complete


_stdin_copy = None


def open_input(path):
    """The input as a binary file, from its start: a regular file, or for `-`
    stdin, copied once to an unnamed temporary file (a job reads its input more
    than once: counting and checking its ids, then preparing it a window at a
    time; a pipe can be read once, and holding it in memory would not be bounded)."""
    global _stdin_copy
    if path == STDIN:
        if _stdin_copy is None:
            try:
                copy = tempfile.TemporaryFile()  # unnamed: gone with the process
                shutil.copyfileobj(sys.stdin.buffer, copy)
                copy.flush()
            except OSError as e:  # the temporary folder's room, not the output's disk
                raise JobError(f"stdin: cannot keep a copy of the input in "
                               f"{tempfile.gettempdir()} ({e.strerror or e}); give the input "
                               "as a file, or set TMPDIR to a folder with room") from None
            _stdin_copy = copy
        f = os.fdopen(os.dup(_stdin_copy.fileno()), "rb")  # shares the offset: rewind
        f.seek(0)
        return f
    return os.fdopen(open_regular(path, os.O_RDONLY, "input"), "rb")


def result_key(rec) -> str:
    """The key a result line answers: its id as JSON text, or for a line that had
    no usable id, its line number."""
    if rec.get("id") is not None:
        return json.dumps(rec["id"])
    return f"line:{int(rec['line'])}"


class Results:
    """The output of a job, locked for this process: the keys it already answers
    (found by `scan`) and `write`, which appends one complete line with a single
    write and an fsync, so a kill leaves at most a last line cut short."""

    def __init__(self, path):
        self.path = path
        self.resumable = path != STDOUT
        if not self.resumable:
            self.fd = sys.stdout.fileno()
            return
        self.fd = open_regular(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, "output")
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise JobError(f"{path}: another batch job is writing to this output; wait for "
                             "it to finish or choose another output file") from None

    def scan(self, on_record: Optional[Callable[[dict], None]] = None) -> Set[str]:
        """Keys of the requests already answered (error lines included), each
        line's object handed to `on_record` too (a job that needs its values: it
        raises ValueError for a line that is not one of its own). A last line
        without its newline is what a kill mid-write leaves: it is truncated away.
        Any other line that is not a result refuses the output."""
        keys: Set[str] = set()
        if not self.resumable:
            return keys
        end = 0
        with os.fdopen(os.dup(self.fd), "rb") as f:
            f.seek(0)
            for n, raw, complete in read_lines(f):
                if not complete:
                    break  # the cut last line: truncated below
                end = f.tell()
                if raw is not None and not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                    keys.add(result_key(rec))
                    if on_record is not None:
                        on_record(rec)
                except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                    raise self._not_results(n) from None
        if end < os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, end)
            os.fsync(self.fd)
        return keys

    def _not_results(self, n: int) -> JobError:
        return JobError(f"{self.path}: line {n} is not a batch result; not appending to it "
                          "(use another output file)")

    def write(self, result: dict):
        try:
            data = (json.dumps(result, ensure_ascii=False) + "\n").encode("utf-8")
        except UnicodeEncodeError:  # a string UTF-8 cannot hold: JSON's escapes can
            data = (json.dumps(result) + "\n").encode("ascii")
        end = os.lseek(self.fd, 0, os.SEEK_END) if self.resumable else None
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
            if self.resumable:
                os.fsync(self.fd)
        except OSError as e:
            if not self.resumable:
                raise
            try:  # no cut line left behind: the output ends with its last whole result
                os.ftruncate(self.fd, end)
            except OSError:
                pass  # the next scan truncates it
            raise write_failed(self.path, e) from None

    def close(self):
        if self.resumable and self.fd >= 0:
            os.close(self.fd)  # releases the lock
        self.fd = -1
