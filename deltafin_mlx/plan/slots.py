"""The geometry of the expert cache's slots: bytes per slot, how many slots one set
of MLX arrays can hold, how a larger pool is cut into chunks, and when the pool is
split into per-layer partitions. Arithmetic only: the planner sizes the pool with
it and the cache allocates exactly what it says.
"""

from typing import Optional

import mlx.core as mx
import numpy as np

from deltafin_mlx.format.bank import ALIGN
from deltafin_mlx.format.dtypes import in_memory

# MLX array dimensions are int32: no axis, including the flat one an aligned
# allocation slices, may hold 2**31 elements or more.
MAX_ELEMENTS = 2**31 - 1 - ALIGN


def slot_bytes(sections, activation_dtype: mx.Dtype) -> int:
    """Memory one slot takes (scales may be wider in memory than on disk)."""
    return sum(int(np.prod(s.shape)) * in_memory(s.dtype, activation_dtype).size for s in sections)


def max_slots(sections, activation_dtype: mx.Dtype) -> int:
    """The most slots one set of slot arrays can have (see MAX_ELEMENTS)."""
    return min(MAX_ELEMENTS // int(np.prod(s.shape)) for s in sections)


def layer_partition(num_slots: int, num_layers: int, experts_per_token: int,
                    num_experts: int) -> Optional[int]:
    """Slots per layer where the pool is split into equal per-layer partitions,
    else None (one pool shared by every layer). A pool is partitioned once every
    layer has room for one token's experts, so that a layer's misses never evict
    the experts another layer will reuse for the next token."""
    if num_slots >= num_layers * experts_per_token and num_slots // num_layers <= num_experts:
        return min(num_experts, num_slots // num_layers)
    return None


def pool_chunks(num_slots: int, num_layers: int, experts_per_token: int, num_experts: int,
                chunk_limit: int, groups=None):
    """How a pool of `num_slots` is split into sets of slot arrays ("chunks") of at
    most `chunk_limit` slots each: a list of (first slot, slots). One chunk when it
    fits. Otherwise the pool is partitioned by layer, and chunks are cut at
    partition boundaries, so that every layer's experts live in one chunk and its
    computation is one mlx-lm call over that chunk, as with a single chunk.
    `groups`: where layers are laid out differently (mlx-lm's mixed_* recipes), the
    pool is partitioned, and each group of layers laid out alike, (layers, its chunk
    limit) in pool order, has chunks of its own.
    Raises ValueError where that is impossible (see `pool_limit`)."""
    if groups is None:
        if num_slots <= chunk_limit:
            return [(0, num_slots)]
        limit = pool_limit(num_layers, experts_per_token, num_experts, chunk_limit)
        if num_slots > limit:
            raise ValueError(f"an expert pool of {num_slots} slots cannot be allocated: at "
                             f"most {limit}")
        groups = [(num_layers, chunk_limit)]
    share = layer_partition(num_slots, num_layers, experts_per_token, num_experts)
    if share is None:
        raise ValueError(f"{num_slots} slots are below one token's experts in each of the "
                         f"{num_layers} layers, which layers laid out differently need")
    chunks, start = [], 0
    for layers, limit in groups:
        per_chunk = limit // share
        for first in range(0, layers, per_chunk):
            n = min(per_chunk, layers - first) * share
            chunks.append((start, n))
            start += n
    return chunks


def pool_limit(num_layers: int, experts_per_token: int, num_experts: int, chunk_limit: int) -> int:
    """The most slots a pool can have. A pool above one chunk must be partitioned
    by layer (at least one token's experts per layer), each partition within one
    chunk: up to every expert of the model. Where a partitioned pool would not fit
    one chunk's partition (a layer's share over the limit) or the pool is below
    the partition threshold, one chunk is the limit."""
    if num_layers * experts_per_token > chunk_limit + 1:
        return chunk_limit  # pools between the limit and the threshold cannot be split
    return num_layers * min(num_experts, chunk_limit)
