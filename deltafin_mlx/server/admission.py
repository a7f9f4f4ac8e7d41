"""Admission control, in two steps, so no number of concurrent clients can together
push the server past its budget and none can hold a place it does not use:

- `body(length)`: before a body is read, its declared length is reserved out of
  `body_bytes` (bodies being read or checked, or waiting for a generation place,
  hold at most that much memory together). A body that arrives is checked before
  anything else, so a client that stalls its body holds only its own reservation
  (and its connection, until the handler's byte-rate floor closes it), never a
  generation place, and a refusal of a bad body waits for nothing.
- `place()`: a checked request takes one of the `active` places (the sequences
  whose KV/recurrent state the memory plan holds) to generate.

At most `queued` requests wait, for either step, at most `wait_seconds` each;
beyond, a request is refused at once with HTTP 503.
"""

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionConfig:
    active: int  # requests generating together (the plan's sequences)
    queued: int  # requests waiting for a place or for room for their body
    wait_seconds: float  # the longest a request waits before it is refused
    body_bytes: int  # bodies held at once (being read, checked or waiting), in bytes


class Busy(Exception):
    """No place for the request: answered 503 with Retry-After."""


class Admission:
    def __init__(self, config: AdmissionConfig):
        self.config = config
        self._cond = threading.Condition()
        self.active = 0
        self.waiting = 0
        self.refused = 0
        self.body_bytes = 0  # reserved by bodies now held

    def _wait_until(self, ready):
        """Wait (holding the condition) until `ready()`, as one of the `queued`
        waiters, for at most `wait_seconds`; else Busy."""
        c = self.config
        if ready():
            return
        if self.waiting >= c.queued:
            self.refused += 1
            raise Busy(f"the server is busy ({self.active} requests running, "
                       f"{self.waiting} waiting); retry later")
        self.waiting += 1
        deadline = time.monotonic() + c.wait_seconds
        try:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0:
                    self.refused += 1
                    raise Busy(f"the server is busy: no place within "
                               f"{c.wait_seconds:g} s; retry later")
                self._cond.wait(left)
        finally:
            self.waiting -= 1

    @contextmanager
    def body(self, length: int):
        """Hold `length` bytes of the bodies' budget while the block runs (a body
        larger than the whole budget waits until no other body is held)."""
        with self._cond:
            self._wait_until(lambda: self.body_bytes == 0 or
                             self.body_bytes + length <= self.config.body_bytes)
            self.body_bytes += length
        try:
            yield
        finally:
            with self._cond:
                self.body_bytes -= length
                self._cond.notify_all()  # waiters of both kinds share the condition

    @contextmanager
    def place(self):
        """Hold one of the `active` places while the block runs."""
        with self._cond:
            self._wait_until(lambda: self.active < self.config.active)
            self.active += 1
        try:
            yield
        finally:
            with self._cond:
                self.active -= 1
                self._cond.notify_all()
