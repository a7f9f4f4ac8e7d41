"""A job's progress line on stderr (batch, score, perplexity)."""

import sys
import time

from deltafin_mlx.jobs.outcome import Outcome


class Progress:
    """The lines `outcome` counts done and failed of `total` (`items` names them: a
    score job counts texts), the prefill's tokens while prompts are read, aggregate
    tokens/s, ETA and the job's own `status` (perplexity's running value), on one
    stderr line redrawn, or with `every_line` (a log, not a terminal) a line per
    item finished."""

    def __init__(self, total: int, skipped: int, show: bool, outcome: Outcome,
                 items: str = "requests", every_line: bool = False):
        self.total, self.skipped, self.show = total, skipped, show
        self.every_line, self.status = every_line, ""
        self.outcome, self.items, self.tokens = outcome, items, 0
        self.prefill = {}  # uid -> (prompt tokens done, of total), while prefilling
        self.in_layer = ""  # where the prefill step now running is (the engine says)
        self.start = time.perf_counter()
        self.last = 0.0

    def step(self, tokens: int, prompt_responses=()):
        self.tokens += tokens
        for r in prompt_responses:
            self.prefill[r.uid] = tuple(r.progress)
        self.prefill = {u: p for u, p in self.prefill.items() if p[0] < p[1]}
        self.in_layer = ""
        self._draw()

    def layer(self, finished: int, layers: int):
        """A prefill step has finished `finished` of the model's `layers` MoE layers
        (the first step of a job can take long before any prompt reports)."""
        self.in_layer = f" (MoE layer {finished}/{layers})"
        self._draw()

    def finished(self, result: dict):
        self.outcome.add(result)
        self._draw(force=True)

    @property
    def tokens_per_second(self) -> float:
        t = time.perf_counter() - self.start
        return self.tokens / t if t > 0 else 0.0

    def _draw(self, force=False):
        now = time.perf_counter()
        if not self.show or not force and (self.every_line or now - self.last < 0.5):
            return
        self.last = now
        answered = self.outcome.answered
        done = self.skipped + answered
        left = self.total - done
        eta = (now - self.start) / answered * left if answered else float("nan")
        eta = "?" if eta != eta else f"{int(eta // 3600)}:{int(eta % 3600 // 60):02d}:{int(eta % 60):02d}"
        reading = f", prefilling{self.in_layer}" if self.in_layer else ""
        if self.prefill:
            have = sum(p[0] for p in self.prefill.values())
            want = sum(p[1] for p in self.prefill.values())
            reading = (f", prefill {have}/{want} tokens of {len(self.prefill)} prompts"
                       f"{self.in_layer}")
        start, end = ("", "\n") if self.every_line else ("\r\033[K", "")
        print(f"{start}[{self.outcome.label}] {done}/{self.total} {self.items} "
              f"({self.outcome.errors} errors){reading}, "
              f"{self.tokens_per_second:.2f} tok/s, ETA {eta}{self.status}", end=end,
              file=sys.stderr, flush=True)

    def close(self):
        if self.show and not self.every_line:
            print(file=sys.stderr)
