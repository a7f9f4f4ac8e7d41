"""`deltafin-run serve MODEL`: mlx-lm's OpenAI-compatible server for a Deltafin
model, with every request checked before it reaches the model.

    deltafin-run serve MODEL [--budget B] [--context N] [--max-body-bytes N]
                             [--host 127.0.0.1] [--port 8080] [mlx_lm.server options]

It is mlx_lm.server (its handler, batching, prompt cache and response format),
given a Deltafin model loaded once at start and a handler subclass that refuses
with HTTP 400, and keeps serving:
- bodies that are not JSON objects, too large, nested too deep or without a valid
  Content-Length;
- `logit_bias` ids outside the vocabulary (mlx-lm would index past the logits:
  a segfault) and non-finite numbers;
- prompts longer than the context the memory plan was made for (naming both
  numbers); `max_tokens` is cut to what the context has left;
- adapters (any "model" a request names is answered by the served model; mlx-lm
  would load the path it names).
A client that disconnects stops its generation at the next token. Prompts are
processed 256 tokens at a time (mlx-lm: 2048) so their activations stay small
next to the budget, and the prompt cache holds at most the KV bytes the plan set
aside. After every
request Deltafin's counters (expert hits, misses, bytes read) are logged.
"""

import io
import json
import logging
import math
import select
import socket
import sys
from types import SimpleNamespace

from deltafin_mlx.cli.options import Parser
from deltafin_mlx.errors import RequestError, UsageError
from deltafin_mlx.engine.runtime import runtime, find_runtime
from deltafin_mlx import compat

DEFAULT_MAX_BODY = 16 << 20


def peer_closed(sock) -> bool:
    """Whether the client closed its end (readable with nothing to read)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class ClientGone(Exception):
    pass


def make_handler(base, settings):
    """A subclass of mlx-lm's APIHandler that validates requests first."""

    class DeltafinHandler(base):
        def _refuse(self, status: int, message: str):
            logging.info("refused (%d): %s", status, message)
            compat.send_completion_headers(self, status)
            self.end_headers()
            self.wfile.write(json.dumps({"error": message}).encode())

        def do_POST(self):
            length = self.headers.get("Content-Length")
            try:
                length = int(length)
            except (TypeError, ValueError):
                return self._refuse(411 if length is None else 400,
                                    "a valid Content-Length header is required")
            if length < 0:
                return self._refuse(400, f"Content-Length {length} is negative")
            if length > settings.max_body:
                return self._refuse(413, f"the body is {length} bytes, more than "
                                         f"{settings.max_body}")
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError) as e:
                return self._refuse(400, f"the body is not valid JSON ({type(e).__name__}: "
                                         f"{str(e)[:200]})")
            if not isinstance(body, dict):
                return self._refuse(400, "the body must be a JSON object")
            # mlx-lm's handler reads and parses the body itself.
            self.rfile = io.BytesIO(raw)
            return super().do_POST()

        def validate_model_parameters(self):
            super().validate_model_parameters()
            vocab = settings.vocab
            for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                         "presence_penalty", "frequency_penalty", "xtc_probability",
                         "xtc_threshold"):
                v = getattr(self, name, None)
                if isinstance(v, float) and not math.isfinite(v):
                    raise ValueError(f"{name} must be a finite number")
            for name in ("repetition_context_size", "presence_context_size",
                         "frequency_context_size"):
                v = getattr(self, name, 0)
                if isinstance(v, int) and v > settings.context:
                    raise ValueError(f"{name} {v} is more than the context of "
                                     f"{settings.context} tokens")
            if self.logit_bias is not None:
                for k, v in self.logit_bias.items():
                    if not 0 <= k < vocab:
                        raise ValueError(f"logit_bias names token id {k}, outside the "
                                         f"vocabulary (0..{vocab - 1})")
                    if not math.isfinite(v):
                        raise ValueError(f"logit_bias for token {k} is not finite")
            # Whatever "model" a client names, this model answers (mlx-lm would try
            # to load the named path).
            if self.adapter is not None:
                raise ValueError("adapters are not supported by deltafin-run serve")

        def handle_completion(self, request, stop_words):
            try:
                n = self._prompt_tokens(request)
            except RequestError as e:
                return self._refuse(400, str(e))
            if n + 1 > settings.context:
                return self._refuse(400, f"the prompt is {n} tokens; the planned context is "
                                         f"{settings.context} tokens (deltafin-run serve "
                                         "--context N plans for more)")
            self.max_tokens = min(self.max_tokens, settings.context - n)
            real = self.response_generator
            self.response_generator = _Watched(real, self.connection)
            try:
                super().handle_completion(request, stop_words)
            except (ClientGone, BrokenPipeError, ConnectionResetError):
                logging.info("client disconnected; its generation was stopped")
                self.close_connection = True
            finally:
                self.response_generator = real
                log_counters(settings.model)

        def _prompt_tokens(self, request) -> int:
            """The prompt's length, tokenized as mlx-lm's generation thread will."""
            tokenizer = settings.tokenizer
            args = SimpleNamespace(chat_template_kwargs=self.chat_template_kwargs)
            if request.request_type == "text" and not isinstance(request.prompt, str):
                raise RequestError("prompt must be a string")
            try:
                prompt = compat.server_prompt_tokens(self.response_generator, tokenizer,
                                                     request, args)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # messages of any shape; template errors
                raise RequestError(f"cannot build the prompt ({type(e).__name__}: "
                                   f"{str(e)[:200]})") from None
            return len(prompt)

    return DeltafinHandler


class _Watched:
    """The response generator, as one request's handler sees it: stops the
    generation when the client has gone (checked before each token is sent and
    during prompt processing)."""

    def __init__(self, inner, sock):
        self._inner = inner
        self._sock = sock

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, request, args, progress_callback=None):
        holder = {}

        def progress(done, total):
            if peer_closed(self._sock) and "ctx" in holder:
                holder["ctx"].stop()
            if progress_callback is not None:
                progress_callback(done, total)

        ctx, responses = self._inner.generate(request, args, progress)
        holder["ctx"] = ctx

        def watched():
            for r in responses:
                if peer_closed(self._sock):
                    ctx.stop()
                    raise ClientGone()
                yield r

        return ctx, watched()


def log_counters(model):
    state = find_runtime(model)
    if state is None:
        return
    s = state.stats
    logging.info("[deltafin] experts: %d hits, %d misses (%.0f%% hit rate), %.1f MB read",
                 s.hits, s.misses, 100 * s.hit_rate, state.store.bytes_read / 1e6)


def parser():
    p = Parser(
        prog="deltafin-run serve", description=__doc__.splitlines()[0],
        epilog="Other options are mlx_lm.server's (e.g. --max-tokens, --prefill-step-size).")
    p.add_argument("model")
    p.add_argument("--budget", default=None, help="memory budget, e.g. 8GB")
    p.add_argument("--context", type=int, default=4096,
                   help="longest prompt plus reply to plan memory for (default 4096)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY)
    p.add_argument("--reader-threads", type=int, default=1)
    p.add_argument("--verify", action="store_true", help="check expert checksums on read")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--debug", action="store_true")
    return p


def cmd_serve(argv) -> int:
    args, rest = parser().parse_known_args(argv)
    if args.context <= 0:
        raise UsageError(f"--context must be 1 or more, not {args.context}")
    if args.max_body_bytes <= 0:
        raise UsageError("--max-body-bytes must be 1 or more")
    import mlx_lm.server as server

    from deltafin_mlx.engine.load import load

    model, tokenizer = load(args.model, memory_budget=args.budget, context=args.context,
                            reader_threads=args.reader_threads, verify=args.verify,
                            progress=sys.stderr.isatty())
    settings = SimpleNamespace(
        model=model, tokenizer=tokenizer, context=args.context, max_body=args.max_body_bytes,
        vocab=model_vocab(model))

    class DeltafinProvider(server.ModelProvider):
        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            from mlx_lm.models.cache import make_prompt_cache

            self.model_key = (model_path, adapter_path, draft_model_path)
            self.model, self.tokenizer = model, tokenizer
            self.processor, self.draft_model = None, None
            self.is_batchable = all(hasattr(c, "merge") for c in make_prompt_cache(model))

        def load(self, model_path, adapter_path=None, draft_model_path=None):
            if self.model is None:
                self._load("default_model")
            return self.model, self.tokenizer

    handler = make_handler(server.APIHandler, settings)

    def run(host, port, provider):
        response_generator = server.ResponseGenerator(provider, server.LRUPromptCache(
            provider.cli_args.prompt_cache_size))
        logging.info("deltafin-run serve: %s, budget %d bytes, context %d tokens",
                     args.model, runtime(model).plan.budget, args.context)
        compat.run_http_server(host, port, response_generator, handler_class=handler)

    if not any(a.startswith("--prefill-step-size") for a in rest):
        # A prompt is prefilled in the plan's passes: mlx-lm's 2048 tokens per call
        # would hold activations the budget does not have (docs/PERFORMANCE.md).
        rest += ["--prefill-step-size", str(runtime(model).plan.prefill_pass)]
    if not any(a.startswith("--prompt-cache-bytes") for a in rest):
        # The prompt cache keeps KV caches of earlier requests: at most what the
        # plan set aside for KV at the planned context.
        rest += ["--prompt-cache-bytes", str(runtime(model).plan.state_bytes)]
    server.ModelProvider, server.run = DeltafinProvider, run
    sys.argv = ["deltafin-run serve", "--model", args.model, "--host", args.host,
                "--port", str(args.port), *rest]
    server.main()
    return 0


def model_vocab(model) -> int:
    """Rows of the embedding table (what token ids index)."""
    from deltafin_mlx.model.modules import find_path, get_module

    embed = get_module(model, find_path(model, "embed_tokens"))
    return getattr(type(embed), "vocab_size", None) or embed.weight.shape[0]
