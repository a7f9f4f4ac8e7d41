"""Deltafin's request checks inside plain `mlx_lm.server --trust-remote-code`
serving a Deltafin model through the drop-in (mlx_lm_shim.py), as far as they
can reach there. When the drop-in's model loads inside mlx_lm.server, `install`
wraps mlx-lm's APIHandler so that every later request is checked first by
server/schema.py (token ids in the vocabulary: mlx-lm would index past the
logits, a segfault; stop strings, top_k, empty prompts, content other than text,
so no URL is fetched) and its prompt tokens against the planned context (the
reply cut to what is left), and so that mlx-lm decodes no more sequences at once
than the plan holds, prefills in the plan's passes and keeps no more prompt
cache than the plan's KV/state bytes.

What it cannot do there (mlx-lm's own code runs first or around it): bound a
body before mlx-lm reads and parses it whole, admit requests with a queue and
503, keep the generation thread alive after an exception, size the listen
backlog, or check anything before the model has loaded (a request then is
refused as "still loading"). `deltafin-run serve` does all of these.
"""

import json
import logging
import sys
import threading

from deltafin_mlx import compat
from deltafin_mlx.errors import RequestError
from deltafin_mlx.server import schema

log = logging.getLogger("deltafin_mlx.server")
_lock = threading.Lock()
_limits = {}  # id(model) -> (RequestLimits, plan)


def _limits_of(model, tokenizer):
    from deltafin_mlx.engine.runtime import find_runtime
    from deltafin_mlx.server.app import longest_token_bytes
    from deltafin_mlx.server.vocab import model_vocab

    with _lock:
        if id(model) not in _limits:
            state = find_runtime(model)
            if state is None:
                return None
            inner = getattr(model, "_inner", model)
            vocab = model_vocab(inner)
            _limits[id(model)] = (schema.RequestLimits(
                vocab=vocab, context=state.plan.context,
                max_text_bytes=state.plan.context * longest_token_bytes(tokenizer, vocab)),
                state.plan)
        return _limits[id(model)]


def install():
    """Wrap mlx_lm.server's APIHandler (once), if mlx_lm.server is running."""
    server = sys.modules.get("mlx_lm.server")
    if server is None or getattr(server.APIHandler, "_deltafin_guard", False):
        return
    handler = server.APIHandler
    mlx_lm_validate = handler.validate_model_parameters
    mlx_lm_handle = handler.handle_completion

    def validate_model_parameters(self):
        provider = self.response_generator.model_provider
        if provider.model is None:
            raise ValueError("the model is still loading; retry in a moment")
        found = _limits_of(provider.model, provider.tokenizer)
        if found is not None:
            limits, plan = found
            try:
                schema.check_completion(self.body, self.path != "/v1/completions", limits)
            except RequestError as e:
                raise ValueError(str(e)) from None
            _fit_to_plan(self.response_generator.cli_args, plan)
        mlx_lm_validate(self)

    def handle_completion(self, request, stop_words):
        provider = self.response_generator.model_provider
        tokenizer = provider.tokenizer
        found = _limits_of(provider.model, tokenizer)
        if found is not None:
            limits = found[0]
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
                self._set_completion_headers(400)
                self.end_headers()
                self.wfile.write(json.dumps({"error": why}).encode())
                return
            self.max_tokens = min(self.max_tokens, limits.context - n)
        return mlx_lm_handle(self, request, stop_words)

    handler.validate_model_parameters = validate_model_parameters
    handler.handle_completion = handle_completion
    handler._deltafin_guard = True
    log.warning("deltafin: requests to mlx_lm.server are checked as deltafin-run serve checks "
                "them, but bodies are not bounded before parsing, there is no admission "
                "queue and an exception still stops mlx-lm's generation thread: use "
                "`deltafin-run serve` for untrusted clients")


def _fit_to_plan(cli_args, plan):
    """mlx-lm's batching and prompt cache within what the plan holds (read by
    mlx-lm when its generation thread makes its batch generator)."""
    if getattr(cli_args, "_deltafin_fitted", False):
        return
    from deltafin_mlx.batch import PREFILL_BATCH

    cli_args.decode_concurrency = min(cli_args.decode_concurrency, plan.sequences)
    cli_args.prompt_concurrency = min(cli_args.prompt_concurrency, plan.sequences,
                                      PREFILL_BATCH)
    cli_args.prefill_step_size = min(cli_args.prefill_step_size,
                                     max(1, plan.prefill_pass // cli_args.prompt_concurrency))
    if cli_args.prompt_cache_bytes is None:
        cli_args.prompt_cache_bytes = plan.state_bytes
    cli_args._deltafin_fitted = True
