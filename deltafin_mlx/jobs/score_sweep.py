"""One scoring pass: its texts through the model in one call, then their
log-probabilities.

The texts go in as a batch of right-padded rows with a causal mask, so no real
token sees a pad and each row's arithmetic is the row's alone. The model's decoder
stack runs once for the whole pass: every MoE layer routes all its real tokens at
once and reads each expert they use once (the streaming module is told which
positions are pads: `ExpertStore.token_mask`), and attention takes the rows in
groups (engine/chunked_attention), or, for texts longer than an attention chunk,
each row in chunks over a cache kept only for this call. The final hidden states
of the scored positions then go through the head a block of rows at a time
(score/logprobs.py), so vocab x tokens logits never sit in memory whole.
"""

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from deltafin_mlx.compat import body_and_head
from deltafin_mlx.engine.chunked_attention import row_tokens
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

    @property
    def logprob(self) -> float:
        return float(np.nansum(self.token_logprobs.astype(np.float64)))


class RouteUnion:
    """Per MoE layer, the distinct experts a pass's real tokens route to (the
    union bound on what it may read), through the expert store's `on_route` hook."""

    def __init__(self, store):
        self.store, self.previous = store, store.on_route
        self.experts = {}
        store.on_route = self

    def __call__(self, layer, routed):
        self.experts.setdefault(layer, set()).update(np.unique(routed).tolist())
        if self.previous is not None:
            self.previous(layer, routed)

    def bytes(self) -> int:
        banks = self.store.cache.banks
        return sum(len(e) * banks[layer].layout.record_size for layer, e in self.experts.items())

    def close(self):
        self.store.on_route = self.previous


@dataclass
class PassStats:
    tokens: int  # rows x longest, pads included
    real_tokens: int
    expert_bytes_read: int
    union_bytes: int  # what reading each routed expert once would read


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
    union = RouteUnion(store) if store is not None else None
    read0 = store.bytes_read if store is not None else 0
    body, head = body_and_head(model)
    # Texts within one attention call need no cache; longer ones go through each
    # layer's attention in the plan's chunks, over a cache that lives only for
    # this call.
    group = attention_tokens or attention_step
    cache = make_prompt_cache(model) if longest > group else None
    try:
        if store is not None:
            store.token_mask = real
        with row_tokens(model, group):
            hidden = body(mx.array(inputs), cache)
            mx.eval(hidden)
    finally:
        if store is not None:
            store.token_mask = None
        if union is not None:
            union.close()
    del cache
    # Position p is predicted by the hidden state at p - 1.
    targets, where = [], []
    for r, it in enumerate(items):
        pos = np.nonzero(it.scored)[0]
        where.append(r * longest + pos - 1)
        targets.append(np.asarray(it.tokens, dtype=np.int64)[pos])
    where = np.concatenate(where) if where else np.zeros(0, np.int64)
    targets = np.concatenate(targets) if targets else np.zeros(0, np.int64)
    asked = np.concatenate(at_ids) if at_ids is not None else None
    at_vals = None if asked is None else np.zeros(asked.shape, np.float32)
    flat = hidden.reshape(rows * longest, -1)
    chosen = np.zeros(where.size, np.float32)
    greedy = np.zeros(where.size, bool)
    k = max(0, int(top_k))
    top_ids = top_vals = None
    for s in range(0, where.size, logit_rows):
        part = slice(s, s + logit_rows)
        h = flat[mx.array(where[part].astype(np.uint32))]
        out = logprob_rows(head(h), targets[part], k,
                           at_ids=None if asked is None else asked[part])
        chosen[part], greedy[part] = out.chosen, out.greedy
        if asked is not None:
            at_vals[part] = out.at_logprobs
        if top_ids is None:  # K is at most the vocabulary
            k = out.top_ids.shape[1]
            top_ids = np.zeros((where.size, k), np.int64)
            top_vals = np.zeros((where.size, k), np.float32)
        top_ids[part], top_vals[part] = out.top_ids, out.top_logprobs
    del hidden, flat
    mx.clear_cache()
    results, at = [], 0
    for it in items:
        pos = np.nonzero(it.scored)[0]
        n = pos.size
        lp = np.full(len(it.tokens), np.nan, np.float32)
        lp[pos] = chosen[at : at + n]
        ids = vals = None
        if k:
            ids = np.zeros((len(it.tokens), k), np.int64)
            vals = np.full((len(it.tokens), k), np.nan, np.float32)
            ids[pos], vals[pos] = top_ids[at : at + n], top_vals[at : at + n]
        results.append(Scored(it, lp, ids, vals, bool(greedy[at : at + n].all()),
                              None if at_vals is None else at_vals[at : at + n]))
        at += n
    stats = PassStats(tokens=rows * longest, real_tokens=int(real.sum()),
                      expert_bytes_read=(store.bytes_read - read0) if store is not None else 0,
                      union_bytes=union.bytes() if union is not None else 0)
    return results, stats
