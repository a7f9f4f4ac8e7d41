"""Generation with Deltafin's counters attached: thin wrappers over mlx-lm's own
`stream_generate`, so sampling, caches and detokenization are mlx-lm's."""

import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Union

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler
from deltafin_mlx.compat import prefill_chunk_follows, unread_logits_in_prompt_batches
from deltafin_mlx.errors import ContextError  # noqa: F401 - callers catch it from here
from deltafin_mlx.format.dtypes import name_of
from deltafin_mlx.generation.request import fit_max_tokens
from deltafin_mlx.units import human_bytes
from deltafin_mlx.engine.runtime import find_runtime


@dataclass
class RunStats:
    """What one generation cost: the prompt's prefill and the decode timed apart,
    and the expert cache's work."""

    prompt_tokens: int = 0
    tokens: int = 0
    seconds: float = 0.0
    first_token_seconds: float = 0.0  # time to first token: the prefill and one step
    hits: int = 0
    misses: int = 0
    speculative_issued: int = 0
    speculative_used: int = 0
    bytes_read: int = 0
    stall_seconds: float = 0.0
    # The process's high-water marks when the stats were taken: MLX's allocations
    # (mx.get_peak_memory) and the resident set (getrusage's ru_maxrss).
    peak_mlx_bytes: int = 0
    peak_rss_bytes: int = 0
    activation_dtype: str = ""  # what the model computed in (--activation-dtype)

    @property
    def prefill_tokens_per_second(self) -> float:
        t = self.first_token_seconds
        return self.prompt_tokens / t if t > 0 and self.tokens else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first over the time after the first (the first token
        comes out of the prefill)."""
        t = self.seconds - self.first_token_seconds
        return (self.tokens - 1) / t if self.tokens > 1 and t > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens_per_second

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    @property
    def stall_share(self) -> float:
        return self.stall_seconds / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(prefill_tokens_per_second=self.prefill_tokens_per_second,
                 decode_tokens_per_second=self.decode_tokens_per_second,
                 tokens_per_second=self.tokens_per_second, hit_rate=self.hit_rate,
                 stall_share=self.stall_share)
        return d

    def line(self) -> str:
        if self.tokens:
            prompt = (f"{self.tokens} tokens in {self.seconds:.2f} s (decode "
                      f"{self.decode_tokens_per_second:.2f} tok/s); prompt {self.prompt_tokens} "
                      f"tokens, first token after {self.first_token_seconds:.2f} s "
                      f"(prefill {self.prefill_tokens_per_second:.1f} tok/s)")
        else:  # stopped in the prefill: what it did
            rate = self.prompt_tokens / self.seconds if self.seconds > 0 else 0.0
            prompt = (f"no token generated: stopped in the prefill after {self.prompt_tokens} "
                      f"prompt tokens in {self.seconds:.2f} s ({rate:.1f} tok/s)")
        return (
            f"{prompt}; "
            f"experts: {self.hits} hits, {self.misses} misses ({self.hit_rate:.0%} hit rate), "
            f"{self.bytes_read / 1e6:.1f} MB read, stalled on reads {self.stall_share:.0%} of the time; "
            f"peak memory {human_bytes(self.peak_mlx_bytes)} MLX, {human_bytes(self.peak_rss_bytes)} RSS"
            + (f"; activations {self.activation_dtype}" if self.activation_dtype else ""))


# The expert cache's counters (engine/cache.py CacheStats) a run reports.
CACHE_COUNTERS = ("hits", "misses", "speculative_issued", "speculative_used", "stall_seconds")


class StatsMeter:
    """Counters of a loaded model, measured from the moment it is created;
    `first_token()` marks the end of the prefill."""

    def __init__(self, model):
        self.state = find_runtime(model)
        self.start = time.perf_counter()
        self.first = None
        self.base = self._read()

    def first_token(self):
        if self.first is None:
            self.first = time.perf_counter()

    def _read(self):
        if self.state is None:
            return RunStats()
        s = self.state.stats
        return RunStats(**{k: getattr(s, k) for k in CACHE_COUNTERS},
                        bytes_read=self.state.store.bytes_read)

    def now(self, tokens: int = 0, prompt_tokens: int = 0) -> RunStats:
        cur, base = self._read(), self.base
        return RunStats(
            prompt_tokens=prompt_tokens, tokens=tokens, seconds=time.perf_counter() - self.start,
            first_token_seconds=(self.first - self.start) if self.first is not None else 0.0,
            **{k: getattr(cur, k) - getattr(base, k) for k in CACHE_COUNTERS + ("bytes_read",)},
            peak_mlx_bytes=mx.get_peak_memory(), peak_rss_bytes=peak_rss(),
            activation_dtype=name_of(self.state.activation_dtype) if self.state else "")


def peak_rss() -> int:
    """The process's resident-set high-water mark in bytes (Linux reports KiB)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def planned_pass(model, default: int = 512) -> int:
    """Prompt tokens per prefill pass, as the memory plan sized it: mlx-lm hands the
    model a pass in one call, which goes through each layer whole (its attention in
    the plan's chunks), so each expert the pass routes to is read once."""
    state = find_runtime(model)
    return state.plan.prefill_pass if state is not None else default


def cached_tokens(prompt_cache) -> int:
    """Tokens a prompt cache already holds (its attention layers' offset; of a
    batch's cache, its longest sequence's)."""
    offsets = [c.offset for c in prompt_cache or () if hasattr(c, "offset")]
    return max((int(mx.max(o).item()) if isinstance(o, mx.array) else int(o)
                for o in offsets), default=0)


class PrefillProgress:
    """Prefill progress on a terminal: tokens done, the pass and the layer it is in,
    tokens/s, ETA (one line, redrawn). mlx-lm reports each finished pass
    (`__call__`); the engine reports each layer a pass finishes (`layer`)."""

    def __init__(self, stream, min_tokens: int = 256):
        self.stream = stream
        self.min_tokens = min_tokens
        self.start = None
        self.shown = False
        self.done = self.total = 0
        self.pass_tokens = 0  # tokens per pass, when the engine reports layers

    def __call__(self, done: int, total: int):
        if self.start is None:
            self.start = time.perf_counter()
        self.done, self.total = done, total
        if done >= total:
            self.clear()
            return
        self._show(done, "")

    def clear(self):
        """Erase the progress line, if one is shown (a prefill stopped midway
        leaves it), so the next note starts on a clean line."""
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False

    def layer(self, finished: int, layers: int):
        """`finished` of the model's `layers` MoE layers are done with the pass."""
        if not self.total or self.done >= self.total:
            return
        passing = min(self.pass_tokens, self.total - 1 - self.done) or 1
        passes = -(-(self.total - 1) // max(self.pass_tokens, 1))
        this = self.done // max(self.pass_tokens, 1) + 1
        self._show(self.done + passing * finished / layers,
                   f" (pass {this}/{passes}, layer {finished}/{layers})")

    def _show(self, done: float, where: str):
        if self.total < self.min_tokens:
            return
        now = time.perf_counter()
        rate = done / (now - self.start) if done and now > self.start else 0.0
        eta = f", ETA {(self.total - done) / rate:.0f} s" if rate else ""
        self.stream.write(f"\r[prefill] {int(done)}/{self.total} tokens{where}, "
                          f"{rate:.1f} tok/s{eta}\033[K")
        self.stream.flush()
        self.shown = True


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token lists share (two renderings of a
    conversation, a cache's tokens against a new prompt)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def encode_text(tokenizer, text: str) -> list:
    """Text as mlx-lm encodes a prompt: with the tokenizer's BOS unless it starts so."""
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos)))


def stream_generate(model, tokenizer, prompt: Union[str, Sequence[int]], max_tokens: int = 256,
                    *, temp: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                    seed: Optional[int] = None, **kwargs):
    """mlx-lm's stream_generate; every response carries `.deltafin` (RunStats so far).
    The prompt is prefilled in the plan's passes (`prefill_step_size`), so its
    activations stay within the memory budget."""
    if seed is not None:
        mx.random.seed(seed)
    sampler = kwargs.pop("sampler", None) or make_sampler(temp, top_p=top_p, top_k=top_k)
    kwargs.setdefault("prefill_step_size", planned_pass(model))
    if isinstance(prompt, str):
        prompt = encode_text(tokenizer, prompt)
    state = find_runtime(model)
    if state is not None:  # the one context rule: cut to fit, refused only with no room
        max_tokens = fit_max_tokens(len(prompt), max_tokens, state.plan.context,
                                    cached_tokens(kwargs.get("prompt_cache")))
    meter = StatsMeter(model)
    progress = kwargs.get("prompt_progress_callback")
    layers = getattr(progress, "layer", None) if state is not None else None
    if layers is not None:  # a long prefill shows the layer each pass is at
        progress.pass_tokens = kwargs["prefill_step_size"]
    kwargs["prompt_progress_callback"] = unread_logits_hint(model, progress)
    try:
        with state.observe(on_pass_layer=layers) if state is not None else nullcontext():
            for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens,
                                            sampler=sampler, **kwargs):
                meter.first_token()
                r.deltafin = meter.now(r.generation_tokens, r.prompt_tokens)
                yield r
    finally:
        if state is not None:
            state.hint_logits_unread(False)


def hint_prompt_batches():
    """mlx-lm's BatchGenerator (batch, serve) says its prompt chunks' logits go
    unread, as unread_logits_hint does for generate_step."""

    def set_unread(model, unread: bool):
        state = find_runtime(model)
        if state is not None:
            state.hint_logits_unread(unread)

    unread_logits_in_prompt_batches(set_unread)


def hinted_stream_generate(stream_generate):
    """mlx-lm's `stream_generate` telling the engine which prompt chunks' logits go
    unread (unread_logits_hint): serve's single-sequence path
    (compat.use_server_stream_generate). With a draft model, mlx-lm's speculative
    loop prefills: no hint."""

    def generate(*args, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        state = find_runtime(model)
        if state is None or kwargs.get("draft_model") is not None:
            yield from stream_generate(*args, **kwargs)
            return
        kwargs["prompt_progress_callback"] = unread_logits_hint(
            model, kwargs.get("prompt_progress_callback"))
        try:
            yield from stream_generate(*args, **kwargs)
        finally:
            state.hint_logits_unread(False)

    return generate


def unread_logits_hint(model, callback=None):
    """A prompt_progress_callback for mlx-lm's `generate_step` over `model`: calls
    `callback`, then tells the engine whether the model's next call is a prefill
    chunk whose logits mlx-lm never reads (compat.prefill_chunk_follows), so that
    the last layer's MoE block is not computed for it (Runtime.hint_logits_unread),
    as mlx-lm's own lazy prefill never computes it. The caller clears the hint
    when generation ends or fails."""
    state = find_runtime(model)
    if state is None:
        return callback

    def on_progress(processed, total):
        state.hint_logits_unread(False)
        if callback is not None:
            callback(processed, total)
        state.hint_logits_unread(prefill_chunk_follows(processed, total))

    return on_progress
