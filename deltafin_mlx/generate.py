"""Generation with Deltafin's counters attached: thin wrappers over mlx-lm's own
`stream_generate`, so sampling, caches and detokenization are mlx-lm's."""

import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Sequence, Union

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler


@dataclass
class RunStats:
    """What one generation cost: tokens, time and the expert cache's work."""

    prompt_tokens: int = 0
    tokens: int = 0
    seconds: float = 0.0
    hits: int = 0
    misses: int = 0
    speculative_issued: int = 0
    speculative_used: int = 0
    bytes_read: int = 0
    stall_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    @property
    def stall_share(self) -> float:
        return self.stall_seconds / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tokens_per_second=self.tokens_per_second, hit_rate=self.hit_rate,
                 stall_share=self.stall_share)
        return d

    def line(self) -> str:
        return (
            f"{self.tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_second:.2f} tok/s); "
            f"experts: {self.hits} hits, {self.misses} misses ({self.hit_rate:.0%} hit rate), "
            f"{self.bytes_read / 1e6:.1f} MB read, stalled on reads {self.stall_share:.0%} of the time"
        )


class StatsMeter:
    """Counters of a loaded model, measured from the moment it is created."""

    def __init__(self, model):
        self.state = getattr(model, "_deltafin", None)
        self.start = time.perf_counter()
        self.base = self._read()

    def _read(self):
        if self.state is None:
            return RunStats()
        s = self.state.stats
        return RunStats(hits=s.hits, misses=s.misses, speculative_issued=s.speculative_issued,
                        speculative_used=s.speculative_used, bytes_read=self.state.store.bytes_read,
                        stall_seconds=s.stall_seconds)

    def now(self, tokens: int = 0, prompt_tokens: int = 0) -> RunStats:
        cur, base = self._read(), self.base
        return RunStats(
            prompt_tokens=prompt_tokens,
            tokens=tokens,
            seconds=time.perf_counter() - self.start,
            hits=cur.hits - base.hits,
            misses=cur.misses - base.misses,
            speculative_issued=cur.speculative_issued - base.speculative_issued,
            speculative_used=cur.speculative_used - base.speculative_used,
            bytes_read=cur.bytes_read - base.bytes_read,
            stall_seconds=cur.stall_seconds - base.stall_seconds,
        )


def chat_prompt(tokenizer, messages: List[dict], thinking: bool = True):
    """Token ids for a conversation, with the model's own prompt format when it
    has one (K3's XTML, a Jinja chat template), else the last message as text."""
    if getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, thinking=thinking,
            enable_thinking=thinking,
        )
    return tokenizer.encode(messages[-1]["content"])


def stream_generate(model, tokenizer, prompt: Union[str, Sequence[int]], max_tokens: int = 256,
                    *, temp: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                    seed: Optional[int] = None, **kwargs):
    """mlx-lm's stream_generate; every response carries `.deltafin` (RunStats so far)."""
    if seed is not None:
        mx.random.seed(seed)
    sampler = kwargs.pop("sampler", None) or make_sampler(temp, top_p=top_p, top_k=top_k)
    meter = StatsMeter(model)
    for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                    sampler=sampler, **kwargs):
        r.deltafin = meter.now(r.generation_tokens, r.prompt_tokens)
        yield r


@dataclass
class Completion:
    text: str
    tokens: List[int]
    stats: RunStats
    finish_reason: Optional[str] = None

    def __str__(self):
        return self.text


def generate(model, tokenizer, prompt, max_tokens: int = 256, *,
             stop: Sequence[str] = (), **kwargs) -> Completion:
    """Generate to completion: the text, its tokens and what it cost."""
    text, tokens, last, reason = "", [], None, None
    for r in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        text += r.text
        tokens.append(r.token)
        last, reason = r, r.finish_reason
        hit = next((s for s in stop if s in text), None)
        if hit is not None:
            text = text[: text.index(hit)]
            reason = "stop"
            break
    stats = last.deltafin if last is not None else RunStats()
    return Completion(text, tokens, stats, reason)
