"""Deltafin's request checks inside plain `mlx_lm.server --trust-remote-code`
serving a Deltafin model through the drop-in (dropin/shim.py), as far as they
can reach there. When mlx-lm builds the drop-in's model classes inside
mlx_lm.server (as its model starts loading), `install_checks` wraps mlx-lm's APIHandler so that every
request is checked first by
server/schema.py (token ids in the vocabulary: mlx-lm would index past the
logits, a segfault; stop strings, top_k, empty prompts, content other than text,
so no URL is fetched) and its prompt tokens against the planned context (the
reply cut to what is left); once the model has loaded, `fit_batching` makes
mlx-lm's batch generator decode no more sequences at once than the plan holds and
prefill in the plan's passes.

What it cannot do there (mlx-lm's own code runs first or around it): bound a
body before mlx-lm reads and parses it whole, admit requests with a queue and
503, keep the generation thread alive after an exception, size the listen
backlog, bound the prompt cache (mlx-lm's --prompt-cache-bytes; changing it on
one rank of mlx.launch would desynchronise the ranks), or check anything before
the first moment of loading in the handler: mlx-lm starts listening as its
generation thread starts loading, so a request in the instant before the drop-in
is imported passes mlx-lm's own checks only (one arriving later waits for the
model, as mlx-lm would). What would crash or stop the generation thread is
checked again as that thread takes each request (`check_taken_request`): it
imports the drop-in before it takes any. `deltafin-run serve` does all of these.
"""

import json
import logging
import sys
import threading
import time

from deltafin_mlx import compat
from deltafin_mlx.errors import RequestError
from deltafin_mlx.server import schema

log = logging.getLogger("deltafin_mlx.server")
_lock = threading.Lock()
LOAD_WAIT_SECONDS = 600  # a request that arrives while the model loads waits this long
_limits = {}  # id(model) -> RequestLimits


def _limits_of(model, tokenizer):
    from deltafin_mlx.engine.runtime import find_runtime
    from deltafin_mlx.generation.engine import model_limits

    with _lock:
        if id(model) not in _limits:
            if find_runtime(model) is None:
                return None
            _limits[id(model)] = model_limits(model, tokenizer)
        return _limits[id(model)]


def install_checks():
    """Wrap mlx_lm.server's APIHandler (once), if mlx_lm.server is running: called
    (shim.patch_mlx_lm) when mlx-lm builds the drop-in's model classes, as its
    model starts loading."""
    server = sys.modules.get("mlx_lm.server")
    if server is None or getattr(server.APIHandler, "_deltafin_guard", False):
        return
    handler = server.APIHandler
    mlx_lm_validate = handler.validate_model_parameters
    mlx_lm_handle = handler.handle_completion

    def validate_model_parameters(self):
        provider = self.response_generator.model_provider
        deadline = time.monotonic() + LOAD_WAIT_SECONDS
        while provider.model is None or provider.tokenizer is None:  # mlx-lm queues it too
            if time.monotonic() > deadline:
                raise ValueError("the model is still loading; retry later")
            time.sleep(0.1)
        limits = _limits_of(provider.model, provider.tokenizer)
        if limits is not None:
            try:
                schema.check_completion(self.body, self.path != "/v1/completions", limits)
            except RequestError as e:
                raise ValueError(str(e)) from None
        mlx_lm_validate(self)

    def handle_completion(self, request, stop_words):
        provider = self.response_generator.model_provider
        tokenizer = provider.tokenizer
        limits = _limits_of(provider.model, tokenizer)
        if limits is not None:
            try:
                n = len(compat.server_prompt_tokens(self.response_generator, tokenizer,
                                                    request, self))
            except Exception as e:  # noqa: BLE001 - a template failing on the request
                n, why = -1, f"cannot build the prompt ({type(e).__name__})"
            else:
                why = ("the prompt is empty" if n == 0 else
                       f"the prompt is {n} tokens; the planned context is {limits.context} "
                       "tokens (DELTAFIN_CONTEXT=N plans for more)"
                       if n + 1 > limits.context else None)
            if why is not None:
                compat.set_completion_headers(self, 400)
                self.end_headers()
                self.wfile.write(json.dumps({"error": why}).encode())
                return
            self.max_tokens = min(self.max_tokens, limits.context - n)
        return mlx_lm_handle(self, request, stop_words)

    handler.validate_model_parameters = validate_model_parameters
    handler.handle_completion = handle_completion
    handler._deltafin_guard = True
    # mlx-lm listens before its generation thread has loaded the model (and so
    # imported this drop-in): a request that came in first passed mlx-lm's own
    # checks only. That thread imports the drop-in before it takes any request, so
    # checking each request it takes again catches those.
    compat.gate_server_requests(check_taken_request)
    log.warning("deltafin: requests to mlx_lm.server are checked as deltafin-run serve checks "
                "them, but bodies are not bounded before parsing, there is no admission "
                "queue and an exception still stops mlx-lm's generation thread: use "
                "`deltafin-run serve` for untrusted clients")


def check_taken_request(response_generator, args):
    """What mlx-lm's generation thread must never see of a request (`args`, its
    GenerationArguments), checked as that thread takes it: a logit_bias id outside
    the vocabulary (mlx-lm would index past the logits, a segfault), and what
    would stop the thread: a top_k beyond the vocabulary (its sampler's
    argpartition), stop strings that are not non-empty strings, a seed beyond
    64 bits. Raises ValueError, which mlx-lm's handler answers with the reason."""
    provider = response_generator.model_provider
    if provider is None:  # a generator serving no model of ours
        return
    limits = _limits_of(provider.model, provider.tokenizer)
    if limits is None:
        return
    try:
        bias = args.logits.logit_bias
        if bias:
            schema.logit_bias({str(k): v for k, v in bias.items()}, limits.vocab)
        schema.integer({"top_k": args.sampling.top_k}, "top_k", 0, limits.vocab - 1)
        schema.stops(args.stop_words)
        schema.integer({"seed": args.seed}, "seed", 0, schema.MAX_SEED)
    except RequestError as e:
        raise ValueError(str(e)) from None


def fit_batching(model):
    """mlx-lm's batch generator within `model`'s plan (once), if mlx_lm.server is
    running: called when the drop-in's model has loaded, before mlx-lm's
    generation thread makes its first batch generator."""
    from deltafin_mlx.engine.runtime import find_runtime

    server = sys.modules.get("mlx_lm.server")
    state = find_runtime(model)
    if server is None or state is None or getattr(server.BatchGenerator, "_deltafin", False):
        return
    server.BatchGenerator = _batch_generator_within(state.plan, server.BatchGenerator)


def _batch_generator_within(plan, make):
    """mlx-lm's BatchGenerator, decoding and prefilling no more sequences at once
    than `plan` holds, in the plan's passes. Installed when the model loads, in
    every rank's generation thread alike (under mlx.launch the ranks must batch
    identically)."""
    from deltafin_mlx.generation.engine import PREFILL_BATCH

    def batch_generator(model, *args, completion_batch_size=32, prefill_batch_size=8,
                        prefill_step_size=2048, **kwargs):
        decode = min(completion_batch_size, plan.sequences)
        prefill = min(prefill_batch_size, decode, PREFILL_BATCH)
        step = min(prefill_step_size, max(1, plan.prefill_pass // prefill))
        return make(model, *args, completion_batch_size=decode, prefill_batch_size=prefill,
                    prefill_step_size=step, **kwargs)

    batch_generator._deltafin = True
    return batch_generator
