"""How a reply's next token is chosen, stated once for a run, a chat and a batch
(and any caller of the library): the sampling options and their mapping onto
mlx-lm's own `make_sampler` and `make_logits_processors`, so the arithmetic is
mlx-lm's."""

from dataclasses import dataclass
from typing import List, Optional

from mlx_lm.sample_utils import make_logits_processors, make_sampler


@dataclass
class Sampling:
    """The options; the defaults are greedy decoding with no penalties. The three
    penalties look back over the last `penalty_context` tokens (mlx-lm's
    `*_context_size`, 20 there and here)."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    penalty_context: int = 20

    def sampler(self):
        """mlx-lm's sampler for these options (argmax at temperature 0)."""
        return make_sampler(self.temp, top_p=self.top_p, min_p=self.min_p, top_k=self.top_k)

    def logits_processors(self) -> Optional[List]:
        """mlx-lm's logits processors for the penalties asked for; None without any."""
        if (self.repetition_penalty, self.presence_penalty, self.frequency_penalty) == (None,) * 3:
            return None
        n = self.penalty_context
        return make_logits_processors(
            repetition_penalty=self.repetition_penalty, repetition_context_size=n,
            presence_penalty=self.presence_penalty, presence_context_size=n,
            frequency_penalty=self.frequency_penalty, frequency_context_size=n)

    def generation_kwargs(self) -> dict:
        """What mlx-lm's stream_generate takes for these options."""
        kwargs = {"sampler": self.sampler()}
        processors = self.logits_processors()
        if processors:
            kwargs["logits_processors"] = processors
        return kwargs
