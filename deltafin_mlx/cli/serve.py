"""`deltafin-run serve MODEL`: an OpenAI-compatible HTTP server for a Deltafin
model (deltafin_mlx/server/), every request checked before it reaches the model.

Endpoints: POST /v1/chat/completions, /v1/completions (streamed or not, logprobs
with top alternatives best first; /v1/completions also takes the legacy integer
`logprobs`), /tokenize {"content": TEXT} and /detokenize {"tokens": [IDS]};
GET /v1/models, /health and /metrics (requests, tokens and the expert cache's
hits, misses and bytes read, connections open and refused, in Prometheus' text
format).

What it guarantees, whatever clients send:
  - every value is checked first (types, ranges, lengths, nesting) and a bad one is
    HTTP 400 naming the field; token ids outside the vocabulary, prompts beyond the
    planned context and content other than text (images, URLs: nothing is ever
    fetched) are refused before any work;
  - memory stays within the plan: --sequences requests generate together (decoded
    in one batch, sharing expert reads), --queue more wait, and beyond that a
    request gets HTTP 503 at once; a body is no larger than the planned context
    can use, and bodies held at once are bounded in bytes;
  - a body is read and checked before its request takes a generation place, and
    must keep to a byte-rate floor (16 KiB/s after 5 s; slower is HTTP 408), so
    clients that stall their bodies hold no place, and a bad body waits for none;
  - at most --max-connections connections are open at once (beyond, a new one gets
    HTTP 503 and is closed), and one that has not sent a request's headers within
    --header-timeout seconds is closed;
  - a failure inside generation fails the requests it was serving (HTTP 500), not
    the server: generation goes on and /health stays 200;
  - a client that resets its connection stops its generation at the next token
    (one that only half-closes still gets its answer).
After every request one log line gives its tokens, times and the expert reads
made while it ran. Ctrl-C stops the server.

Plain `mlx_lm.server --trust-remote-code --model MODEL` also serves a Deltafin model,
through the drop-in deltafin_model.py (DELTAFIN_BUDGET, DELTAFIN_CONTEXT and
DELTAFIN_SEQUENCES stand in for the options). Once the model has loaded it checks
requests as this server does (values, vocabulary, content, context) and batches
within the plan, but it cannot bound a body before mlx-lm parses it, queue or refuse
with 503, survive an exception in mlx-lm's generation thread, size the listen backlog
or bound mlx-lm's prompt cache, and mlx-lm executes the model_file that config.json
names before any Deltafin code runs: use it for trusted clients only.
"""

import argparse
import json

from deltafin_mlx.cli.options import (Parser, add_load_options, load_options, positive,
                                      positive_or_auto, request_field)


def port(text):
    n = int(text)
    if not 1 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, not {n}")
    return n


def size(text):
    from deltafin_mlx.errors import BudgetError
    from deltafin_mlx.units import parse_size

    try:
        return parse_size(text)
    except BudgetError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cache_bytes(text):
    return 0 if text.strip() == "0" else size(text)


def json_object(text):
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def positive_number(text):
    v = float(text)
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, not {text}")
    return v


def parser():
    p = Parser(prog="deltafin-run serve", description=__doc__)
    p.add_argument("model", help="a directory written by deltafin-convert")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=8080, help="port to listen on")
    p.add_argument("--context", type=positive, default=4096,
                   help="tokens of prompt plus reply each request may use (memory is "
                   "planned for it)")
    p.add_argument("--sequences", type=positive_or_auto, default="auto",
                   help="requests generating together, each with its KV/state at --context "
                   "in the budget ('auto': the most the budget holds, at most 32)")
    p.add_argument("--queue", type=int, default=64,
                   help="requests that may wait for a place; beyond, HTTP 503")
    p.add_argument("--queue-seconds", type=float, default=300.0,
                   help="the longest a request waits for a place before HTTP 503")
    p.add_argument("--max-connections", type=positive, default=256,
                   help="connections open at once (each holds a thread); beyond, a new one "
                   "gets HTTP 503 and is closed")
    p.add_argument("--header-timeout", type=positive_number, default=10.0,
                   help="seconds a client has to send a request's line and headers, "
                   "waiting between requests included (then it is closed)")
    p.add_argument("--max-body-bytes", type=positive, default=None,
                   help="largest request body (default: what --context can use: "
                   "context x the longest token's bytes, as JSON)")
    # The defaults a request may leave out, checked by the rule its fields get.
    p.add_argument("--max-tokens", type=request_field("max_tokens", int), default=512,
                   help="reply tokens when a request names none (cut to the context left)")
    p.add_argument("--temp", type=request_field("temperature"), default=0.0,
                   help="temperature when a request names none")
    p.add_argument("--top-p", type=request_field("top_p"), default=1.0,
                   help="top_p when a request names none")
    p.add_argument("--top-k", type=request_field("top_k", int), default=0,
                   help="top_k when a request names none (below the vocabulary)")
    p.add_argument("--min-p", type=request_field("min_p"), default=0.0,
                   help="min_p when a request names none")
    p.add_argument("--chat-template-args", type=json_object, default=None,
                   help="JSON object passed to the chat template, e.g. '{\"thinking\": false}'")
    p.add_argument("--prefill-step-size", type=positive, default=None,
                   help="prompt tokens per pass (default: the memory plan's pass; prompts are "
                   "prefilled one at a time, in the order they arrive)")
    p.add_argument("--prompt-cache-size", type=positive, default=10,
                   help="earlier prompts whose KV cache is kept for reuse")
    p.add_argument("--prompt-cache-bytes", type=cache_bytes, default=None,
                   help="most bytes those caches may hold, e.g. 200MB (default: the plan's "
                   "KV/state bytes)")
    p.add_argument("--allowed-origins", default="*", help="comma-separated origins for CORS")
    p.add_argument("--log-level", default="INFO",
                   choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                   help="server log level")
    add_load_options(p)
    return p


def cmd_serve(argv) -> int:
    import logging
    import os
    import sys

    from deltafin_mlx.errors import UsageError
    from deltafin_mlx.server.app import ServeConfig, serve

    args = parser().parse_args(argv)
    if args.queue < 0:
        raise UsageError(f"--queue must be 0 or more, not {args.queue}")
    if not args.queue_seconds > 0:
        raise UsageError(f"--queue-seconds must be positive, not {args.queue_seconds}")
    rc = serve(ServeConfig(
        model=args.model, host=args.host, port=args.port,
        load=load_options(args, sequences=args.sequences), queue=args.queue,
        queue_seconds=args.queue_seconds, max_body_bytes=args.max_body_bytes,
        max_connections=args.max_connections, header_timeout=args.header_timeout,
        prefill_step_size=args.prefill_step_size, prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes, max_tokens=args.max_tokens,
        temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        chat_template_args=args.chat_template_args,
        allowed_origins=tuple(args.allowed_origins.split(",")), log_level=args.log_level))
    # Exit without the interpreter's finalization. The generation thread ran
    # mx.compile'd code (mlx-lm's samplers); after Python has joined it, its C++
    # thread-local compile cache is freed, which takes the GIL; once finalization has
    # begun, taking the GIL ends the thread inside that destructor: std::terminate,
    # SIGABRT (Ctrl-C with a request in flight, 3 in 28 tries).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
