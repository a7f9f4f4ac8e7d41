"""One scoring pass: its texts through the model in one call, then their
log-probabilities.

The texts go in as a batch of right-padded rows with a causal mask, so no real
token sees a pad and each row's arithmetic is the row's alone. The model's decoder
stack runs once for the whole pass: every MoE layer routes all its real tokens at
once and reads each expert they use once (the streaming module is told which
positions are pads: `Runtime.real_tokens`), and attention takes the rows in
groups (engine/chunked_attention), or, for texts longer than an attention chunk,
each row in chunks over a cache kept only for this call. The final hidden states
of the scored positions then go through the head a block of rows at a time
(score/logprobs.py), so vocab x tokens logits never sit in memory whole.
"""

from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from deltafin_mlx.compat import body_and_head
from deltafin_mlx.engine.chunked_attention import chunk_bounds, row_tokens
from deltafin_mlx.engine.runtime import find_runtime
from deltafin_mlx.jobs.score_lines import ScoreItem
from deltafin_mlx.generation.logprobs import logprob_rows


@dataclass
class Scored:
    """One text's scores: per position (None where not scored) the token's
    log-probability and its top K ([ids], [log-probs]), and whether every scored
    token was the argmax."""

    item: ScoreItem
    token_logprobs: np.ndarray  # (T,) float32, NaN where not scored
    top_ids: Optional[np.ndarray]  # (T, K) int64, or None without top-K
    top_logprobs: Optional[np.ndarray]  # (T, K) float32, NaN rows where not scored
    greedy: bool
    # (scored positions, J) float32: the log-probabilities of the ids `run_pass`
    # was asked about at each scored position, or None
    at_logprobs: Optional[np.ndarray] = None
    ranks: Optional[np.ndarray] = None  # (T,) int64, 0 where not scored (LogprobRows.ranks)

    @property
    def logprob(self) -> float:
        return float(np.nansum(self.token_logprobs.astype(np.float64)))


class RouteUnion:
    """Per MoE layer, the distinct experts a pass's real tokens route to (the
    union bound on what it may read), heard as an observer of the routing
    (Runtime.observe)."""

    def __init__(self, state):
        self.banks = state.store.cache.banks
        self.experts = {}
        self.observing = state.observe(on_route=self)

    def __call__(self, layer, routed):
        self.experts.setdefault(layer, set()).update(np.unique(routed).tolist())

    def bytes(self) -> int:
        return sum(len(e) * self.banks[layer].layout.record_size
                   for layer, e in self.experts.items())


@dataclass
class Rows:
    """Log-probabilities at a run of scored positions (score_rows), in order."""

    chosen: np.ndarray  # (N,) float32: each target's log-probability
    greedy: np.ndarray  # (N,) bool: the target was the argmax
    top_ids: Optional[np.ndarray]  # (N, K) int64, or None without top-K
    top_vals: Optional[np.ndarray]
    at_vals: Optional[np.ndarray]  # (N, J) float32, or None
    ranks: np.ndarray  # (N,) int64: each target's rank (LogprobRows.ranks)

    def scored(self, item: ScoreItem, at: int, n: int) -> Scored:
        """`item`'s scores from its `n` rows starting at row `at`."""
        pos = np.nonzero(item.scored)[0]
        lp = np.full(len(item.tokens), np.nan, np.float32)
        lp[pos] = self.chosen[at : at + n]
        ranks = np.zeros(len(item.tokens), np.int64)
        ranks[pos] = self.ranks[at : at + n]
        ids = vals = None
        if self.top_ids is not None:
            k = self.top_ids.shape[1]
            ids = np.zeros((len(item.tokens), k), np.int64)
            vals = np.full((len(item.tokens), k), np.nan, np.float32)
            ids[pos], vals[pos] = self.top_ids[at : at + n], self.top_vals[at : at + n]
        return Scored(item, lp, ids, vals, bool(self.greedy[at : at + n].all()),
                      None if self.at_vals is None else self.at_vals[at : at + n], ranks)

    @staticmethod
    def join(parts) -> "Rows":
        """Runs of rows one after another (runs of no rows carry no top-K arrays)."""
        parts = [p for p in parts if p.chosen.size] or parts[:1]

        def cat(name):
            xs = [getattr(p, name) for p in parts]
            return None if xs[0] is None else np.concatenate(xs)
        return Rows(*(cat(n) for n in ("chosen", "greedy", "top_ids", "top_vals", "at_vals",
                                       "ranks")))


def score_rows(flat: mx.array, head, where: np.ndarray, targets: np.ndarray, top_k: int,
               logit_rows: int, asked: Optional[np.ndarray] = None) -> Rows:
    """The log-probabilities of `targets` given the hidden states `flat[where]`, a
    block of `logit_rows` positions at a time through the head (the logits of a
    block only are ever in memory); `asked`: per position, ids whose
    log-probabilities are wanted too."""
    at_vals = None if asked is None else np.zeros(asked.shape, np.float32)
    chosen = np.zeros(where.size, np.float32)
    greedy = np.zeros(where.size, bool)
    ranks = np.zeros(where.size, np.int64)
    k = max(0, int(top_k))
    top_ids = top_vals = None
    for s in range(0, where.size, logit_rows):
        part = slice(s, s + logit_rows)
        h = flat[mx.array(where[part].astype(np.uint32))]
        out = logprob_rows(head(h), targets[part], k, at_ids=None if asked is None else asked[part])
        chosen[part], greedy[part], ranks[part] = out.chosen, out.greedy, out.ranks
        if asked is not None:
            at_vals[part] = out.at_logprobs
        if top_ids is None:  # K is at most the vocabulary
            k = out.top_ids.shape[1]
            top_ids = np.zeros((where.size, k), np.int64)
            top_vals = np.zeros((where.size, k), np.float32)
        top_ids[part], top_vals[part] = out.top_ids, out.top_logprobs
    if not k:
        top_ids = top_vals = None
    return Rows(chosen, greedy, top_ids, top_vals, at_vals, ranks)


@dataclass
class PassStats:
    tokens: int  # rows x longest, pads included
    real_tokens: int
    expert_bytes_read: int
    union_bytes: int  # what reading each routed expert once would read
    passes: int = 1  # a text too long for one pass is scored across several (run_long)


def run_pass(model, items: Sequence[ScoreItem], top_k: int, logit_rows: int,
             attention_step: int, attention_tokens: int = None, at_ids=None):
    """(scores of `items`, PassStats) for one pass; `attention_tokens`: tokens per
    attention call of rows (default: the plan's chunk, `attention_step`); `at_ids`:
    per item, (its scored positions, J) token ids whose log-probabilities are
    wanted too (Scored.at_logprobs), or None."""
    rows, longest = len(items), max(len(it.tokens) for it in items)
    inputs = np.zeros((rows, longest), dtype=np.int32)
    real = np.zeros((rows, longest), dtype=bool)
    for r, it in enumerate(items):
        inputs[r, : len(it.tokens)] = it.tokens
        real[r, : len(it.tokens)] = True
    state = find_runtime(model)
    store = state.store if state is not None else None
    union = RouteUnion(state) if store is not None else None
    read0 = store.bytes_read if store is not None else 0
    body, head = body_and_head(model)
    # Texts within one attention call need no cache; longer ones go through each
    # layer's attention in the plan's chunks, over a cache that lives only for
    # this call.
    group = attention_tokens or attention_step
    cache = make_prompt_cache(model) if longest > group else None
    with ExitStack() as scope:
        if state is not None:
            scope.enter_context(state.real_tokens(real))
            scope.enter_context(union.observing)
        with row_tokens(model, group):
            hidden = body(mx.array(inputs), cache)
            mx.eval(hidden)
    del cache
    # Position p is predicted by the hidden state at p - 1.
    where, targets = [], []
    for r, it in enumerate(items):
        pos = np.nonzero(it.scored)[0]
        where.append(r * longest + pos - 1)
        targets.append(np.asarray(it.tokens, dtype=np.int64)[pos])
    asked = np.concatenate(at_ids) if at_ids is not None else None
    rows_out = score_rows(hidden.reshape(rows * longest, -1), head, np.concatenate(where),
                          np.concatenate(targets), top_k, logit_rows, asked)
    del hidden
    mx.clear_cache()
    results, at = [], 0
    for it in items:
        n = it.scored_tokens
        results.append(rows_out.scored(it, at, n))
        at += n
    stats = PassStats(tokens=rows * longest, real_tokens=int(real.sum()),
                      expert_bytes_read=(store.bytes_read - read0) if store is not None else 0,
                      union_bytes=union.bytes() if union is not None else 0)
    return results, stats


def run_long(model, item: ScoreItem, top_k: int, logit_rows: int, segment: int, at_ids=None):
    """(the scores of one text too long for a pass, its passes' PassStats): the text
    goes through the model a `segment` of tokens at a time over a cache kept
    across its passes, as a long prompt is prefilled (attention in the plan's
    chunks within each), and each pass's positions are scored as it finishes:
    position p by the hidden state at p - 1, so a pass [s, e) scores the positions
    s + 1 .. e (e is the next pass's first token). Only one pass's activations and
    the text's KV/state are held."""
    state = find_runtime(model)
    store = state.store if state is not None else None
    body, head = body_and_head(model)
    tokens = np.asarray(item.tokens, dtype=np.int64)
    scored = np.nonzero(item.scored)[0]
    cache = make_prompt_cache(model)
    parts, stats = [], PassStats(0, 0, 0, 0, passes=0)
    for start, end in chunk_bounds(len(tokens), segment):
        union = RouteUnion(state) if store is not None else None
        read0 = store.bytes_read if store is not None else 0
        with union.observing if union is not None else nullcontext():
            hidden = body(mx.array(tokens[None, start:end].astype(np.int32)), cache)
            mx.eval(hidden, [c.state for c in cache])
        mine = (scored > start) & (scored <= end)
        pos = scored[mine]
        asked = None if at_ids is None else at_ids[mine]
        parts.append(score_rows(hidden.reshape(end - start, -1), head, pos - 1 - start,
                                tokens[pos], top_k, logit_rows, asked))
        del hidden
        mx.clear_cache()
        stats.tokens += end - start
        stats.real_tokens += end - start
        stats.expert_bytes_read += (store.bytes_read - read0) if store is not None else 0
        stats.union_bytes += union.bytes() if union is not None else 0
        stats.passes += 1
    del cache
    mx.clear_cache()
    return Rows.join(parts).scored(item, 0, item.scored_tokens), stats
