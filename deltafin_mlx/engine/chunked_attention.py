"""Attention in chunks within a layer, so that a whole prefill pass can go through
each decoder layer before the next.

A pass hands the model all of its prompt tokens in one call: every MoE layer then
routes all of them at once and reads each expert they use once, instead of once per
chunk. What grows with the tokens of one call is attention (scores against the
whole context, K3's KDA recurrence keeping per-token state copies on the CPU), so
each decoder layer's attention module takes a long call in chunks of the plan's
`prefill_step` tokens, in order, each with the cache as the previous chunk left
it — exactly the calls a chunked prefill would make, with the same masks — and
hands back their outputs joined. Everything else in a layer works token by token.
A call of many texts without a cache (a scoring pass) is attended a group of rows
at a time instead, each group at most a chunk's tokens.
"""

import copy
import inspect
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn


def chunk_bounds(tokens: int, step: int):
    """(start, end) of each chunk of at most `step` tokens, the last at least two
    tokens long (a one-token call takes a different mask path in mlx-lm: none)."""
    bounds = [(s, min(s + step, tokens)) for s in range(0, tokens, step)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        (s, _), _ = bounds[-2], bounds.pop()
        bounds[-1] = (s, tokens)
    return bounds


def chunk_mask(mask, start: int, end: int, tokens: int, linear: bool, cache=None):
    """The mask mlx-lm would have made for the chunk [start, end) of a call of
    `tokens` tokens: "causal" and None stay as they are; an attention mask array
    (..., tokens, offset + tokens) keeps the chunk's rows and the keys up to its
    end, from the first key `cache` still holds when the chunk comes; a recurrent
    layer's padding mask (B, tokens) keeps the chunk's columns."""
    if mask is None or isinstance(mask, str):
        return mask
    if linear:
        return mask[..., start:end]
    offset = mask.shape[-1] - tokens
    # A sliding window's cache (mlx-lm's RotatingKVCache, batched or not) keeps its
    # last max_size - 1 keys before a call of several tokens; its own masks start there.
    first = max(0, offset + start - cache.max_size + 1) if hasattr(cache, "max_size") else 0
    return mask[..., start:end, first : offset + end]


def chunkable(module) -> bool:
    """Whether `module` is called as mlx-lm's attention modules mostly are,
    `(x, mask, cache)` with a cache that positions each call itself, which is
    what taking a call in chunks relies on, and nothing more. Others run whole, as
    mlx-lm runs them: deepseek_v41's (keyword-only positions, its own layer cache),
    gemma4's and hunyuan's (they take and hand back keys shared between layers)."""
    if not isinstance(module, nn.Module):
        return False
    try:
        params = list(inspect.signature(type(module).__call__).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return (len(params) == 3 and all(p.kind in positional for p in params)
            and [p.name for p in params[1:]] == ["mask", "cache"])


def chunk_attention(module, step: int, linear: bool = False):
    """Make `module` (a decoder layer's attention) take calls longer than `step`
    tokens in chunks. The instance gets a subclass, so no parameter is renamed."""
    base = type(module)

    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        tokens = x.shape[1]
        group = self._row_tokens or step
        if cache is None and x.shape[0] > 1 and x.shape[0] * tokens > group:
            return _by_rows(self, base, max(1, group // tokens), x, mask, *args, **kwargs)
        if tokens <= step or cache is None:
            return base.__call__(self, x, mask, cache, *args, **kwargs)
        if self._row_tokens:  # a scoring pass: its cache never fills
            return _rows_over_chunks(self, base, step, max(1, group // step), x, mask, cache,
                                     linear, *args, **kwargs)
        outs = []
        for start, end in chunk_bounds(tokens, step):
            m = chunk_mask(mask, start, end, tokens, linear, cache)
            out = base.__call__(self, x[:, start:end], m, cache, *args, **kwargs)
            # Evaluated chunk by chunk, as a chunked prefill evaluates its calls: the
            # chunk's scores are freed before the next chunk's are made, and MLX's
            # cache of freed buffers (sized by a context that grows each chunk) is
            # emptied as mlx-lm empties it after each prefill call.
            mx.eval(out, cache.state)
            mx.clear_cache()
            outs.append(out)
        return mx.concatenate(outs, axis=1)

    module.__class__ = type(f"Chunked{base.__name__}", (base,), {"__call__": __call__})
    module._row_tokens = None  # a scoring pass's tokens per attention call (row_tokens)


@contextmanager
def row_tokens(model, tokens: int):
    """While it lasts, calls of many texts without a cache attend groups of rows
    of at most `tokens` tokens (a scoring pass sizes them: plan/scoring.py), not
    of one chunk's."""
    modules = [m for _, m in model.named_modules() if hasattr(m, "_row_tokens")]
    for m in modules:
        m._row_tokens = tokens
    try:
        yield
    finally:
        for m in modules:
            m._row_tokens = None


def _rows_over_chunks(module, base, step: int, rows: int, x, mask, cache, linear: bool,
                      *args, **kwargs):
    """A scoring pass of texts longer than an attention call (right-padded rows;
    the pass keeps nothing, so its cache stays empty): `rows` rows at a time, each
    group along its texts in chunks of `step` over a copy of the empty cache of
    its own, dropped when the group is done. So a pass may hold as many rows as
    its tokens allow (plan/scoring.py) and one layer's KV of one group at a time,
    while one attention call holds at most a group's chunk."""
    outs = []
    tokens = x.shape[1]
    for first in range(0, x.shape[0], rows):
        part = slice(first, first + rows)
        own = copy.deepcopy(cache)
        pieces = []
        for start, end in chunk_bounds(tokens, step):
            m = chunk_mask(mask, start, end, tokens, linear, own)
            if isinstance(m, mx.array) and m.ndim >= 3 and m.shape[0] == x.shape[0]:
                m = m[part]  # a mask with a row per text
            elif isinstance(m, mx.array) and linear and m.ndim == 2 and m.shape[0] == x.shape[0]:
                m = m[part]
            out = base.__call__(module, x[part, start:end], m, own, *args, **kwargs)
            mx.eval(out, own.state)
            pieces.append(out)
        outs.append(mx.concatenate(pieces, axis=1))
        del own
        mx.clear_cache()
    return mx.concatenate(outs, axis=0)


def _by_rows(module, base, rows: int, x, mask, *args, **kwargs):
    """A call of many texts with no cache (a scoring pass: each row a text of at
    most a chunk's tokens, right-padded) attends `rows` rows at a time, so its
    scores are at most a chunk's. Rows never attend to each other, so the result is
    the same; the mask (the same for every row) passes as it is."""
    outs = []
    for start in range(0, x.shape[0], rows):
        out = base.__call__(module, x[start : start + rows], mask, None, *args, **kwargs)
        mx.eval(out)
        outs.append(out)
    mx.clear_cache()
    return mx.concatenate(outs, axis=0)
