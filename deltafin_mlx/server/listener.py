"""The listening side of `deltafin-run serve`: a threaded HTTP server with a thread
per connection, at most `max_connections` of them. A connection beyond that is
answered 503 at once from the accepting thread and closed, so clients that open
connections and send nothing cannot make the server spawn threads without bound.
A client that goes away (a reset, a broken pipe, a timeout) is one debug line,
never a traceback; another exception in a connection's thread is one error line.
"""

import json
import logging
import sys
import threading
import time
from http.server import ThreadingHTTPServer

log = logging.getLogger("deltafin_mlx.server")

DRAIN_LIMIT = 1 << 20  # what a refused connection may already have sent


class DeltafinHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, family, backlog: int, max_connections: int):
        """Listening at `address` (of socket `family`), the handler to be set."""
        self.address_family, self.request_queue_size = family, backlog
        self.max_connections = max_connections
        self.open_connections = 0
        self.refused_connections = 0
        self._count_lock = threading.Lock()
        self._last_refusal_log = -1e9
        super().__init__(address, None)

    def _enter(self) -> bool:
        with self._count_lock:
            if self.open_connections >= self.max_connections:
                self.refused_connections += 1
                return False
            self.open_connections += 1
            return True

    def _leave(self):
        with self._count_lock:
            self.open_connections -= 1

    def process_request(self, request, client_address):
        if not self._enter():
            now = time.monotonic()
            if now - self._last_refusal_log >= 1.0:  # a flood is a line a second
                self._last_refusal_log = now
                log.info("refusing connections: %d are open, the most (%d refused so far)",
                         self.max_connections, self.refused_connections)
            refuse_connection(request, self.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self._leave()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._leave()

    def handle_error(self, request, client_address):
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            log.debug("%s went away: %s", client_address[0], type(error).__name__)
            return
        log.error("a connection from %s failed: %s: %s", client_address[0],
                  type(error).__name__, error)


def refuse_connection(sock, cap: int):
    """Answer 503 without reading a request: drop what the client has already sent
    (closing with it unread would reset the connection under the answer), then
    send the answer; never blocks the accepting thread."""
    body = json.dumps({"error": {"message": f"the server has {cap} connections open, "
                                            "the most it takes; retry later",
                                 "type": "server_busy", "code": 503}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    try:
        sock.setblocking(False)
        dropped = 0
        while dropped < DRAIN_LIMIT:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            dropped += len(chunk)
    except (BlockingIOError, InterruptedError):
        pass
    except OSError:
        return
    try:
        sock.send(head.encode() + body)
    except OSError:
        pass
