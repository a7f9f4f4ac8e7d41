"""The HTTP handler of `deltafin-run serve`: a subclass of mlx-lm's APIHandler
that reads a body no larger than the planned context can use (with room for it
reserved, server/admission.py, and at a byte-rate floor), checks every value
(server/schema.py), and only then takes a generation place and hands mlx-lm the
checked body; then it checks the prompt's tokens against the context,
watches the client, counts the request (server/counters.py) and reports
logprobs as OpenAI does. It also answers /v1/models, /tokenize, /detokenize and
/metrics itself.

A failure is an HTTP error with a JSON body `{"error": {"message": ...}}`: 400
for a bad request, 404 for an unknown path, 408 for a body slower than the
byte-rate floor, 411/413 for a missing or too large body, 503 when the server is
busy, 500 when generation failed (the server goes on serving).
"""

import dataclasses
import io
import json
import logging
import select
import socket
import time

from mlx_lm.server import APIHandler, CompletionRequest

from deltafin_mlx import compat
from deltafin_mlx.errors import ContextError, RequestError
from deltafin_mlx.generation.engine import Defaults, prepare
from deltafin_mlx.generation.request import fit_max_tokens
from deltafin_mlx.server import schema, scoring
from deltafin_mlx.server.admission import Busy
from deltafin_mlx.server.generation import GenerationFailed

log = logging.getLogger("deltafin_mlx.server")

COMPLETIONS = {"/v1/completions": False, "/v1/chat/completions": True, "/chat/completions": True}
DRAIN_CHUNK = 1 << 16
LINGER_SECONDS = 2.0
LINGER_BYTES = 256 << 20
# A body's byte-rate floor: after BODY_GRACE_SECONDS it must have arrived at
# BODY_MIN_RATE on average, so a client that stalls or trickles its body frees its
# connection soon (a body is read before its request takes a generation place, so it
# never holds one of those).
BODY_GRACE_SECONDS = 5.0
BODY_MIN_RATE = 16 << 10  # bytes/s
REFUSED = object()  # what a read answered with a refusal returns


def peer_reset(sock) -> bool:
    """Whether the client's connection is broken (reset). A client that only
    closed its sending side (end of file) may still be reading its answer."""
    try:
        # poll, not select: select refuses descriptors past FD_SETSIZE (1024).
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        if poller.poll(0) and sock.recv(1, socket.MSG_PEEK) == b"":
            return _tcp_state(sock) == TCP_CLOSE  # a reset after the end of file
        return False
    except (OSError, ValueError):
        return True


TCP_CLOSE = 7  # Linux's tcp_states.h


def _tcp_state(sock) -> int:
    """The kernel's TCP state of a socket (Linux), or -1 where unknown."""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except (AttributeError, OSError):
        return -1


class ClientGone(Exception):
    pass


class DeadlineReader(socket.SocketIO):
    """A socket's reads, each waiting at most what is left until `deadline`
    (time.monotonic; None: the socket's own timeout), so a client that trickles
    its headers a byte at a time still has only that long in all."""

    deadline = None

    def readinto(self, b):
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request's headers took too long")
            self._sock.settimeout(left)
        return super().readinto(b)


class Connection:
    """The connection side of Deltafin's handler (a mixin before http.server's
    handler, reading `self.settings`): a deadline for a request's line and headers,
    bodies read at a byte-rate floor, and JSON answers that survive a client gone."""

    def setup(self):
        super().setup()
        self.rfile.close()  # the socket's own reader, replaced by one with a deadline
        self.reader = DeadlineReader(self.connection, "rb")
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self):
        # A client gets less time for its request line and headers, in all, than
        # for a body or a reply: an idle or trickling connection frees its thread.
        self.reader.deadline = time.monotonic() + self.settings.header_timeout
        super().handle_one_request()

    def parse_request(self):
        ok = super().parse_request()  # has read the headers
        self.reader.deadline = None
        self.connection.settimeout(self.settings.socket_timeout)
        return ok

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        log.debug("%s %s", self.address_string(), format % args)

    def send_json(self, status: int, payload, extra_headers=()):
        self.send_body(status, json.dumps(payload).encode(), "application/json", extra_headers)

    def send_body(self, status: int, data: bytes, content_type: str, extra_headers=()):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in extra_headers:
            self.send_header(k, v)
        try:
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except (ConnectionError, TimeoutError) as e:
            log.info("client went away before its answer (%d): %s", status, type(e).__name__)
            self.close_connection = True

    def refuse(self, status: int, message: str, extra_headers=()):
        log.info("refused (%d): %s", status, message)
        kind = {400: "invalid_request_error", 503: "server_busy"}.get(status, "error")
        self.send_json(status, {"error": {"message": message, "type": kind,
                                          "code": status}}, extra_headers)

    def content_length(self):
        """The body's length, or a refusal (None): missing, invalid, or more than
        this server's planned context can use."""
        length = self.headers.get("Content-Length")
        try:
            length = int(length)
        except (TypeError, ValueError):
            self.close_connection = True
            return self.refuse(411 if length is None else 400,
                               "a valid Content-Length header is required")
        if length < 0:
            self.close_connection = True
            return self.refuse(400, f"Content-Length {length} is negative")
        if length > self.settings.max_body:
            self.close_connection = True
            self.refuse(413, f"the body is {length} bytes, more than the "
                             f"{self.settings.max_body} this server's planned context can use")
            return self.linger(length)
        return length

    def length_or_none(self):
        try:
            n = int(self.headers.get("Content-Length"))
        except (TypeError, ValueError):
            return None
        return n if 0 <= n <= self.settings.max_body else None

    def drain(self, length):
        """Read and drop a body (so closing does not reset the connection)."""
        if length is None:
            self.close_connection = True
            return
        while length > 0:
            chunk = self.rfile.read(min(length, DRAIN_CHUNK))
            if not chunk:
                break
            length -= len(chunk)

    def linger(self, length):
        """After refusing a body unread: drop what the client still sends, for a
        bounded time and size, so it can read the answer (closing now would
        reset the connection under it)."""
        try:
            self.connection.settimeout(LINGER_SECONDS)
            left = min(length, LINGER_BYTES)
            while left > 0:
                chunk = self.rfile.read1(min(left, DRAIN_CHUNK))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:
            pass

    def read_body(self, length: int) -> bytes:
        """The body, as long as it keeps to the byte-rate floor: after
        BODY_GRACE_SECONDS, BODY_MIN_RATE bytes/s on average since the start."""
        parts, got, start = [], 0, time.monotonic()
        try:
            while got < length:
                left = start + BODY_GRACE_SECONDS + got / BODY_MIN_RATE - time.monotonic()
                if left <= 0:
                    break
                self.connection.settimeout(min(left, self.settings.socket_timeout))
                chunk = self.rfile.read1(min(length - got, DRAIN_CHUNK))
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
        except OSError:
            pass
        finally:
            self.connection.settimeout(self.settings.socket_timeout)
        return b"".join(parts)

    def read_json(self, length: int):
        """The body as JSON, or a refusal (REFUSED)."""
        started = time.monotonic()
        raw = self.read_body(length)
        if len(raw) < length:
            self.close_connection = True
            took = time.monotonic() - started
            if took >= BODY_GRACE_SECONDS:
                self.refuse(408, f"the body came slower than the {BODY_MIN_RATE >> 10} KiB/s "
                                 f"this server takes ({len(raw)} of {length} bytes in "
                                 f"{took:.0f} s)")
                return REFUSED
            self.refuse(400, f"the body ended after {len(raw)} of {length} bytes")
            return REFUSED
        try:
            return json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            self.refuse(400, "the body is not UTF-8 text")
        except (ValueError, RecursionError) as e:
            self.refuse(400, f"the body is not valid JSON ({type(e).__name__}: {str(e)[:200]})")
        return REFUSED


class DeltafinHandler(compat.CompletionStatusHook, Connection, APIHandler):
    """mlx-lm's APIHandler for `deltafin-run serve`, made for each connection with
    `settings` (server/app.py's ServeSettings)."""

    def __init__(self, response_generator, *args, settings, **kwargs):
        self.settings = settings
        self.timeout = settings.socket_timeout  # a client that stops sending is dropped
        self.generation_status = None  # the HTTP status of a generation that failed
        super().__init__(response_generator, *args, **kwargs)

    def completion_status(self, status: int) -> int:
        # mlx-lm answers a request its generation thread refused with 404.
        if status == 404 and self.generation_status:
            return self.generation_status
        return status

    # --- GET ---------------------------------------------------------------

    def do_GET(self):
        path = self.path.split("?", 1)[0]
        if path in ("/v1/models", "/models"):
            return self.send_json(200, {"object": "list", "data": [self.model_card()]})
        if path.startswith(("/v1/models/", "/models/")):
            name = path.split("/models/", 1)[1]
            if name == self.settings.model_id:
                return self.send_json(200, self.model_card())
            return self.refuse(404, f"no model {name[:80]!r}; this server serves "
                                    f"{self.settings.model_id!r}")
        if path == "/health":
            ok = self.response_generator.is_healthy
            return self.send_json(200 if ok else 503, {"status": "ok" if ok else "unavailable"})
        if path == "/metrics":
            metrics = self.settings.counters.metrics_text(self.settings.admission, self.server)
            return self.send_body(200, metrics.encode(), "text/plain; version=0.0.4")
        self.refuse(404, f"no such path {path[:80]!r}")

    def model_card(self):
        return {"id": self.settings.model_id, "object": "model",
                "created": self.settings.created, "owned_by": "deltafin",
                "context_length": self.settings.limits.context}

    # --- POST --------------------------------------------------------------

    def do_POST(self):
        path = self.path.split("?", 1)[0]
        if path not in COMPLETIONS and path not in ("/tokenize", "/detokenize"):
            self.drain(self.length_or_none())
            return self.refuse(404, f"no such path {path[:80]!r}")
        length = self.content_length()
        if length is None:
            return
        has_room = False
        self.meter = None  # this request's, once it has one
        try:
            with self.settings.admission.body(length):
                has_room = True
                self.admitted(path, length)
        except Busy as e:
            if self.meter is None:  # else its meter counted it
                self.settings.counters.outcome("busy")
            if not has_room:  # refused with its body unread
                self.close_connection = True
            self.refuse(503, str(e), [("Retry-After", "1")])
            if not has_room:
                self.linger(length)

    def admitted(self, path, length):
        """A request whose body has room: read and check it, then answer it
        (a completion once it has a generation place)."""
        body = self.read_json(length)
        if body is REFUSED:
            return
        try:
            if path == "/tokenize":
                content, special = schema.check_tokenize(body, self.settings.limits)
                tokens = self.settings.tokenizer.encode(content, add_special_tokens=special)
                return self.send_json(200, {"tokens": list(tokens), "count": len(tokens)})
            if path == "/detokenize":
                tokens = schema.check_detokenize(body, self.settings.limits)
                return self.send_json(200, {"content": self.settings.tokenizer.decode(tokens)})
            request = schema.read_completion(body, COMPLETIONS[path], self.settings.limits)
        except RequestError as e:
            self.settings.counters.outcome("refused")
            return self.refuse(400, str(e))
        self.hand_to_mlx_lm(path, request)

    def hand_to_mlx_lm(self, path, request):
        """mlx-lm's do_POST on the checked body, once it has a generation place,
        counted."""
        self.legacy_logprobs = not COMPLETIONS[path] and request.logprobs
        self.want_logprobs = request.logprobs
        self.streamed = []  # responses not yet in a streamed chunk (for logprobs)
        self.checked = request  # (self.request is the socket, socketserver's)
        data = json.dumps(request.mlx_lm_body()).encode()
        # mlx-lm's handler reads and parses the body itself: it gets the checked one.
        del self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(data))
        self.rfile = io.BytesIO(data)
        self.prompt_scores = None  # (prompt text, tokens, Scored) of a scored prompt
        if request.scoring:
            # Scored without a generation place: its passes are the plan's whatever
            # waits, so requests waiting together share them.
            self.meter = self.settings.counters.start(path)
            self.outcome = "refused"
            try:
                if self.scored_alone(path, request):
                    return
            finally:
                if self.prompt_scores is None:  # answered or refused
                    self.settings.counters.finish(self.meter, self.outcome)
        self.outcome = "busy"  # until it has a generation place
        try:
            with self.settings.admission.place():
                if self.prompt_scores is None:
                    self.meter = self.settings.counters.start(path)
                self.outcome = "refused"
                super().do_POST()
        finally:
            if self.meter is not None:  # a scored prompt's meter ends even when refused busy
                self.settings.counters.finish(self.meter, self.outcome)

    # --- a scored prompt (server/scoring.py) --------------------------------

    def scored_alone(self, path, request) -> bool:
        """Score the prompts (echo, prompt_logprobs); True when that answers the
        request (or refused it), False when its reply is still to be generated
        (then `prompt_scores` holds the prompt's)."""
        chat = COMPLETIONS[path]
        if not self.settings.scoring:
            self.refuse(400, "echo and prompt_logprobs are not served under mlx.launch")
            return True
        prompts = request.prompts or [None if chat else request.prompt]
        alone = scoring.answered_by_the_pass(request, self.settings.temp)
        if not alone and (len(prompts) > 1 or not isinstance(prompts[0], (str, type(None)))):
            self.refuse(400, "prompt: token ids or several prompts are scored with max_tokens "
                             "0, or 1 decoded greedily (temperature 0)")
            return True
        try:
            # The tokens its generation would take (mlx-lm's, `prompt_tokens`).
            tokens = [list(p) if isinstance(p, list) else self.prompt_tokens(
                CompletionRequest("chat", "", request.messages, request.tools, None) if chat
                else CompletionRequest("text", p, [], None, None), request) for p in prompts]
            for t in tokens:
                fit_max_tokens(len(t), request.max_tokens if alone else 0,
                               self.settings.limits.context)
        except (RequestError, ContextError) as e:
            self.refuse(400, str(e))
            return True
        next_token = alone and request.max_tokens == 1
        k = max(request.top_logprobs if request.logprobs else 0, request.prompt_logprobs or 0,
                int(next_token))
        self.meter.prompt_tokens = sum(map(len, tokens))
        try:
            scored = self.response_generator.score(scoring.items(tokens, next_token), k)
        except GenerationFailed as e:
            self.outcome = "failed"
            self.refuse(500, str(e))
            return True
        if not alone:
            self.prompt_scores = (prompts[0], tokens[0], scored[0])
            return False
        self.meter.reply_tokens = len(tokens) * next_token
        self.send_json(200, scoring.pass_response(self, request, chat, prompts, tokens, scored,
                                                  next_token))
        self.outcome = "ok"
        return True

    # --- a completion ------------------------------------------------------

    def handle_completion(self, request, stop_words):
        # The request as generation/engine.py prepares it, with the prompt
        # tokenized as mlx-lm's generation thread will.
        kwargs = {**(self.settings.chat_template_args or {}),
                  **(self.checked.chat_template_kwargs or {})}
        try:
            prepared = prepare(
                dataclasses.replace(self.checked, chat_template_kwargs=kwargs),
                self.settings.tokenizer, self.settings.limits,
                Defaults(max_tokens=self.max_tokens, stop=tuple(stop_words)),
                prompt=self.prompt_tokens(request))
        except (RequestError, ContextError) as e:
            return self.refuse(400, str(e))
        self.max_tokens = prepared.max_tokens
        self.meter.prompt_tokens = len(prepared.prompt)
        self.render = prepared.render()
        self.rendered = {"answer": "", "think": ""}  # not yet in a response
        real = self.response_generator
        self.response_generator = _Watched(real, self, self.settings.counters)
        try:
            super().handle_completion(request, stop_words)
            self.outcome = "ok" if not self.generation_status else "failed"
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            log.info("client disconnected; its generation was stopped")
            self.outcome = "gone"
            self.close_connection = True
        except GenerationFailed as e:
            self.outcome = "failed"
            self.failed_midway(e)
        finally:
            self.response_generator = real

    def prompt_tokens(self, request, args=None) -> list:
        """The prompt's tokens, as mlx-lm's generation thread will build them (the
        text is already bounded by the context); `args` holds chat_template_kwargs."""
        try:
            prompt = compat.server_prompt_tokens(self.response_generator,
                                                 self.settings.tokenizer, request,
                                                 self if args is None else args)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # template errors of any kind
            raise RequestError(f"cannot build the prompt ({type(e).__name__}: "
                               f"{str(e)[:200]})") from None
        return prompt

    def failed_midway(self, error):
        self.close_connection = True
        try:
            if self.stream:  # the headers are out: say it in the stream
                event = {"error": {"message": str(error), "type": "server_error", "code": 500}}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            else:  # mlx-lm's 200 is still in the header buffer
                self._headers_buffer = []  # http.server's
                self.refuse(500, str(error))
        except OSError:
            pass

    # --- logprobs as OpenAI reports them ------------------------------------

    def generate_response(self, text, finish_reason, prompt_token_count=None,
                          completion_token_count=None, prompt_cache_count=None,
                          token_logprobs=None, top_tokens=None, tokens=None, **kwargs):
        if not kwargs.get("tool_calls"):
            # The text is generation/render.py's, as run and batch write it (a tool
            # call's reply keeps mlx-lm's parse).
            text, kwargs["reasoning_text"] = self.rendered_text(finish_reason)
        response = super().generate_response(
            text, finish_reason, prompt_token_count, completion_token_count,
            prompt_cache_count, token_logprobs=token_logprobs, top_tokens=top_tokens,
            tokens=tokens, **kwargs)
        response["model"] = self.settings.model_id  # whatever name the client used
        choice = response["choices"][0]
        choice.pop("logprobs", None)
        if self.stream and self.want_logprobs and self.streamed:
            # mlx-lm streams no logprobs: the chunk's own tokens, as collected.
            tokens = [r.token for r in self.streamed]
            token_logprobs = [r.logprob for r in self.streamed]
            top_tokens = [r.top_tokens for r in self.streamed]
            self.streamed = []
        if tokens and token_logprobs:
            choice["logprobs"] = scoring.logprobs_block(
                self.settings.tokenizer, tokens, token_logprobs, top_tokens or [],
                legacy=self.legacy_logprobs)
        elif not self.stream and "logprobs" not in choice:
            choice["logprobs"] = None
        if self.prompt_scores is not None and finish_reason is not None:
            prompt, tokens, scored = self.prompt_scores
            scoring.attach(response, self.settings.tokenizer, self.checked,
                           "message" in choice, prompt or "", tokens, scored)
        return response

    def rendered_text(self, finish_reason):
        """(answer, thinking) rendered since the last response; at the end of
        the reply, with what was held back in case a stop string began there."""
        if finish_reason is not None:
            for channel, piece in self.render.finish():
                self.rendered[channel] += piece
        answer, thinking = self.rendered["answer"], self.rendered["think"]
        self.rendered = {"answer": "", "think": ""}
        return answer, thinking

    def completion_usage_response(self, *args, **kwargs):
        response = super().completion_usage_response(*args, **kwargs)
        response["model"] = self.settings.model_id
        return response


class _Watched:
    """The response generator as one request's handler sees it: stops the
    generation when the client has gone (checked before each token is sent and
    during prompt processing), counts the tokens, and keeps a failure's status."""

    def __init__(self, inner, handler, counters):
        self.inner = inner
        self.counters = counters
        self.handler = handler
        self.sock = handler.connection

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, request, args, progress_callback=None):
        holder = {}
        handler = self.handler

        def progress(done, total):
            if peer_reset(self.sock) and "ctx" in holder:
                holder["ctx"].stop()
            if progress_callback is not None:
                progress_callback(done, total)

        try:
            ctx, responses = self.inner.generate(request, args, progress)
        except GenerationFailed:
            handler.generation_status = 500
            raise
        except Exception:
            handler.generation_status = 400
            raise
        holder["ctx"] = ctx
        meter = getattr(handler, "meter", None)
        if meter is not None:
            meter.cached_tokens = max(ctx.prompt_cache_count, 0)

        def watched():
            for r in responses:
                if peer_reset(self.sock):
                    ctx.stop()
                    raise ClientGone()
                if meter is not None:
                    self.counters.token(meter)
                if getattr(handler, "want_logprobs", False) and handler.stream:
                    handler.streamed.append(r)
                render = getattr(handler, "render", None)
                if render is not None:
                    for channel, piece in render.add(r.token, final=r.finish_reason is not None):
                        handler.rendered[channel] += piece
                    if render.stopped:  # a stop string ends the reply, as in run and batch
                        if r.finish_reason is None:
                            ctx.stop()
                        yield dataclasses.replace(r, finish_reason="stop")
                        return
                yield r

        return ctx, watched()
