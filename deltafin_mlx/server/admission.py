"""Admission control: at most `active` requests generate at once (the sequences
whose KV/recurrent state the memory plan holds), at most `queued` more wait for a
place, and anything beyond is refused at once with HTTP 503, so no number of
concurrent clients can together push the server past its budget. A request
takes its place before its body is read: a waiting request holds a socket and
a thread, never a body.
"""

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionConfig:
    active: int  # requests generating together (the plan's sequences)
    queued: int  # requests waiting for a place
    wait_seconds: float  # the longest a request waits before it is refused


class Busy(Exception):
    """No place for the request: answered 503 with Retry-After."""


class Admission:
    def __init__(self, config: AdmissionConfig):
        self.config = config
        self._cond = threading.Condition()
        self.active = 0
        self.waiting = 0
        self.refused = 0

    @contextmanager
    def place(self):
        """Hold one of the `active` places while the block runs."""
        c = self.config
        with self._cond:
            if self.active >= c.active and self.waiting >= c.queued:
                self.refused += 1
                raise Busy(f"the server is busy ({self.active} requests running, "
                           f"{self.waiting} waiting); retry later")
            self.waiting += 1
            deadline = time.monotonic() + c.wait_seconds
            try:
                while self.active >= c.active:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.refused += 1
                        raise Busy(f"the server is busy: no place within "
                                   f"{c.wait_seconds:g} s; retry later")
                    self._cond.wait(left)
            finally:
                self.waiting -= 1
            self.active += 1
        try:
            yield
        finally:
            with self._cond:
                self.active -= 1
                self._cond.notify()
