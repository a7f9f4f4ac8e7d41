"""mlx-lm's generation thread, made to survive: an exception inside it fails the
requests it had taken (each gets the error, answered HTTP 500) and the loop
starts again, so one request can never stop generation for every client.
mlx-lm's own thread dies on the first exception and /health stays 503 until a
restart.

The requests a loop had taken are known by their response queues: a request
still waiting in the queue is served by the next loop as if nothing happened.

It also splits a chat prompt at the end of the chat template's preamble when the
conversation has no system message of its own (K3's template opens every
conversation with a ~345-token system message of its own): mlx-lm's prompt cache
keeps the state at the end of a prompt's first segment, so every new conversation
starts from the cached preamble instead of prefilling it again. A prompt is always
prefilled in the same segments, cached or not, so a reply is the same either way.

`turn_taking` makes mlx-lm's batch generator alternate between a decode step and a
prefill pass when it has both to do: mlx-lm runs a pass of the next prompt in the
same call as the decode step and hands the step's tokens to the server only after
it, so each client already generating would wait a whole pass per token, and a
client whose prompt was just prefilled would wait one more for its first token.
"""

import json
import logging
import threading
import time
from queue import Empty, Queue

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.server import CompletionRequest

from deltafin_mlx import compat
from deltafin_mlx.generation.stream import common_prefix

log = logging.getLogger("deltafin_mlx.server")

PREAMBLES = 16  # preambles kept (one per set of template arguments and tools)


class GenerationFailed(RuntimeError):
    """The generation loop raised while this request was in it."""


def resilient_generator_class(base):
    """A subclass of mlx-lm's ResponseGenerator (`base`) whose loop restarts."""

    class ResilientGenerator(base):
        def __init__(self, model_provider, prompt_cache, on_restart=None):
            self._taken = set()
            self._taken_lock = threading.Lock()
            self._on_restart = on_restart
            self._preambles = {}  # (template arguments, tools) -> the preamble's tokens
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

        def _tokenize(self, tokenizer, request, args):
            prompt, segments, types, state, vision = super()._tokenize(tokenizer, request, args)
            if request.request_type == "chat" and vision is None and types[0] == "user":
                n = common_prefix(self._preamble(tokenizer, request, args), segments[0])
                if 0 < n < len(segments[0]):
                    segments = [segments[0][:n], segments[0][n:], *segments[1:]]
                    types = ["system", *types]
            return prompt, segments, types, state, vision

        def _preamble(self, tokenizer, request, args):
            """What the template puts before a conversation's first user message
            and its text: the template rendered for one empty user message."""
            key = json.dumps([args.chat_template_kwargs, request.tools], sort_keys=True,
                             default=str)
            if key not in self._preambles:
                empty = CompletionRequest("chat", "", [{"role": "user", "content": ""}],
                                          request.tools, request.role_mapping)
                prompt = super()._tokenize(tokenizer, empty, args)[0]
                if len(self._preambles) >= PREAMBLES:
                    self._preambles.clear()
                self._preambles[key] = prompt
            return self._preambles[key]

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


def turn_taking(base):
    """A subclass of mlx-lm's BatchGenerator (`base`) whose `next()` does either one
    decode step of the sequences generating or one prefill pass of the prompt being
    admitted, in turns, when there are both; so a decode step's tokens reach their
    clients before the next pass runs. The arithmetic is mlx-lm's own, in the same
    order for each sequence."""

    class TurnTakingBatchGenerator(base):
        _decode_next = True  # after a prefill pass: its first token goes out at once

        def _next(self):
            generating = self._generation_batch
            prefilling = bool(self._unprocessed_sequences or self._currently_processing)
            full = not self._currently_processing and \
                len(generating) >= self.completion_batch_size
            if not len(generating) or not prefilling or full:
                self._decode_next = True
                return super()._next()
            if self._decode_next:  # a decode step alone: mlx-lm's first half
                self._decode_next = False
                tic = time.perf_counter()
                responses = generating.next()
                self._counters.decode_time += time.perf_counter() - tic
                self._counters.generation_tokens += len(responses)
                self._counters.generation_steps += 1
                if self._counters.generation_steps % 512 == 0:
                    mx.clear_cache()
                return [], responses
            # A prefill pass alone: mlx-lm's step with the generating sequences set
            # aside; a prompt that finishes joins them.
            self._decode_next = True
            self._generation_batch = GenerationBatch.empty(self.model, self.sampler)
            try:
                prompt_responses, _ = super()._next()
            finally:
                joined, self._generation_batch = self._generation_batch, generating
                if len(joined):
                    generating.extend(joined)
            return prompt_responses, []

    return TurnTakingBatchGenerator
