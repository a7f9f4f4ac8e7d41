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

from deltafin_mlx import compat
from deltafin_mlx.errors import ContextError, RequestError
from deltafin_mlx.generation.engine import Defaults, prepare
from deltafin_mlx.server import schema
from deltafin_mlx.server.admission import Busy
from deltafin_mlx.server.generation import GenerationFailed

log = logging.getLogger("deltafin_mlx.server")

COMPLETIONS = {"/v1/completions": False, "/v1/chat/completions": True,
               "/chat/completions": True}
DRAIN_CHUNK = 1 << 16
LINGER_SECONDS = 2.0
LINGER_BYTES = 256 << 20
# A body's byte-rate floor: after BODY_GRACE_SECONDS it must have arrived at
# BODY_MIN_RATE on average, so a client that stalls or trickles its body frees its
# connection soon (a body is read before its request takes a generation place, so it
# never holds one of those).
BODY_GRACE_SECONDS = 5.0
BODY_MIN_RATE = 16 << 10  # bytes/s


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


def make_handler(base, settings):
    """A subclass of mlx-lm's APIHandler (`base`) for `settings`
    (server/app.py's ServeSettings)."""

    class DeltafinHandler(base):
        timeout = settings.socket_timeout  # a client that stops sending is dropped

        # --- answers -----------------------------------------------------------

        def _send_json(self, status: int, payload, extra_headers=()):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in extra_headers:
                self.send_header(k, v)
            try:
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
            except (ConnectionError, TimeoutError) as e:
                log.info("client went away before its answer (%d): %s", status,
                         type(e).__name__)
                self.close_connection = True

        # --- reading a request ------------------------------------------------

        def setup(self):
            super().setup()
            self.rfile.close()  # the socket's own reader, replaced by one with a deadline
            self._reader = DeadlineReader(self.connection, "rb")
            self.rfile = io.BufferedReader(self._reader)

        def handle_one_request(self):
            # A client gets less time for its request line and headers, in all, than
            # for a body or a reply: an idle or trickling connection frees its thread.
            self._reader.deadline = time.monotonic() + settings.header_timeout
            super().handle_one_request()

        def parse_request(self):
            ok = super().parse_request()  # has read the headers
            self._reader.deadline = None
            self.connection.settimeout(settings.socket_timeout)
            return ok

        def _refuse(self, status: int, message: str, extra_headers=()):
            log.info("refused (%d): %s", status, message)
            kind = {400: "invalid_request_error", 503: "server_busy"}.get(status, "error")
            self._send_json(status, {"error": {"message": message, "type": kind,
                                               "code": status}}, extra_headers)

        def _set_completion_headers(self, status_code: int = 200):
            # mlx-lm answers a request its generation thread refused with 404.
            if status_code == 404 and getattr(self, "_generation_status", None):
                status_code = self._generation_status
            super()._set_completion_headers(status_code)

        def log_message(self, format, *args):  # noqa: A002 - http.server's signature
            log.debug("%s %s", self.address_string(), format % args)

        # --- GET ---------------------------------------------------------------

        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path in ("/v1/models", "/models"):
                return self._send_json(200, {"object": "list", "data": [self._model_card()]})
            if path.startswith(("/v1/models/", "/models/")):
                name = path.split("/models/", 1)[1]
                if name == settings.model_id:
                    return self._send_json(200, self._model_card())
                return self._refuse(404, f"no model {name[:80]!r}; this server serves "
                                         f"{settings.model_id!r}")
            if path == "/health":
                ok = self.response_generator.is_healthy
                return self._send_json(200 if ok else 503,
                                       {"status": "ok" if ok else "unavailable"})
            if path == "/metrics":
                data = settings.counters.metrics_text(settings.admission, self.server).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self._refuse(404, f"no such path {path[:80]!r}")

        def _model_card(self):
            return {"id": settings.model_id, "object": "model", "created": settings.created,
                    "owned_by": "deltafin", "context_length": settings.limits.context}

        # --- POST --------------------------------------------------------------

        def do_POST(self):
            path = self.path.split("?", 1)[0]
            if path not in COMPLETIONS and path not in ("/tokenize", "/detokenize"):
                self._drain(self._length_or_none())
                return self._refuse(404, f"no such path {path[:80]!r}")
            length = self.headers.get("Content-Length")
            try:
                length = int(length)
            except (TypeError, ValueError):
                self.close_connection = True
                return self._refuse(411 if length is None else 400,
                                    "a valid Content-Length header is required")
            if length < 0:
                self.close_connection = True
                return self._refuse(400, f"Content-Length {length} is negative")
            if length > settings.max_body:
                self.close_connection = True
                self._refuse(413, f"the body is {length} bytes, more than the "
                                  f"{settings.max_body} this server's planned context can use")
                return self._linger(length)
            has_room = False
            try:
                with settings.admission.body(length):
                    has_room = True
                    self._admitted(path, length)
            except Busy as e:
                settings.counters.outcome("busy")
                if not has_room:  # refused with its body unread
                    self.close_connection = True
                self._refuse(503, str(e), [("Retry-After", "1")])
                if not has_room:
                    self._linger(length)

        def _length_or_none(self):
            try:
                n = int(self.headers.get("Content-Length"))
            except (TypeError, ValueError):
                return None
            return n if 0 <= n <= settings.max_body else None

        def _drain(self, length):
            """Read and drop a body (so closing does not reset the connection)."""
            if length is None:
                self.close_connection = True
                return
            while length > 0:
                chunk = self.rfile.read(min(length, DRAIN_CHUNK))
                if not chunk:
                    break
                length -= len(chunk)

        def _linger(self, length):
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

        def _read_body(self, length: int) -> bytes:
            """The body, as long as it keeps to the byte-rate floor: after
            BODY_GRACE_SECONDS, BODY_MIN_RATE bytes/s on average since the start."""
            parts, got, start = [], 0, time.monotonic()
            try:
                while got < length:
                    left = start + BODY_GRACE_SECONDS + got / BODY_MIN_RATE - time.monotonic()
                    if left <= 0:
                        break
                    self.connection.settimeout(min(left, settings.socket_timeout))
                    chunk = self.rfile.read1(min(length - got, DRAIN_CHUNK))
                    if not chunk:
                        break
                    parts.append(chunk)
                    got += len(chunk)
            except OSError:
                pass
            finally:
                self.connection.settimeout(settings.socket_timeout)
            return b"".join(parts)

        def _admitted(self, path, length):
            """A request whose body has room: read and check it, then answer it
            (a completion once it has a generation place)."""
            started = time.monotonic()
            raw = self._read_body(length)
            if len(raw) < length:
                self.close_connection = True
                took = time.monotonic() - started
                if took >= BODY_GRACE_SECONDS:
                    return self._refuse(408, f"the body came slower than the "
                                             f"{BODY_MIN_RATE >> 10} KiB/s this server "
                                             f"takes ({len(raw)} of {length} bytes in "
                                             f"{took:.0f} s)")
                return self._refuse(400, f"the body ended after {len(raw)} of {length} bytes")
            try:
                body = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                return self._refuse(400, "the body is not UTF-8 text")
            except (ValueError, RecursionError) as e:
                return self._refuse(400, f"the body is not valid JSON ({type(e).__name__}: "
                                         f"{str(e)[:200]})")
            del raw
            try:
                if path == "/tokenize":
                    content, special = schema.check_tokenize(body, settings.limits)
                    tokens = settings.tokenizer.encode(content, add_special_tokens=special)
                    return self._send_json(200, {"tokens": list(tokens), "count": len(tokens)})
                if path == "/detokenize":
                    tokens = schema.check_detokenize(body, settings.limits)
                    return self._send_json(200, {"content": settings.tokenizer.decode(tokens)})
                request = schema.read_completion(body, COMPLETIONS[path], settings.limits)
            except RequestError as e:
                settings.counters.outcome("refused")
                return self._refuse(400, str(e))
            self._legacy_logprobs = not COMPLETIONS[path] and request.logprobs
            self._want_logprobs = request.logprobs
            self._streamed = []  # responses not yet in a streamed chunk (for logprobs)
            self._request = request
            data = json.dumps(request.mlx_lm_body()).encode()
            # mlx-lm's handler reads and parses the body itself: it gets the checked one.
            del self.headers["Content-Length"]
            self.headers["Content-Length"] = str(len(data))
            self.rfile = io.BytesIO(data)
            with settings.admission.place():
                self._generate()

        def _generate(self):
            """mlx-lm's do_POST on the checked body, counted."""
            path = self.path.split("?", 1)[0]
            self._meter = settings.counters.start(path)
            self._outcome = "refused"
            try:
                super().do_POST()
            finally:
                settings.counters.finish(self._meter, self._outcome)

        # --- a completion ------------------------------------------------------

        def handle_completion(self, request, stop_words):
            # The request as generation/engine.py prepares it, with the prompt
            # tokenized as mlx-lm's generation thread will.
            kwargs = {**(settings.chat_template_args or {}),
                      **(self._request.chat_template_kwargs or {})}
            try:
                prepared = prepare(
                    dataclasses.replace(self._request, chat_template_kwargs=kwargs),
                    settings.tokenizer, settings.limits,
                    Defaults(max_tokens=self.max_tokens, stop=tuple(stop_words)),
                    prompt=self._prompt_tokens(request))
            except (RequestError, ContextError) as e:
                return self._refuse(400, str(e))
            self.max_tokens = prepared.max_tokens
            self._meter.prompt_tokens = len(prepared.prompt)
            self._render = prepared.render()
            self._rendered = {"answer": "", "think": ""}  # not yet in a response
            real = self.response_generator
            self.response_generator = _Watched(real, self, settings.counters)
            try:
                super().handle_completion(request, stop_words)
                self._outcome = "ok" if not getattr(self, "_generation_status", None) \
                    else "failed"
            except (ClientGone, BrokenPipeError, ConnectionResetError):
                log.info("client disconnected; its generation was stopped")
                self._outcome = "gone"
                self.close_connection = True
            except GenerationFailed as e:
                self._outcome = "failed"
                self._failed_midway(e)
            finally:
                self.response_generator = real

        def _failed_midway(self, error):
            self.close_connection = True
            try:
                if self.stream:  # the headers are out: say it in the stream
                    event = {"error": {"message": str(error), "type": "server_error",
                                       "code": 500}}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                else:  # mlx-lm's 200 is still in the header buffer
                    self._headers_buffer = []
                    self._refuse(500, str(error))
            except OSError:
                pass

        def _prompt_tokens(self, request) -> list:
            """The prompt's tokens, as mlx-lm's generation thread will build them
            (the text is already bounded by what the context can hold)."""
            try:
                prompt = compat.server_prompt_tokens(self.response_generator,
                                                     settings.tokenizer, request,
                                                     _TemplateArgs(self.chat_template_kwargs))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # template errors of any kind
                raise RequestError(f"cannot build the prompt ({type(e).__name__}: "
                                   f"{str(e)[:200]})") from None
            return prompt

        # --- logprobs as OpenAI reports them ------------------------------------

        def generate_response(self, text, finish_reason, prompt_token_count=None,
                              completion_token_count=None, prompt_cache_count=None,
                              token_logprobs=None, top_tokens=None, tokens=None, **kwargs):
            if not kwargs.get("tool_calls"):
                # The text is generation/render.py's, as run and batch write it (a tool
                # call's reply keeps mlx-lm's parse).
                text, kwargs["reasoning_text"] = self._rendered_text(finish_reason)
            response = super().generate_response(
                text, finish_reason, prompt_token_count, completion_token_count,
                prompt_cache_count, token_logprobs=token_logprobs, top_tokens=top_tokens,
                tokens=tokens, **kwargs)
            response["model"] = settings.model_id  # whatever name the client used
            choice = response["choices"][0]
            choice.pop("logprobs", None)
            if self.stream and self._want_logprobs and self._streamed:
                # mlx-lm streams no logprobs: the chunk's own tokens, as collected.
                tokens = [r.token for r in self._streamed]
                token_logprobs = [r.logprob for r in self._streamed]
                top_tokens = [r.top_tokens for r in self._streamed]
                self._streamed = []
            if tokens and token_logprobs:
                choice["logprobs"] = logprobs_block(
                    settings.tokenizer, tokens, token_logprobs, top_tokens or [],
                    legacy=self._legacy_logprobs)
            elif not self.stream and "logprobs" not in choice:
                choice["logprobs"] = None
            return response

        def _rendered_text(self, finish_reason):
            """(answer, thinking) rendered since the last response; at the end of
            the reply, with what was held back in case a stop string began there."""
            if finish_reason is not None:
                for channel, piece in self._render.finish():
                    self._rendered[channel] += piece
            answer, thinking = self._rendered["answer"], self._rendered["think"]
            self._rendered = {"answer": "", "think": ""}
            return answer, thinking

        def completion_usage_response(self, *args, **kwargs):
            response = super().completion_usage_response(*args, **kwargs)
            response["model"] = settings.model_id
            return response

    return DeltafinHandler


class _TemplateArgs:
    """What mlx-lm's tokenizing reads of a request's generation arguments."""

    def __init__(self, chat_template_kwargs):
        self.chat_template_kwargs = chat_template_kwargs


def _token_text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def logprobs_block(tokenizer, tokens, logprobs, top_tokens, legacy: bool):
    """OpenAI's logprobs of a reply: per generated token its own logprob and the
    top alternatives, best first (ties by id). `legacy`: /v1/completions' shape
    (tokens, token_logprobs, top_logprobs as {text: logprob}, text_offset), where
    alternatives that decode to the same text (pieces of one UTF-8 character all
    decode to U+FFFD) share one key, holding the best of their logprobs; every
    alternative, with its id, is in `top_tokens` (as chat's top_logprobs entries)."""
    tops = []
    for i in range(len(tokens)):
        top = top_tokens[i] if i < len(top_tokens) else ()
        tops.append(sorted(top, key=lambda t: (-t["logprob"], t["id"])))
    texts = [_token_text(tokenizer, t) for t in tokens]

    def entry(token, text, logprob):
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
                "id": token}

    if legacy:
        offsets, at = [], 0
        for s in texts:
            offsets.append(at)
            at += len(s)
        alternatives = [[entry(x["id"], _token_text(tokenizer, x["id"]), x["logprob"])
                         for x in top] for top in tops]
        merged = []
        for top in alternatives:
            by_text = {}
            for x in top:  # best first: a shared text keeps the best logprob
                by_text.setdefault(x["token"], x["logprob"])
            merged.append(by_text)
        return {"tokens": texts, "token_ids": list(tokens), "token_logprobs": list(logprobs),
                "top_logprobs": merged if any(tops) else None,
                "top_tokens": alternatives if any(tops) else None,
                "text_offset": offsets}

    return {"content": [
        {**entry(t, s, lp), "top_logprobs": [entry(x["id"], _token_text(tokenizer, x["id"]),
                                                   x["logprob"]) for x in top]}
        for t, s, lp, top in zip(tokens, texts, logprobs, tops)]}


class _Watched:
    """The response generator as one request's handler sees it: stops the
    generation when the client has gone (checked before each token is sent and
    during prompt processing), counts the tokens, and keeps a failure's status."""

    def __init__(self, inner, handler, counters):
        self._inner = inner
        self._counters = counters
        self._handler = handler
        self._sock = handler.connection

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def generate(self, request, args, progress_callback=None):
        holder = {}
        handler = self._handler

        def progress(done, total):
            if peer_reset(self._sock) and "ctx" in holder:
                holder["ctx"].stop()
            if progress_callback is not None:
                progress_callback(done, total)

        try:
            ctx, responses = self._inner.generate(request, args, progress)
        except GenerationFailed:
            handler._generation_status = 500
            raise
        except Exception:
            handler._generation_status = 400
            raise
        holder["ctx"] = ctx
        meter = getattr(handler, "_meter", None)
        if meter is not None:
            meter.cached_tokens = max(ctx.prompt_cache_count, 0)

        def watched():
            for r in responses:
                if peer_reset(self._sock):
                    ctx.stop()
                    raise ClientGone()
                if meter is not None:
                    self._counters.token(meter)
                if getattr(handler, "_want_logprobs", False) and handler.stream:
                    handler._streamed.append(r)
                render = getattr(handler, "_render", None)
                if render is not None:
                    for channel, piece in render.add(r.token, final=r.finish_reason is not None):
                        handler._rendered[channel] += piece
                    if render.stopped:  # a stop string ends the reply, as in run and batch
                        if r.finish_reason is None:
                            ctx.stop()
                        yield dataclasses.replace(r, finish_reason="stop")
                        return
                yield r

        return ctx, watched()

