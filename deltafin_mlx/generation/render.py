"""The one rule that turns a reply's tokens into text, for `run` (its stream and
--json), `chat`, `batch` and `serve` alike: markup tokens (special tokens, K3's
XTML tags) are never shown, K3's thinking channel is apart from its answer, and
the answer ends before the first stop string. With a template that has no
thinking channel the whole reply is the answer.

A reply starts in the thinking channel when its prompt leaves that channel open
(`opens_thinking`: a conversation rendered with thinking on).
"""

from typing import List, Sequence, Tuple

from deltafin_mlx import compat
from deltafin_mlx.generation.stops import StopMatcher


class Channels:
    """Splits a reply's tokens into thinking and answer text; markup tokens
    (special tokens, XTML tags) are never shown. K3's XTML replies open `think`
    and `response` channels; with other templates the whole reply is the answer."""

    def __init__(self, tokenizer, thinking: bool = True):
        self.tokenizer = tokenizer
        self.special = set(getattr(tokenizer, "all_special_ids", None) or [])
        inner = compat.wrapped_tokenizer(tokenizer)
        self.special |= set(getattr(inner, "_special_ids", ()) or ())
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.xtml = bool(getattr(inner, "is_xtml", False))
        # K3's generation prompt opens the think channel, or the response channel
        self.channel = "think" if self.xtml and thinking else "answer"
        self.tag = None  # the XTML tag being read after <|open|> or <|close|>
        self.thinking = ""
        self.answer = ""

    def add(self, token: int, final: bool = False):
        """(channel, text) pieces for one token."""
        out = []
        if token in self.special or token in self.tokenizer.eos_token_ids:
            self._flush(out)
            name = self.tokenizer.decode([token])
            if self.xtml and name in ("<|open|>", "<|close|>"):
                self.tag = (name, "")
            elif self.xtml and name == "<|sep|>" and self.tag is not None:
                opener, tag = self.tag
                tag = tag.strip().split(" ")[0]
                if opener == "<|open|>" and tag in ("think", "response"):
                    self.channel = "think" if tag == "think" else "answer"
                self.tag = None
            return out
        if self.tag is not None:
            self.tag = (self.tag[0], self.tag[1] + self.tokenizer.decode([token]))
            return out
        self.detok.add_token(token)
        if final:
            self.detok.finalize()
        self._emit(self.detok.last_segment, out)
        return out

    def flush(self):
        """(channel, text) pieces of what the detokenizer held back for more tokens."""
        out = []
        self._flush(out)
        return out

    def _flush(self, out):
        self.detok.finalize()
        self._emit(self.detok.last_segment, out)
        self.detok.reset()

    def _emit(self, text, out):
        if not text:
            return
        if self.channel == "think":
            self.thinking += text
        else:
            self.answer += text
        out.append((self.channel, text))


class Render:
    """A reply's tokens as its answer and thinking: Channels, with the answer cut
    before the first stop string. `add` returns the (channel, text) pieces that
    can be shown now; `finish` the answer held back in case a stop began there."""

    def __init__(self, tokenizer, thinking: bool = True, stop: Sequence[str] = ()):
        self.channels = Channels(tokenizer, thinking)
        self.stops = StopMatcher(stop)

    def add(self, token: int, final: bool = False) -> List[Tuple[str, str]]:
        out = []
        for channel, piece in self.channels.add(token, final):
            if self.stops.stopped:
                break
            if channel == "answer":
                piece = self.stops.add(piece)
            if piece:
                out.append((channel, piece))
        return out

    def finish(self) -> List[Tuple[str, str]]:
        """The end of the reply: the text the detokenizer and the stop matcher held
        back for more tokens (once; a second call returns nothing)."""
        out = []
        for channel, piece in self.channels.flush():
            if channel == "answer":
                piece = self.stops.add(piece)
            if piece and not (self.stops.stopped and channel != "answer"):
                out.append((channel, piece))
        rest = self.stops.flush()
        if rest:
            out.append(("answer", rest))
        return out

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    @property
    def text(self) -> str:
        return self.stops.text

    @property
    def thinking(self) -> str:
        return self.channels.thinking


def opens_thinking(tokenizer, prompt) -> bool:
    """Whether a prompt's tokens leave K3's thinking channel open (the last channel
    they open, as Channels reads them, is `think`), so that its reply starts there:
    a conversation rendered with thinking on, never one with thinking off, a text
    with no markup, or a template without a thinking channel."""
    channels = Channels(tokenizer, thinking=False)
    for t in prompt:
        if t in channels.special or channels.tag is not None:
            channels.add(t)
    return channels.channel == "think"


def render(tokenizer, tokens: Sequence[int], thinking: bool = True,
           stop: Sequence[str] = ()) -> Tuple[str, str]:
    """(answer, thinking) of a whole reply."""
    r = Render(tokenizer, thinking, stop)
    for i, t in enumerate(tokens):
        r.add(t, final=i == len(tokens) - 1)
    r.finish()
    return r.text, r.thinking
