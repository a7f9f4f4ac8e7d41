"""mlx-lm's generation thread, made to survive: an exception inside it fails the
requests it had taken (each gets the error, answered HTTP 500) and the loop
starts again, so one request can never stop generation for every client.
mlx-lm's own thread dies on the first exception and /health stays 503 until a
restart.

The requests a loop had taken are known by their response queues: a request
still waiting in the queue is served by the next loop as if nothing happened.
"""

import logging
import threading
from queue import Empty, Queue

from deltafin_mlx import compat

log = logging.getLogger("deltafin_mlx.server")


class GenerationFailed(RuntimeError):
    """The generation loop raised while this request was in it."""


def resilient_generator_class(base):
    """A subclass of mlx-lm's ResponseGenerator (`base`) whose loop restarts."""

    class ResilientGenerator(base):
        def __init__(self, model_provider, prompt_cache, on_restart=None):
            self._taken = set()
            self._taken_lock = threading.Lock()
            self._on_restart = on_restart
            super().__init__(model_provider, prompt_cache)

        def _run_generate(self):
            while not compat.generation_stopping(self):
                try:
                    compat.server_generation_loop(self)
                    return
                except Exception as e:  # noqa: BLE001 - any failure fails its requests only
                    log.error("generation failed (%s: %s); its requests get the error and "
                              "generation goes on", type(e).__name__, str(e)[:300])
                    with self._taken_lock:
                        taken, self._taken = self._taken, set()
                    error = GenerationFailed(f"generation failed ({type(e).__name__}); "
                                             "other requests are unaffected")
                    for q in taken:
                        q.put(error)
                    if self._on_restart is not None:
                        self._on_restart()

        def _next_request(self, timeout=None):
            request = super()._next_request(timeout)
            if request is not None:
                with self._taken_lock:
                    self._taken.add(request[0])
            return request

        def generate(self, request, generation_args, progress_callback=None):
            """mlx-lm's generate, forgetting the request's queue when it ends."""
            response_queue = Queue()
            self.requests.put((response_queue, request, generation_args))

            def finished():
                with self._taken_lock:
                    self._taken.discard(response_queue)

            def inner():
                try:
                    while True:
                        response = self._await(response_queue)
                        if response is None:
                            break
                        if isinstance(response, Exception):
                            raise response
                        if isinstance(response, tuple):
                            if progress_callback is not None:
                                progress_callback(*response)
                            continue
                        yield response
                finally:
                    finished()

            ctx = self._await(response_queue)
            if isinstance(ctx, Exception):
                finished()
                raise ctx
            return ctx, inner()

        def _await(self, response_queue):
            while True:
                try:
                    return response_queue.get(timeout=1.0)
                except Empty:
                    if not compat.generation_thread_alive(self):
                        raise GenerationFailed("the generation thread has stopped") from None

        @property
        def is_healthy(self):
            return compat.generation_thread_alive(self)

    return ResilientGenerator
