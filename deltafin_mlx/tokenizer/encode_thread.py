"""One thread that runs every tiktoken encode of the process.

tiktoken keeps 128 copies of its split regex and picks one by a hash of the
calling thread's id; each copy grows its own match cache the first time it is
used. A threaded server starts a thread per connection, so over a few hundred
connections nearly every copy fills up (measured in docs/PERFORMANCE.md,
"Serving memory"), and none is ever given back. Encoding on one long-lived
thread keeps a single copy warm whatever thread asks."""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_executor = None
_worker = None


def _mark_worker():
    global _worker
    _worker = threading.current_thread()


def _forget_executor():
    # A forked child has no encode thread: it starts its own when it first encodes.
    global _executor, _worker
    _executor, _worker = None, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_executor)


def run_on_encode_thread(fn, *args):
    """fn(*args) on the encode thread, its result or its exception here. Called
    from the encode thread itself (fn encoding again), or once the interpreter is
    shutting down (no new thread may start), it runs in place."""
    global _executor
    if threading.current_thread() is _worker:
        return fn(*args)
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="deltafin-encode",
                                           initializer=_mark_worker)
    try:
        future = _executor.submit(fn, *args)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
        return fn(*args)
    return future.result()
