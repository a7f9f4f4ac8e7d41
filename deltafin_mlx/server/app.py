"""`deltafin-run serve`'s server, as a library: bind the port (a port in use is
one line, before the model loads), load the model for the planned context and
sequences, and run mlx-lm's response generator (its batching, prompt cache and
response format) behind Deltafin's handler (server/handler.py) on a threaded
HTTP server with a listen backlog for a few dozen clients.

Memory: the plan holds `sequences` sequences' KV/recurrent state at `context`
tokens; that many requests generate together (mlx-lm's batch decoding, which
reads each expert once per step for all of them), a bounded queue waits, and
bodies held at once (read, checked, or waiting for a place) are bounded in bytes
(server/admission.py). A
prompt's text is bounded before it is tokenized: no token of the vocabulary is
longer than `longest_token_bytes` (tokenizer/text_bound.py), so more text than context x that many bytes
cannot fit.
"""

import argparse
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from deltafin_mlx.errors import RequestError, UsageError
from deltafin_mlx.server.admission import Admission, AdmissionConfig
from deltafin_mlx.server.counters import ServerCounters
from deltafin_mlx.server.listener import DeltafinHTTPServer
from deltafin_mlx.generation.request import GenerationRequest, RequestLimits
from deltafin_mlx.units import human_bytes

log = logging.getLogger("deltafin_mlx.server")

@dataclass
class ServeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 8080
    # How the model loads (engine/load.py LoadOptions; None: its defaults). Its
    # `context` is each request's, its `sequences` the requests generating together.
    load: object = None
    queue: int = 64  # requests waiting for a place; beyond, 503
    queue_seconds: float = 300.0  # the longest a request waits for a place
    max_body_bytes: Optional[int] = None  # default: what the context can use
    socket_timeout: float = 60.0  # a client silent this long is dropped
    header_timeout: float = 10.0  # a request's line and headers take at most this, in all
    max_connections: int = 256  # open at once; beyond, a new one is 503 and closed
    backlog: int = 128
    prefill_step_size: Optional[int] = None  # default: the plan's pass
    prompt_cache_size: int = 10
    prompt_cache_bytes: Optional[int] = None  # default: the plan's state bytes
    max_tokens: int = 512
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    chat_template_args: Optional[dict] = None
    allowed_origins: tuple = ("*",)
    log_level: str = "INFO"


@dataclass
class ServeSettings:
    """What every request's handler reads."""
    model: object
    tokenizer: object
    limits: RequestLimits
    max_body: int
    model_id: str
    created: int
    admission: Admission
    counters: ServerCounters
    socket_timeout: float
    header_timeout: float
    chat_template_args: dict = None  # serve's --chat-template-args: every request's
    temp: float = 0.0  # serve's --temp: a request's unless it sets its own
    scoring: bool = True  # prompts scored (echo, prompt_logprobs): not under mlx.launch


def bind(host: str, port: int, backlog: int, max_connections: int = 256) -> DeltafinHTTPServer:
    """The listening server (server/listener.py), handler to be set; a bad address
    is one line."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                    flags=socket.AI_PASSIVE)[0][0]
    except socket.gaierror as e:
        raise UsageError(f"--host {host}: {e.strerror}") from None
    try:
        return DeltafinHTTPServer((host, port), family, backlog, max_connections)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def mlx_lm_args(cfg: ServeConfig, plan, sequences: int) -> argparse.Namespace:
    """The options mlx-lm's server classes read, for this plan.

    Prompts are admitted one at a time, in the order they arrived
    (`prompt_concurrency` 1): mlx-lm's batch generator prefills the prompts it
    admits together in lockstep, so four prompts that arrive together would each
    get their first token only once all four were prefilled. One at a time, the
    first client's first token comes after its own prefill, the prompts after it
    are prefilled a pass at a time between the decode steps of those already
    generating, and each prompt is prefilled exactly as it would be alone (one
    sequence, the plan's whole pass per step: no padding, no shared steps)."""
    prompts_together = 1
    step = cfg.prefill_step_size or plan.prefill_pass
    return argparse.Namespace(
        model=cfg.model, adapter_path=None, draft_model=None, num_draft_tokens=3,
        trust_remote_code=False, chat_template="", use_default_chat_template=False,
        pipeline=False, temp=cfg.temp, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
        max_tokens=cfg.max_tokens, chat_template_args=cfg.chat_template_args or {},
        decode_concurrency=sequences, prompt_concurrency=prompts_together,
        prefill_step_size=step, prompt_cache_size=cfg.prompt_cache_size,
        # The prompt cache keeps earlier requests' KV: at most what the plan set
        # aside for KV/state, less what running requests hold.
        prompt_cache_bytes=cfg.prompt_cache_bytes if cfg.prompt_cache_bytes is not None
        else plan.state_bytes,
        kv_bits=None, kv_group_size=64, quantized_kv_start=0,
        allowed_origins=list(cfg.allowed_origins), log_level=cfg.log_level)


class PerRequestLog(logging.Filter):
    """One log line per request (counters.request_line): mlx-lm's server logs
    each prefill chunk's progress and its prompt cache's sizes for every request
    (four lines) on the root logger; unless the log level is DEBUG those are
    dropped."""

    CHATTER = ("Prompt processing progress:", "Prompt Cache:", "- assistant:", "- user:",
               "- system:")

    def filter(self, record):
        return (logging.getLogger().getEffectiveLevel() <= logging.DEBUG
                or record.name != "root"
                or not str(record.msg).startswith(self.CHATTER))


def serve(cfg: ServeConfig) -> int:
    logging.basicConfig(level=getattr(logging, cfg.log_level),
                        format="%(asctime)s - %(levelname)s - %(message)s")
    logging.getLogger().addFilter(PerRequestLog())
    from deltafin_mlx.engine.allocator import tune_malloc

    tune_malloc()  # before any handler thread exists (load sets it again: the same)
    from deltafin_mlx.model.shard import detect_group

    group = detect_group("auto")
    rank = group.rank() if group is not None else 0
    # The port first: a port in use is one line before minutes of loading.
    httpd = bind(cfg.host, cfg.port, cfg.backlog, cfg.max_connections) if rank == 0 else None
    try:
        return _serve(cfg, httpd, rank, scoring=group is None)
    finally:
        if httpd is not None:
            httpd.server_close()


def _serve(cfg: ServeConfig, httpd, rank: int, scoring: bool = True) -> int:
    import mlx_lm.server as server

    from deltafin_mlx.engine.load import LoadOptions, load
    from deltafin_mlx.engine.runtime import runtime
    from deltafin_mlx import compat
    from deltafin_mlx.generation.stream import hint_prompt_batches, hinted_stream_generate
    from deltafin_mlx.server.generation import (LoadedModelProvider, ResilientGenerator,
                                                TurnTakingBatchGenerator)
    from deltafin_mlx.server.handler import DeltafinHandler
    from deltafin_mlx.model.modules import model_vocab
    from deltafin_mlx.tokenizer.text_bound import max_json_bytes, max_text_bytes

    options = cfg.load or LoadOptions(sequences="auto")
    context = options.context
    model, tokenizer = load(cfg.model, options=options)
    state = runtime(model)
    plan = state.plan
    vocab = model_vocab(model)
    limits = RequestLimits(vocab=vocab, context=context,
                           max_text_bytes=max_text_bytes(tokenizer, vocab, context))
    try:  # the default top_k is a request's: below the vocabulary
        GenerationRequest.from_flags({"top_k": cfg.top_k}, limits)
    except RequestError as e:
        state.close()
        raise UsageError(f"--top-k: {e}") from None
    max_body = cfg.max_body_bytes or max_json_bytes(limits.max_text_bytes)
    counters = ServerCounters(model, rank)
    # Bodies held at once: the generating requests' and one more of the largest,
    # however many smaller ones that is (a queue of ordinary requests holds little).
    admission = Admission(AdmissionConfig(active=plan.sequences, queued=cfg.queue,
                                          wait_seconds=cfg.queue_seconds,
                                          body_bytes=max_body * (plan.sequences + 1)))
    args = mlx_lm_args(cfg, plan, plan.sequences)

    compat.use_server_batch_generator(TurnTakingBatchGenerator)
    hint_prompt_batches()
    compat.use_server_stream_generate(hinted_stream_generate)

    def restarted():
        counters.generation_restarts += 1

    generator = ResilientGenerator(LoadedModelProvider(args, model, tokenizer),
                                   server.LRUPromptCache(args.prompt_cache_size),
                                   on_restart=restarted)
    try:
        if httpd is None:  # another rank of mlx.launch: rank 0 serves HTTP
            generator.join()
            return 0
        settings = ServeSettings(model=model, tokenizer=tokenizer, limits=limits,
                                 max_body=max_body, model_id=Path(cfg.model).name,
                                 created=int(time.time()), admission=admission,
                                 counters=counters, socket_timeout=cfg.socket_timeout,
                                 header_timeout=cfg.header_timeout,
                                 chat_template_args=cfg.chat_template_args or {},
                                 temp=cfg.temp, scoring=scoring)
        fingerprint = server.get_system_fingerprint()
        httpd.RequestHandlerClass = lambda *a, **k: DeltafinHandler(
            generator, *a, settings=settings, system_fingerprint=fingerprint, **k)
        log.info("deltafin-run serve: %s on http://%s:%d, budget %s, context %d tokens, "
                 "%d request%s at once (%d more may wait), %d expert slots (%.0f%% of the "
                 "experts), bodies up to %s", cfg.model, cfg.host, cfg.port,
                 human_bytes(plan.budget), context, plan.sequences,
                 "s" * (plan.sequences != 1), cfg.queue, plan.slots,
                 100 * plan.cache_fraction, human_bytes(max_body))
        try:
            httpd.serve_forever()
        except KeyboardInterrupt:
            log.info("stopping")
        return 0
    finally:
        generator.stop_and_join()
        state.close()
