"""The windows a text is cut into for perplexity, as llama-perplexity and
mlx_lm.perplexity cut them; each is scored as a "tokens" line of a score job would
be (jobs/score.py).

    stride None (llama-perplexity's default): windows side by side (the text's
        first context x (tokens // context) tokens); each window scores its second
        half, the first half being context only.
    stride S (llama-perplexity's --ppl-stride): a window starts every S tokens and
        scores its last S tokens, so every token after the first window's context
        is scored once; S = context scores every token of side-by-side windows but
        the first of each (mlx_lm.perplexity's rule).
"""

from dataclasses import dataclass
from typing import List, Optional

from deltafin_mlx.errors import JobError
from deltafin_mlx.jobs.score_lines import ScoreItem


@dataclass
class Windows:
    context: int  # tokens per window
    stride: Optional[int] = None  # None: side by side, second half scored

    def check(self):
        if self.context < 2:
            raise JobError(f"-c/--context must be 2 or more (got {self.context})")
        if self.stride is not None and not 1 <= self.stride <= self.context:
            raise JobError(f"--stride must be between 1 and the context, {self.context} "
                             f"(got {self.stride})")

    @property
    def step(self) -> int:
        return self.context if self.stride is None else self.stride

    @property
    def first_scored(self) -> int:
        """The first position of a window that is scored (the ones before it are
        context only; position 0 has no prediction)."""
        if self.stride is None:
            return self.context // 2
        return max(1, self.context - self.stride)

    def starts(self, n_tokens: int, limit: Optional[int] = None) -> List[int]:
        starts = list(range(0, n_tokens - self.context + 1, self.step))
        return starts[:limit] if limit else starts




def window_items(tokens: List[int], windows: Windows, chunks: Optional[int] = None
                 ) -> List[ScoreItem]:
    """One ScoreItem per window: its tokens, the positions it scores."""
    starts = windows.starts(len(tokens), chunks)
    if not starts:
        raise JobError(f"the text has {len(tokens)} tokens, fewer than one window of "
                         f"{windows.context} (-c)")
    return [ScoreItem.scored_from(i, tokens[s : s + windows.context], windows.first_scored)
            for i, s in enumerate(starts)]

