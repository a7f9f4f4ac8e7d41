"""How a reply's next token is chosen, stated once for a run, a chat, a batch and
serve (and any caller of the library): the sampling options and their mapping
onto mlx-lm's own `make_sampler` and `make_logits_processors`, so the arithmetic
is mlx-lm's. `KeyedSampler` is that same chain drawing from a key of its own,
for a batch, where a request's samples must depend on its seed alone."""

from dataclasses import dataclass
from typing import Dict, List, Optional

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from deltafin_mlx import compat


@dataclass
class Sampling:
    """The options; the defaults are greedy decoding with no penalties. Each
    penalty looks back over its own last tokens (mlx-lm's `*_context_size`, 20
    there and here)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_context: int = 20
    presence_context: int = 20
    frequency_context: int = 20
    logit_bias: Optional[Dict[int, float]] = None
    xtc_special_tokens: Optional[List[int]] = None  # mlx-lm's server: "\n" and the EOS ids

    def sampler(self):
        """mlx-lm's sampler for these options (argmax at temperature 0)."""
        return make_sampler(self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k,
                            xtc_probability=self.xtc_probability,
                            xtc_threshold=self.xtc_threshold,
                            xtc_special_tokens=self.xtc_special_tokens)

    def logits_processors(self) -> Optional[List]:
        """mlx-lm's logits processors for the penalties and bias asked for; None
        without any."""
        processors = make_logits_processors(
            logit_bias=self.logit_bias,
            repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context,
            presence_penalty=self.presence_penalty, presence_context_size=self.presence_context,
            frequency_penalty=self.frequency_penalty,
            frequency_context_size=self.frequency_context)
        return processors or None


class KeyedSampler:
    """mlx-lm's sampler for `sampling`, drawing from a key of its own: a request's
    samples depend on its seed alone, not on what else is in the batch or how
    often the job was resumed. The filters are mlx-lm's own chain, as its
    `make_sampler` built them for these options (same steps, same order); only
    the last step, mlx-lm's `categorical_sampling`, is drawn with this sampler's
    key, split the way `mx.random.seed` + mlx-lm's sampler split the global one,
    so a request samples exactly what `deltafin-run --seed S` samples from the
    same logits. (MLX's global key cannot be set to a given key, only seeded, so
    the chain cannot simply be run under it.) XTC's own coin (mlx-lm's
    `apply_xtc`) still comes from the global key: a request that asks for XTC
    samples reproducibly only alone."""

    def __init__(self, sampling: Sampling, seed: int):
        self.sampling, self.seed = sampling, seed
        self.filters, self.temp = compat.sampler_chain(sampling.sampler())
        self.key = mx.random.key(seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.temp is None:  # mlx-lm's greedy sampler
            return mx.argmax(logprobs, axis=-1)
        for step in self.filters:
            logprobs = step(logprobs)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / self.temp), key=sub)
