"""A conversation that keeps the model's cache: each turn prefills only its own tokens.

The tokens in the cache are the truth of a conversation. A turn's prompt is the
cache's tokens, the end-of-turn markup when the last reply did not end with the
model's own stop token, then the new user message as the chat template renders
it after an assistant turn. Before a turn the prompt is compared with the
cache's tokens; where they diverge the cache is trimmed there (attention caches)
or rebuilt (recurrent state cannot be trimmed), never used stale.

A session saves to one safetensors file (mlx-lm's `save_prompt_cache`, through
session_file.py, which checksums all of it) with the conversation, its
tokens, the model's fingerprint and the format version in the metadata, so a
restart continues without prefilling the history again.
"""

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import ArraysCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from deltafin_mlx.generation.engine import (Completion, Defaults, chat_prompt, model_limits,
                                            prepare, stream)
from deltafin_mlx.generation.request import GenerationRequest
from deltafin_mlx.generation.stream import PrefillProgress, StatsMeter, common_prefix
from deltafin_mlx.chat.context import grow, shrink
from deltafin_mlx.errors import SessionError
from deltafin_mlx.chat.session_file import read_session, write_session
from deltafin_mlx.engine.runtime import runtime, find_runtime

SESSION_FORMAT = "deltafin-chat"
# 2: a checksum of the cached tensors; 3: of the whole content (session_file.py)
SESSION_VERSION = 3
# A probe conversation: rendering it shows what the template puts between turns.
_PROBE_USER, _PROBE_REPLY = "Hi.", "Hello."


class Interrupted(Exception):
    """Raised between prefill chunks when the user asked to stop."""


@dataclass
class Turn(Completion):
    """What one turn did: its reply, and how many tokens it prefilled."""

    prefilled: int = 0  # prompt tokens run through the model for this turn
    reused: int = 0  # history tokens taken from the cache instead
    prompt_tokens: int = 0  # the tokens this turn had to prefill (`prefilled` when done)
    # Interrupted before its reply began: the turn left the conversation, its tokens
    # and its cache exactly as they were before it.
    dropped: bool = False


def model_fingerprint(model) -> str:
    """What a saved cache is only valid for: the converted model and the
    activation dtype its state was computed in."""
    from mlx.utils import tree_flatten

    raw = (runtime(model).manifest.path / "deltafin.json").read_bytes()
    dtype = next((v.dtype for _, v in tree_flatten(model.parameters())
                  if mx.issubdtype(v.dtype, mx.floating)), None)
    return f"{hashlib.sha256(raw).hexdigest()[:32]}/{dtype}"


def session_path(path) -> Path:
    """mlx saves safetensors under this suffix; add it when the name lacks it."""
    p = Path(os.path.expanduser(str(path)))
    return p if p.suffix == ".safetensors" else p.with_name(p.name + ".safetensors")


class ChatSession:
    """A conversation with `model`: messages, the cache, and the tokens it holds."""

    def __init__(self, model, tokenizer, system: Optional[str] = None, thinking: bool = True,
                 thinking_effort: Optional[str] = None,
                 reload: Optional[Callable[[int], object]] = None):
        """`reload(context)`: the model loaded again for a larger context (closing
        this one first), so the conversation can grow past the planned context
        (chat_context.py); without it a turn beyond the context is refused."""
        self.model = model
        self.reload = reload
        self.growth = None  # the last turn's re-plan (chat_context.Growth), if any
        self.tokenizer = tokenizer
        self.system = system
        self.thinking = thinking
        self.thinking_effort = thinking_effort
        self.parameters = {}  # what `/set parameter` changed (ollama's names), saved with it
        state = find_runtime(model)
        # The context the model was first planned for: /drop plans it back there.
        self.planned_context = state.plan.context if state is not None else None
        self.reset()

    def reset(self):
        """Forget the conversation and empty the cache."""
        self.messages: List[dict] = [{"role": "system", "content": self.system}] \
            if self.system else []
        self.cache = make_prompt_cache(self.model)
        self.tokens: List[int] = []
        self.cut = False  # the last reply was cut at a stop string: its tokens hold it

    def set_system(self, text: str):
        """A new system message (ollama's `/set system`): the next turn renders the
        whole conversation again and prefills it from where it first differs."""
        self.system = text or None
        self.messages = ([{"role": "system", "content": text}] if text else []) + [
            m for m in self.messages if m["role"] != "system"]
        self.cut = True  # the cache's tokens hold the old one: no incremental turn

    # Prompts

    def render(self, messages, add_generation_prompt=True) -> List[int]:
        return chat_prompt(self.tokenizer, messages, thinking=self.thinking,
                           thinking_effort=self.thinking_effort,
                           add_generation_prompt=add_generation_prompt)

    def _between_turns(self, text):
        """(end-of-turn markup after a reply, the next user turn with the generation
        prompt), from how the template renders a probe conversation; None when the
        template does not render turns as a sequence."""
        head = self.messages[:1] if self.system else []
        asked = self.render(head + [{"role": "user", "content": _PROBE_USER}])
        answered = self.render(head + [{"role": "user", "content": _PROBE_USER},
                                       {"role": "assistant", "content": _PROBE_REPLY}],
                               add_generation_prompt=False)
        following = self.render(head + [{"role": "user", "content": _PROBE_USER},
                                        {"role": "assistant", "content": _PROBE_REPLY},
                                        {"role": "user", "content": text}])
        reply = self.tokenizer.encode(_PROBE_REPLY, add_special_tokens=False)
        end = _find_last(answered, reply, start=len(asked))
        if end is None or following[: len(answered)] != answered:
            return None
        return answered[end + len(reply):], following[len(answered):]

    def prompt_for(self, text: str) -> List[int]:
        """The whole conversation's tokens with `text` as the next user turn."""
        parts = self._between_turns(text) if self.tokens and not self.cut else None
        if parts is None:  # re-render; the divergence check below keeps what still matches
            return self.render(self.messages + [{"role": "user", "content": text}])
        closing, turn = parts
        ended = self.tokens[-1] in self.tokenizer.eos_token_ids
        return self.tokens + ([] if ended else closing) + turn

    def sync(self, prompt: List[int]) -> int:
        """Make the cache hold a prefix of `prompt` (at least one token short of it);
        returns how many of its tokens the cache already holds."""
        n = common_prefix(self.tokens, prompt)
        n = min(n, len(prompt) - 1)
        if not _consistent(self.cache, len(self.tokens)):
            n = 0  # the cache and the record disagree: never trust it
        if n < len(self.tokens):
            if n > 0 and can_trim_prompt_cache(self.cache):
                trim_prompt_cache(self.cache, len(self.tokens) - n)
            else:
                self.cache = make_prompt_cache(self.model)
                n = 0
            self.tokens = self.tokens[:n]
        return n

    # Turns

    def ask(self, text: str, max_tokens: int = 256, *, defaults: Optional[Defaults] = None,
            progress: Optional[Callable[[int, int], None]] = None,
            stop_requested: Callable[[], bool] = lambda: False,
            on_text: Optional[Callable[[str, str], None]] = None,
            prompt: Optional[List[int]] = None, **kwargs) -> Turn:
        """One turn: prefill what the cache lacks, generate the reply (the engine's
        stream; `defaults`: the sampling and stop strings), record both.

        on_text(channel, text) receives the reply as it streams ("think" or
        "answer"; markup is never passed). A stop string ends the reply before it
        (finish "stop"): the history records the reply without it, and the next
        turn renders the conversation again rather than carry it. When
        stop_requested() turns true (Ctrl-C) during the reply, the turn ends at
        the next token and the reply so far is kept in the history as a finished
        turn. Before the reply's first token it ends at the next prefill chunk (or
        that token) and the turn is dropped (`Turn.dropped`): the messages, the
        tokens and the cache are exactly as before it, as they are after an error
        or a KeyboardInterrupt inside a forward pass (which is re-raised). `prompt`:
        the whole conversation's tokens, when the caller built them (prompt_for's)."""
        prompt = self.prompt_for(text) if prompt is None else list(prompt)
        reused = self.sync(prompt)
        new = prompt[reused:]
        state = find_runtime(self.model)
        context_before = state.plan.context if state is not None else None
        self.model, self.growth = grow(self.model, self.reload, len(prompt) + max(max_tokens, 1),
                                       least=len(prompt) + 1)
        user = {"role": "user", "content": text}
        prepared = prepare(  # before any change: a turn beyond the context is refused
            GenerationRequest(messages=self.messages + [user]), self.tokenizer,
            model_limits(self.model),
            replace(defaults or Defaults(), max_tokens=max_tokens, thinking=self.thinking),
            prompt=new, cached=reused)
        turn = Turn(reused=reused, prompt_tokens=len(new))
        done = [0]

        def on_progress(n, total):
            done[0] = n
            if progress is not None:
                progress(n, total)
            if stop_requested() and n < total:
                raise Interrupted

        meter = StatsMeter(self.model)
        before = Snapshot.take(self)
        self.messages.append(user)
        try:
            for e in stream(self.model, prepared, prompt_cache=self.cache, progress=on_progress,
                            stop_requested=stop_requested, **kwargs):
                if not turn.tokens:
                    if stop_requested():  # asked during the prefill: no reply began
                        raise Interrupted
                    self.tokens += new
                    turn.prefilled = len(new)
                turn.add(e, on_text)
                self.tokens.append(e.token)  # every token yielded is in the cache
        except Interrupted:
            before.restore(self)
            self._undo_growth(context_before)
            turn.prefilled, turn.finish_reason, turn.dropped = done[0], "interrupted", True
            turn.stats = meter.now(0, done[0])
            return turn
        except BaseException:
            before.restore(self)  # stopped inside a forward pass: the turn did not happen
            self._undo_growth(context_before)
            raise
        self.cut = turn.finish_reason == "stop" and self.tokens[-1] not in \
            self.tokenizer.eos_token_ids
        reply = {"role": "assistant", "content": turn.text}
        if turn.thinking:
            reply["reasoning_content"] = turn.thinking
        self.messages.append(reply)
        return turn

    def _undo_growth(self, context):
        """A turn that did not happen leaves the plan as it was: a context grown
        for it is planned back (the cache, as before the turn, is kept)."""
        if self.growth is not None and context is not None:
            self.model, _ = shrink(self.model, self.reload, len(self.tokens) + 1, context)
            self.growth = None

    def drop_oldest(self, turns: int = 1) -> int:
        """Forget the oldest `turns` exchanges (a user message and its reply; the
        system message stays); the rest is prefilled again at the next turn, since
        its tokens now start elsewhere. Returns the messages dropped."""
        head = 1 if self.messages and self.messages[0]["role"] == "system" else 0
        body = self.messages[head:]
        cut, seen = 0, 0
        while cut < len(body) and seen < turns:
            cut += 1
            if body[cut - 1]["role"] == "user":
                while cut < len(body) and body[cut]["role"] != "user":
                    cut += 1
                seen += 1
        self.messages = self.messages[:head] + body[cut:]
        self.tokens = []
        if self.planned_context is not None:
            self.model, self.growth = shrink(self.model, self.reload,
                                             self.conversation_tokens()[0] + 1,
                                             self.planned_context)
        self.cache = make_prompt_cache(self.model)
        return cut

    def conversation_tokens(self):
        """(tokens of the conversation, how many of them the next turn prefills
        again): after /drop the cache is empty and the whole rest is pending."""
        if self.tokens or not any(m["role"] != "system" for m in self.messages):
            return len(self.tokens), 0
        n = len(self.render(self.messages, add_generation_prompt=False))
        return n, n

    # Saving and restoring

    def save(self, path):
        """Write the conversation and its cache atomically (a temporary file, renamed)."""
        path = session_path(path)
        meta = {"format": SESSION_FORMAT,
                "version": str(SESSION_VERSION),
                "model": model_fingerprint(self.model),
                "tokens": json.dumps(self.tokens),
                "messages": json.dumps(self.messages, ensure_ascii=False),
                "options": json.dumps({"system": self.system, "thinking": self.thinking,
                                       "thinking_effort": self.thinking_effort}),
                "cut": json.dumps(self.cut),
                "parameters": json.dumps(self.parameters)}
        write_session(path, self.cache, meta)

    @classmethod
    def restore(cls, path, model, tokenizer, reload=None, **options) -> "ChatSession":
        """The session saved at `path`; refused (SessionError) when it was saved by
        another model or another version of this format. With `reload` (as for
        ChatSession) a session longer than the planned context grows it."""
        path = session_path(path)
        cache, meta = read_session(path, SESSION_FORMAT, SESSION_VERSION)
        if meta.get("model") != model_fingerprint(model):
            raise SessionError(f"{path}: saved with another model (or activation dtype); "
                               "start a new session file")
        saved = json.loads(meta["options"])
        for key, value in options.items():
            if value is not None and key in saved and saved[key] != value:
                raise SessionError(f"{path}: saved with {key}={saved[key]!r}, not {value!r}")
        session = cls(model, tokenizer, **saved)
        fresh = make_prompt_cache(model)
        if [type(c) for c in cache] != [type(c) for c in fresh]:
            raise SessionError(f"{path}: its cache does not fit this model")
        session.cache = cache
        session.tokens = json.loads(meta["tokens"])
        session.messages = json.loads(meta["messages"])
        session.cut = json.loads(meta.get("cut", "false")) is True
        parameters = json.loads(meta.get("parameters", "{}"))
        session.parameters = parameters if isinstance(parameters, dict) else {}
        if not _consistent(cache, len(session.tokens)):
            raise SessionError(f"{path}: damaged (its cache and its tokens disagree)")
        session.reload = reload
        session.model, session.growth = grow(model, reload, len(session.tokens) + 1)
        plan = find_runtime(session.model)
        if plan is not None and len(session.tokens) >= plan.plan.context:
            raise SessionError(f"{path}: {len(session.tokens)} tokens, beyond the planned "
                               f"context of {plan.plan.context} (raise --context)")
        return session


@dataclass
class Snapshot:
    """A conversation as it stood before a turn: its messages, tokens and each
    cache layer's state, so a dropped turn leaves no trace. An attention layer is
    trimmed back to its length (mlx-lm's KV caches write in place past it); a
    recurrent layer (mlx-lm's ArraysCache, which cannot be trimmed) gets its state
    back: a step replaces its arrays, never writes them, so keeping them costs
    nothing. Any other kind (a rotating window, written in place) cannot be kept:
    the cache is rebuilt and the next turn prefills the conversation again."""

    messages: List[dict]
    tokens: List[int]
    cache: list
    layers: list  # per cache layer: ("trim", offset), ("state", state) or ("rebuild", None)

    @classmethod
    def take(cls, session) -> "Snapshot":
        layers = []
        for c in session.cache:
            if hasattr(c, "offset") and c.is_trimmable():
                layers.append(("trim", c.offset))
            elif isinstance(c, ArraysCache):
                layers.append(("state", tree_map(lambda x: x, c.state)))
            else:  # a cache a step may write in place (a rotating window): not kept
                layers.append(("rebuild", None))
        return cls([dict(m) for m in session.messages], list(session.tokens), session.cache, layers)

    def restore(self, session):
        if any(kind == "rebuild" for kind, _ in self.layers):
            # The messages stand; the next turn prefills them again into a new cache.
            session.cache, session.tokens = make_prompt_cache(session.model), []
            session.messages = self.messages
            return
        for c, (kind, value) in zip(self.cache, self.layers):
            if kind == "trim":
                if c.offset > value:
                    c.trim(c.offset - value)
            else:
                c.state = value
        session.cache, session.tokens, session.messages = self.cache, self.tokens, self.messages


def _consistent(cache, tokens: int) -> bool:
    """Every attention layer's cache holds exactly `tokens` tokens."""
    return all(c.offset == tokens for c in cache if hasattr(c, "offset"))


def _find_last(seq, sub, start=0):
    for i in range(len(seq) - len(sub), start - 1, -1):
        if seq[i : i + len(sub)] == sub:
            return i
    return None


__all__ = ["ChatSession", "Turn", "SessionError", "PrefillProgress", "session_path"]

