"""Reading expert records from bank files into cache slots, on background threads.

Direct I/O: O_DIRECT on Linux, F_NOCACHE on macOS, so the page cache keeps no second
copy of what the expert cache already holds. Where a filesystem refuses O_DIRECT
(tmpfs) the reader falls back to buffered reads and drops the pages it read.
"mmap" mode maps each bank and copies records out of the mapping instead.

A read lands straight in its slot (one `preadv` scattered over the slot arrays)
when every section is a whole number of 4096-byte blocks, as all of Kimi K3's are;
otherwise it goes through an aligned staging buffer and is copied into the slot.

Each record's CRC-32 (from its bank header) is checked on the reader thread:
by default on the record's first read in this process (`RECORD_CHECKS` "first"; a
record read again after eviction is the same bytes from the same file), on every
read with --verify ("every"), or never ("off", for benchmarks). A damaged record
is a ReadError naming it, never silently wrong weights (docs/PERFORMANCE.md has
what the check costs).
"""

import errno
import mmap
import os
import queue
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from deltafin_mlx.format.aligned import aligned_empty
from deltafin_mlx.format.bank import ALIGN, BankLayout
from deltafin_mlx.format.dtypes import NUMPY, widen
from deltafin_mlx.errors import ReadError

F_NOCACHE = 48  # macOS fcntl
READ_RETRIES = 2
RECORD_CHECKS = ("first", "every", "off")


class ReadCancelled(Exception):
    """A speculative read dropped before it started (its slot holds nothing)."""


@dataclass
class BankFile:
    path: str
    layout: BankLayout
    fd: int
    direct: bool
    mapping: Optional[mmap.mmap] = None
    retired_fds: List[int] = field(default_factory=list)
    checked: Optional[np.ndarray] = None  # bool per expert: its CRC has been checked

    def __post_init__(self):
        if self.checked is None and self.layout is not None:  # a linked source has none
            self.checked = np.zeros(self.layout.num_experts, dtype=bool)

    @property
    def staging_bytes(self) -> int:
        """The staging buffer one read of this bank may need."""
        return self.layout.record_size

    def close(self):
        if self.mapping is not None:
            self.mapping.close()
        for fd in [self.fd, *self.retired_fds]:
            os.close(fd)


def open_bank(path, layout: BankLayout, mode: str = "direct") -> BankFile:
    path = str(path)
    if mode == "mmap":
        fd = os.open(path, os.O_RDONLY)
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        return BankFile(path, layout, fd, False, mapping)
    direct = False
    fd = None
    if mode == "direct" and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            direct = True
        except OSError:
            fd = None  # e.g. tmpfs refuses O_DIRECT: buffered reads below
    if fd is None:
        fd = os.open(path, os.O_RDONLY)
        if mode == "direct" and sys.platform == "darwin":
            import fcntl

            fcntl.fcntl(fd, F_NOCACHE, 1)
            direct = True
    return BankFile(path, layout, fd, direct)


@dataclass
class ReadJob:
    bank: BankFile
    expert: int
    targets: Dict[str, np.ndarray]  # section name -> slot view to fill
    speculative: bool
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    cancelled: bool = False
    started: bool = False  # a thread has taken it (set under the reader's lock)


class Reader:
    """Runs read jobs on `threads` background threads (0: in the caller's thread)."""

    def __init__(self, record_size: int, threads: int = 1, checks: str = "first",
                 staging_bytes: Optional[int] = None):
        if checks not in RECORD_CHECKS:
            raise ValueError(f"checks must be one of {RECORD_CHECKS}")
        self.record_size = record_size
        self.staging_bytes = staging_bytes or record_size
        self.checks = checks
        self.threads = threads
        self.bytes_read = 0
        self.reads = 0
        self.busy_seconds = 0.0  # summed over threads: wall time inside reads
        self._lock = threading.Lock()
        self._queue: "queue.PriorityQueue" = queue.PriorityQueue()
        self._seq = 0
        self._local = threading.local()
        self._workers = [
            threading.Thread(target=self._work, name=f"deltafin-reader-{i}", daemon=True)
            for i in range(threads)
        ]
        for w in self._workers:
            w.start()

    def submit(self, job: ReadJob) -> ReadJob:
        """Queue `job`: demand reads before every speculative one (in order of
        submission within each kind); a speculative job cancelled before a
        thread takes it is dropped unread."""
        if self.threads == 0:
            self._run(job)
            return job
        with self._lock:
            self._seq += 1
            seq = self._seq
        self._queue.put((1 if job.speculative else 0, seq, job))
        return job

    def cancel(self, job: ReadJob) -> bool:
        """Drop `job` if no thread has taken it yet: True when it is certain the
        job will never write its targets."""
        with self._lock:
            if job.started:
                return False
            job.cancelled = True
            return True

    def wait(self, job: ReadJob):
        job.done.wait()
        if job.error is not None:
            raise job.error

    def close(self):
        for _ in self._workers:
            self._queue.put((2, 0, None))
        for w in self._workers:
            w.join(timeout=5)

    def _work(self):
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            self._run(job)

    def _staging(self) -> np.ndarray:
        buf = getattr(self._local, "staging", None)
        if buf is None:
            buf = self._local.staging = aligned_empty(self.staging_bytes)
        return buf

    def _run(self, job: ReadJob):
        try:
            with self._lock:
                job.started = not job.cancelled
            if job.cancelled:
                raise ReadCancelled()
            start = time.perf_counter()
            check = self.checks != "off" and job.bank.layout.checksums is not None and (
                self.checks == "every" or not job.bank.checked[job.expert])
            read_into(job.bank, job.expert, job.targets, self._staging(), check)
            if check:
                job.bank.checked[job.expert] = True
            took = time.perf_counter() - start
            with self._lock:
                self.bytes_read += self.record_size
                self.reads += 1
                self.busy_seconds += took
        except BaseException as e:  # handed to the waiting thread
            job.error = e
        finally:
            job.done.set()


def read_into(bank, expert: int, targets: Dict[str, np.ndarray], staging: np.ndarray, verify: bool):
    """One expert into its slot views: a bank's record (`read_record`), or what a
    bank of another kind reads itself (linked experts, engine/linked_reader.py)."""
    own = getattr(bank, "read_into", None)
    if own is not None:
        own(expert, targets, staging, verify)
    else:
        read_record(bank, expert, targets, staging, verify)


def _direct_scatter_ok(layout: BankLayout, targets: Dict[str, np.ndarray]) -> bool:
    """Can one preadv fill the slot views straight from the file?"""
    offset = 0
    for s in layout.sections:
        t = targets[s.name]
        if (s.offset != offset
            or s.nbytes % ALIGN
            or t.nbytes != s.nbytes
            or t.ctypes.data % ALIGN
            or t.dtype.itemsize * t.size != s.nbytes
            or not t.flags.c_contiguous
            or t.dtype != _disk_dtype(s)):
            return False
        offset += s.nbytes
    return offset == layout.record_size


def _disk_dtype(section):
    return np.dtype(NUMPY[section.dtype])


def _pread_full(bank: BankFile, buffers: List[memoryview], offset: int, nbytes: int,
                at_least: Optional[int] = None):
    """Fill `buffers` (nbytes) from `offset`; `at_least` accepts a read that the
    file's end cut short past that many bytes (an aligned read's slack)."""
    for attempt in range(READ_RETRIES + 1):
        try:
            n = os.preadv(bank.fd, buffers, offset)
        except OSError as e:
            if e.errno == errno.EINVAL and bank.direct and sys.platform != "darwin":
                # A filesystem that accepted O_DIRECT at open but refuses the read:
                # carry on with buffered reads (their pages are dropped after use).
                _reopen_buffered(bank)
                continue
            if attempt == READ_RETRIES:
                raise ReadError(f"{bank.path}: read of {nbytes} bytes at offset {offset} failed "
                                f"({e.strerror or e})") from None
            continue
        if n == nbytes or (at_least is not None and n >= at_least):
            return
        if attempt == READ_RETRIES:
            raise ReadError(f"{bank.path}: short read at offset {offset} ({n} of {nbytes} bytes; "
                            "file truncated?)")


def _reopen_buffered(bank: BankFile):
    # The old descriptor stays open until the bank closes: another reader
    # thread may be using it right now.
    bank.retired_fds.append(bank.fd)
    bank.fd, bank.direct = os.open(bank.path, os.O_RDONLY), False


def read_record(bank: BankFile, expert: int, targets: Dict[str, np.ndarray],
                staging: np.ndarray, verify: bool):
    layout = bank.layout
    offset = layout.record_offset(expert)
    size = layout.record_size
    if bank.mapping is not None:
        # Touching a mapped page past the end of a file truncated since it was
        # mapped kills the process (SIGBUS): check the size first.
        actual = os.fstat(bank.fd).st_size
        if actual < offset + size:
            raise ReadError(
                f"{bank.path}: short read at offset {offset} (the file is {actual} bytes, "
                f"the record ends at {offset + size}; file truncated?)"
            )
        record = np.frombuffer(bank.mapping, dtype=np.uint8, count=size, offset=offset)
        try:
            if verify:
                _check(bank, expert, zlib.crc32(record))
            _copy_sections(layout, record, targets)
        finally:
            # An error's traceback keeps this frame: holding the view there would
            # keep the mapping from ever being closed (BufferError at close).
            del record
        return
    if bank.direct and _direct_scatter_ok(layout, targets):
        views = [memoryview(targets[s.name].reshape(-1).view(np.uint8)) for s in layout.sections]
        _pread_full(bank, views, offset, size)
        if verify:
            crc = 0
            for v in views:
                crc = zlib.crc32(v, crc)
            _check(bank, expert, crc)
        return
    staging = staging[:size]  # the reader's buffer fits the largest layer's records
    _pread_full(bank, [memoryview(staging)], offset, size)
    if not bank.direct and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(bank.fd, offset, size, os.POSIX_FADV_DONTNEED)
    if verify:
        _check(bank, expert, zlib.crc32(staging))
    _copy_sections(layout, staging, targets)


def _check(bank: BankFile, expert: int, crc: int):
    expected = int(bank.layout.checksums[expert])
    if (crc & 0xFFFFFFFF) != expected:
        raise ReadError(
            f"{bank.path}: checksum mismatch in layer {bank.layout.layer} expert {expert} "
            f"(record at offset {bank.layout.record_offset(expert)}): the bank is corrupt"
        )


def _copy_sections(layout: BankLayout, record: np.ndarray, targets: Dict[str, np.ndarray]):
    for name, src in layout.split_record(record).items():
        copy_section(targets[name], src)


def copy_section(dst: np.ndarray, src: np.ndarray):
    """A section's bytes as read (its disk dtype) into its slot view."""
    if dst.dtype == src.dtype:
        dst[...] = src
    else:
        widen(dst, src)
