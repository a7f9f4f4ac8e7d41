"""Log-probabilities and the top-K distribution of a block of logits: the one
function `score`, `batch --top-logprobs`, `run --json --top-logprobs` (and a
server) use, so the same tokens get the same values wherever they are asked for.

Log-softmax is taken in float32 (`logits - logsumexp(logits)`, as mlx-lm's
generation does); the top K are ordered best first, ties by the lower token id, so
the first of them is `argmax` (which also takes the first of equal maxima).
"""

from dataclasses import dataclass
from typing import List, Optional

import mlx.core as mx
import numpy as np


@dataclass
class LogprobRows:
    """Per row (position) of a block: the target token's log-probability, whether
    the target is the argmax, its rank, and the top K as ids and log-probabilities."""

    chosen: Optional[np.ndarray]  # (N,) float32, None without targets
    greedy: Optional[np.ndarray]  # (N,) bool, None without targets
    top_ids: np.ndarray  # (N, K) int64, best first
    top_logprobs: np.ndarray  # (N, K) float32
    at_logprobs: Optional[np.ndarray] = None  # (N, J) float32: of the ids asked for
    # (N,) int64, None without targets: how many tokens are at least as likely as the
    # target (1 for the argmax; vLLM's rank, which counts ties against it)
    ranks: Optional[np.ndarray] = None


def log_softmax(logits: mx.array) -> mx.array:
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def logprob_rows(logits: mx.array, targets=None, top_k: int = 0,
                 normalized: bool = False, at_ids=None) -> LogprobRows:
    """`logits` (N, vocab); `targets` (N,) token ids or None; `normalized`: the
    rows are already log-probabilities (mlx-lm's generation hands those out);
    `at_ids` (N, J) token ids whose log-probabilities are wanted too (another
    model's top K, for a KL divergence), or None."""
    lp = logits.astype(mx.float32) if normalized else log_softmax(logits)
    best = mx.argmax(lp, axis=-1)
    outs = [best]
    if targets is not None:
        t = mx.array(np.asarray(targets, dtype=np.int64).astype(np.int32))
        chosen = mx.take_along_axis(lp, t[:, None], axis=-1)
        outs += [chosen[:, 0], (lp >= chosen).sum(axis=-1)]
    k = max(0, min(int(top_k), lp.shape[-1]))
    if k:
        ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        outs += [ids, mx.take_along_axis(lp, ids, axis=-1)]
    at = None
    if at_ids is not None:
        at = mx.take_along_axis(lp, mx.array(np.asarray(at_ids).astype(np.int32)), axis=-1)
        outs.append(at)
    mx.eval(outs)
    at_logprobs = np.array(outs.pop()).astype(np.float32) if at is not None else None
    best = np.array(best).astype(np.int64)
    chosen = greedy = ranks = None
    if targets is not None:
        chosen = np.array(outs[1]).astype(np.float32)
        ranks = np.array(outs[2]).astype(np.int64)
        greedy = best == np.asarray(targets, dtype=np.int64)
    top_ids = np.zeros((lp.shape[0], 0), np.int64)
    top_vals = np.zeros((lp.shape[0], 0), np.float32)
    if k:
        top_ids = np.array(outs[-2]).astype(np.int64)
        top_vals = np.array(outs[-1]).astype(np.float32)
        order = np.lexsort((top_ids, -top_vals), axis=-1)  # best first, ties by id
        top_ids = np.take_along_axis(top_ids, order, axis=-1)
        top_vals = np.take_along_axis(top_vals, order, axis=-1)
    return LogprobRows(chosen, greedy, top_ids, top_vals, at_logprobs, ranks)


def tail_logprob(top_logprobs: np.ndarray) -> np.ndarray:
    """log(1 - the mass of the top K), per row, in float32, floored at log(1e-30):
    the one tail rule of score's outputs and the KL references, for the base's rows
    and the ones compared with them alike, so a model against its own reference
    differs by nothing."""
    top = np.exp(top_logprobs.astype(np.float64)).sum(axis=-1)
    return np.log(np.maximum(1.0 - top, 1e-30)).astype(np.float32)


def top_pairs(ids: np.ndarray, values: np.ndarray) -> List[list]:
    """One row's top K as JSON's `[[id, logprob], ...]`, best first."""
    return [[int(i), float(v)] for i, v in zip(ids, values)]


def top_logprobs(logprobs: mx.array, k: int) -> List[list]:
    """The top K `[id, logprob]` pairs of one generated token's log-probabilities
    (a (vocab,) row, as mlx-lm's generation responses carry)."""
    rows = logprob_rows(logprobs.reshape(1, -1), top_k=k, normalized=True)
    return top_pairs(rows.top_ids[0], rows.top_logprobs[0])
