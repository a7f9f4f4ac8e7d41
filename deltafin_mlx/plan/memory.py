"""The memory plan: from a model's inventory and a budget, what is pinned in memory,
what is streamed, and how many expert slots remain.

The budget covers the KV cache and recurrent state at the planned context, working
buffers, the trunk's resident part, the buffers streamed trunk layers pass through,
and the expert cache. Use per byte decides: a trunk layer is used every token, an
expert only when routed, and of the embedding table only a row per token. So:

* the floor streams every trunk layer that has a twin (layers of the same shape
  share two buffers, read one layer ahead), reads embedding rows on demand, and
  holds just the experts one token needs in one layer;
* above the floor, trunk layers are pinned first, then the rest becomes expert
  cache, then the embedding table is pinned if everything else fits.
"""

import functools
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List

import mlx.core as mx

from deltafin_mlx.plan.slots import max_slots as max_chunk_slots
from deltafin_mlx.plan.slots import pool_limit
from deltafin_mlx.model.config import max_context, text_config
from deltafin_mlx.model.modules import MoeShape
from deltafin_mlx.units import human_bytes, parse_size
from deltafin_mlx.plan.footprint import Inventory
from deltafin_mlx.errors import BudgetError

WORKING_BYTES = 16 << 20  # activations, router outputs and read bookkeeping of small models
# What the process holds beside MLX's arrays once a model is loaded (mlx-lm's model
# code, the tokenizer, the interpreter's heap): within the working buffers while
# decoding, beside a pass, which takes them for its activations (docs/PERFORMANCE.md,
# "One size of a pass").
PROCESS_BYTES = 12 << 20
# MLX keeps freed buffers for reuse; unbounded, what it keeps grows with every new
# shape (a server's batches of different sizes) and lies outside the plan. A
# quarter of the working buffers holds a decode step's (docs/PERFORMANCE.md,
# "Serving memory").
BUFFER_CACHE_SHARE = 4


HEADROOM = 0.85  # of available memory, for the default budget
RING = 2  # buffers per streamed layer shape: one in use, one being read
PREFILL_STEPS = (512, 256, 128, 64, 32, 16)  # prompt tokens per forward pass, largest first
PREFILL_SHARE = 16  # up to 1/16 of the budget may hold a prefill chunk's activations
MAX_PASS = 65536  # tokens one pass may take: past this its bookkeeping outweighs a sweep saved
# During a pass the expert cache gives its slots back and the pass reads into this
# many groups of one token's experts: one computing, the next being read
# (engine/pass_pool.py).
PASS_GROUPS = 2



def available_memory() -> int:
    """Memory this process can use now: MemAvailable, capped by a cgroup limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = physical_memory() or 8 << 30
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file) as f:
                raw = f.read().strip()
            if raw == "max":
                continue
            limit = int(raw)
            with open(usage_file) as f:
                usage = int(f.read().strip())
            if limit < 1 << 60:
                avail = min(avail, max(limit - usage, 0))
        except (OSError, ValueError):
            continue
    return avail


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def device_info() -> dict:
    """MLX's description of the device (the seam tests stand a Mac's in through)."""
    try:
        return dict(mx.device_info())
    except Exception:  # an MLX without device_info: nothing more is known
        return {}


def working_set() -> int:
    """What the GPU can keep resident, where the device says (Metal's recommended
    working set), else 0. A plan sized past it pages: peers lost 8x that way."""
    return int(device_info().get("max_recommended_working_set_size") or 0)


def default_budget() -> int:
    """Of the memory available now, HEADROOM; on Metal, at most its working set."""
    budget = int(available_memory() * HEADROOM)
    return min(budget, working_set()) if working_set() else budget


@functools.lru_cache(maxsize=None)  # one line per budget, not one per plan made with it
def warn_beyond_memory(budget: int) -> int:
    """`budget`, after one line on stderr where it is more than the machine's memory
    (a plan past it swaps, or the system kills the process)."""
    total = physical_memory()
    if total and budget > total:
        print(f"[deltafin] warning: the memory budget {human_bytes(budget)} is more than this "
              f"machine's memory ({human_bytes(total)}): past it the system swaps or kills "
              "the process", file=sys.stderr)
    return budget


def state_bytes(config: dict, context: int, activation_dtype: mx.Dtype) -> int:
    """KV cache and recurrent state for one sequence of `context` tokens."""
    return sum(sequence_state(config, context, activation_dtype))


def sequence_state(config: dict, context: int, activation_dtype: mx.Dtype):
    """(recurrent, KV) bytes of one sequence of `context` tokens: the recurrent part
    (K3's KDA layers: a head_dim x head_dim float32 matrix per head, plus the short
    convolution's window) does not grow with context; the KV cache does."""
    tc = text_config(config)
    layers = tc.get("num_hidden_layers", 0)
    size = activation_dtype.size
    lin = tc.get("linear_attn_config") or {}
    kda = set(lin.get("kda_layers", []))
    recurrent = kv = 0
    for i in range(layers):
        if (i + 1) in kda:
            heads, hd = lin["num_heads"], lin["head_dim"]
            conv = (lin.get("short_conv_kernel_size", 4) - 1) * 3 * heads * hd * size
            recurrent += heads * hd * hd * 4 + conv
        elif tc.get("kv_lora_rank"):
            kv += context * (tc["kv_lora_rank"] + tc.get("qk_rope_head_dim", 0)) * size
        else:
            heads = tc.get("num_key_value_heads") or tc.get("num_attention_heads", 1)
            hd = tc.get("head_dim") or tc["hidden_size"] // tc.get("num_attention_heads", 1)
            kv += 2 * context * heads * hd * size
    return recurrent, kv


def check_context(context, config: dict):
    """The one rule for a context: a whole number of tokens, at least one, at most
    the model's `max_position_embeddings`."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise BudgetError(f"--context must be at least 1 token (got {context!r})")
    limit = max_context(config)
    if isinstance(limit, int) and context > limit:
        raise BudgetError(f"--context {context:,} is beyond this model's maximum of {limit:,} "
                          "tokens (max_position_embeddings)")


def round_context(tokens: int, limit=None, step: int = 256) -> int:
    """The context to reserve for `tokens` tokens: rounded up to a multiple of
    `step`, but not past the model's maximum `limit` when `tokens` itself fits."""
    rounded = max(step, -(-tokens // step) * step)
    return min(rounded, limit) if limit and tokens <= limit else rounded


def prefill_bytes(config: dict, moe: MoeShape, step: int, context: int,
                  activation_dtype: mx.Dtype) -> int:
    """Activations of one forward pass over `step` prompt tokens at `context`.

    Per token of the chunk: hidden-sized intermediates and the routed experts'
    inner activations. Planning for MLX's CPU backend (float32 activations) adds
    what its reference paths keep alive: the attention scores against the whole
    context (float32, a few copies), the linear-attention (KDA) recurrence that
    mlx-lm runs as a loop over tokens (`gated_delta_ops`, copies of the state per
    token), and intermediates that grow with the number of layers. The CPU terms
    are an upper bound fitted to measured peak RSS of synthetic K3 layouts of 4 and
    8 layers (tests/engine/test_prefill_memory.py), not a model of MLX's allocator; on a
    GPU (fused attention and recurrence kernels) only the first terms apply.
    """
    tc = text_config(config)
    size = activation_dtype.size
    hidden = tc.get("hidden_size", 0)
    k = moe.experts_per_token
    inner = tc.get("moe_intermediate_size") or 0  # hunyuan's may be one per layer
    expert = max(*(inner if isinstance(inner, list) else [inner]),
                 tc.get("routed_expert_hidden_size") or 0)
    dense = tc.get("intermediate_size") or 0
    per_token = 16 * hidden * size + 4 * k * expert * size + 4 * dense * size
    if activation_dtype == mx.float32:  # the CPU backend's reference paths
        scores = 4 * 4 * tc.get("num_attention_heads", 1) * context
        lin = tc.get("linear_attn_config") or {}
        recurrent = 8 * 4 * lin["num_heads"] * lin["head_dim"] ** 2 if lin.get("num_heads") else 0
        layers = 32 * tc.get("num_hidden_layers", 1) * hidden * size
        per_token += scores + recurrent + layers
    return step * per_token


def pass_bytes_per_token(config: dict, moe: MoeShape, activation_dtype: mx.Dtype) -> int:
    """What each token of a prefill pass holds while the pass goes through a layer
    (the whole pass goes through each layer before the next, engine/streaming_moe):
    its hidden state and the layer's hidden-sized intermediates, the router's
    scores, and the routed experts' outputs (k per token, written into one buffer,
    then weighted by their scores), what the block computes beside them (shared
    experts), plus K3's attention-residual history."""
    tc = text_config(config)
    size = activation_dtype.size
    hidden = tc.get("hidden_size", 0)
    k = moe.experts_per_token
    blocks = 0
    if tc.get("attn_res_block_size"):
        blocks = -(-tc.get("num_hidden_layers", 1) // tc["attn_res_block_size"])
    return size * (3 * k * hidden + (8 + blocks) * hidden + moe.shared_width) \
        + 2 * 4 * moe.num_experts


def pass_pool_slots(cache_slots: int, k: int) -> int:
    """The slots a pass reads its experts into while the cache has given its own
    back: PASS_GROUPS groups of one token's experts where the cache had room for
    them, else one (the floor's), never more than the cache had."""
    groups = PASS_GROUPS if cache_slots >= PASS_GROUPS * k else 1
    return max(1, min(groups * k, cache_slots))


def kept_pass_tokens(config: dict, moe: MoeShape, step: int, context: int,
                     activation_dtype: mx.Dtype, allowance: int) -> int:
    """Prompt tokens the prefill allowance holds beside one chunk's activations: what
    the plan reserves for a pass beside the expert cache (at least one chunk)."""
    room = allowance - prefill_bytes(config, moe, step, context, activation_dtype)
    n = room // max(pass_bytes_per_token(config, moe, activation_dtype), 1)
    return int(max(step, min(n, MAX_PASS, context)))


def pass_tokens(plan: "MemoryPlan", held: int, token_bytes: int, keep_cache: bool = False) -> int:
    """The one size of a pass, a prefill's or a scoring one's: the tokens, at
    `token_bytes` each, of what the budget holds beyond what stays resident through
    the pass (`MemoryPlan.pass_room`) and `held`, what the pass holds besides its
    tokens. At least one attention chunk, at most MAX_PASS."""
    n = (plan.pass_room(keep_cache) - held) // max(token_bytes, 1)
    return int(max(plan.prefill_step, min(n, MAX_PASS)))


def prefill_pass_tokens(config: dict, plan: "MemoryPlan", activation_dtype: mx.Dtype,
                        keep_cache: bool = False) -> int:
    """Prompt tokens per prefill pass: the pass holds the KV/state its prompt keeps
    (the plan's, at its context) and one attention chunk's activations; at most the
    context."""
    held = plan.state_bytes + prefill_bytes(config, plan.moe, plan.prefill_step, plan.context,
                                            activation_dtype)
    tokens = pass_tokens(plan, held, pass_bytes_per_token(config, plan.moe, activation_dtype),
                         keep_cache)
    return min(tokens, max(plan.context, plan.prefill_step))


def min_prefill_bytes(config: dict, moe: MoeShape, context: int,
                      activation_dtype: mx.Dtype) -> int:
    """What the smallest prefill chunk and pass need beyond WORKING_BYTES (part of
    the floor)."""
    step = PREFILL_STEPS[-1]
    need = (prefill_bytes(config, moe, step, context, activation_dtype)
            + step * pass_bytes_per_token(config, moe, activation_dtype))
    return max(0, need - WORKING_BYTES)


def prefill_step(config: dict, moe: MoeShape, context: int, activation_dtype: mx.Dtype,
                 allowance: int) -> int:
    """The largest prefill chunk whose activations fit in `allowance` (the smallest
    when none does: the floor holds its activations)."""
    for step in PREFILL_STEPS:
        if prefill_bytes(config, moe, step, context, activation_dtype) <= allowance:
            return step
    return PREFILL_STEPS[-1]


@dataclass
class MemoryPlan:
    budget: int
    context: int
    state_bytes: int
    working_bytes: int
    pinned: List[str]  # trunk units held in memory
    streamed: List[str]  # trunk units read into shared buffers each token
    ring_bytes: int  # those buffers
    embed_on_demand: bool
    embed_bytes: int
    resident_bytes: int  # pinned units (less the embedding table when on demand)
    slot_bytes: int  # one expert in memory
    slots: int  # expert cache slots, shared by all MoE layers
    floor: int  # the smallest budget that runs
    experts_per_token: int
    num_experts: int
    moe_layers: int
    streamed_read_bytes: int  # trunk bytes read per token
    prefill_step: int = PREFILL_STEPS[-1]  # attention chunk: prompt tokens per attention call
    prefill_bytes: int = 0  # prefill activations beyond the working buffers (chunk + pass)
    prefill_pass: int = PREFILL_STEPS[-1]  # prompt tokens per pass through the layers (pass_tokens)
    notes: List[str] = field(default_factory=list)
    floor_parts: Dict[str, int] = field(default_factory=dict)  # what the floor is made of; sums to it
    sequences: int = 1  # sequences decoded together; state_bytes covers all of them
    sequence_recurrent_bytes: int = 0  # one sequence's recurrent state
    sequence_kv_bytes: int = 0  # one sequence's KV cache at `context`
    # A pass's expert slots while the cache is given back (0: the cache holds every
    # expert and a pass reads nothing), and the cache bytes the pass gets beyond them.
    pass_slots: int = 0
    pass_released_bytes: int = 0
    shared_width: int = 0  # MoeShape's
    # Tokens a pass holds beside the cache: a call of no more keeps the cache (its
    # experts serve the pass and decoding after it, a warm start's among them).
    pass_kept_tokens: int = PREFILL_STEPS[-1]
    # Pinned decoder layers a pass that gives the cache back streams too (each is
    # used once per pass), and the bytes that gives the pass: their memory less
    # the buffers they stream through (engine/trunk_pass.py).
    pass_trunk: List[str] = field(default_factory=list)
    pass_trunk_bytes: int = 0

    @property
    def moe(self) -> MoeShape:
        return MoeShape(self.experts_per_token, self.num_experts, self.shared_width)

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def buffer_cache_bytes(self) -> int:
        """Freed buffers MLX may keep for reuse (mx.set_cache_limit): counted in the
        working buffers."""
        return self.working_bytes // BUFFER_CACHE_SHARE

    def pass_room(self, keep_cache: bool = False) -> int:
        """What a pass may take of the budget: all of it but what stays resident
        through the pass (the trunk as the pass holds it, the reader's records, the
        freed buffers MLX keeps, the process's own memory, and the expert cache, or
        in its place the pass's own groups of experts)."""
        resident = (self.resident_bytes + self.ring_bytes + self.working_bytes - WORKING_BYTES
                    + self.buffer_cache_bytes + PROCESS_BYTES)
        if self.pass_slots and not keep_cache:
            return self.budget - resident - self.pass_slots * self.slot_bytes + self.pass_trunk_bytes
        return self.budget - resident - self.cache_bytes

    @property
    def cache_fraction(self) -> float:
        """The share of all experts (of all MoE layers) the cache holds."""
        return self.slots / (self.num_experts * self.moe_layers)

    @property
    def used_bytes(self) -> int:
        return (self.state_bytes + self.working_bytes + self.prefill_bytes + self.resident_bytes
                + self.ring_bytes + self.cache_bytes)


def _trunk_layout(inv: Inventory, streamed: set, embed_on_demand: bool):
    """(resident bytes, ring bytes, bytes read per token) for a choice of streamed units."""
    by_sig = defaultdict(list)
    for key in streamed:
        by_sig[inv.units[key].signature].append(key)
    resident = sum(u.memory_bytes for k, u in inv.units.items() if k not in streamed)
    if embed_on_demand:
        resident -= inv.embed_bytes
    ring = 0
    read = 0
    for keys in by_sig.values():
        size = inv.units[keys[0]].memory_bytes
        ring += min(RING, len(keys)) * size
        if len(keys) > RING:
            read += sum(inv.units[k].disk_bytes for k in keys)
    return resident, ring, read


def streamable_units(inv: Inventory) -> List[str]:
    """Decoder layers whose shape another layer shares: streaming them saves memory."""
    count = defaultdict(int)
    for key, u in inv.units.items():
        if key != "globals":
            count[u.signature] += 1
    keys = [k for k, u in inv.units.items() if k != "globals" and count[u.signature] > RING]
    return sorted(keys, key=int)


def passable_units(inv: Inventory, pinned: List[str]) -> List[str]:
    """Of the `pinned` streamable layers, those whose shape more than RING of them
    share: streaming them through RING buffers frees memory."""
    by_sig = defaultdict(list)
    for key in pinned:
        by_sig[inv.units[key].signature].append(key)
    return sorted((key for keys in by_sig.values() if len(keys) > RING for key in keys), key=int)


MAX_SEQUENCES = 32  # BatchGenerator's default completion batch size


def plan_memory(inv: Inventory, budget, context: int = 4096, reader_threads: int = 1,
                max_slots: int = None, stream_trunk: bool = True,
                sequences=1, max_sequences: int = MAX_SEQUENCES) -> MemoryPlan:
    """`sequences`: how many sequences are decoded together (a batch job), each with
    its own KV/recurrent state; "auto" picks it with `choose_sequences`, at most
    `max_sequences` (a job with 3 requests left reserves state for 3, not 32)."""
    budget = default_budget() if budget is None else warn_beyond_memory(parse_size(budget))
    check_context(context, inv.config)
    k = inv.experts_per_token
    one = inv.slot_bytes
    all_experts = inv.num_experts * len(inv.moe_layers)
    # Experts laid out differently from layer to layer live in a pool partitioned
    # by layer (engine/cache.py): every layer has room for one token's experts.
    per = len(inv.moe_layers) if inv.layer_sections else 1
    recurrent, kv = sequence_state(inv.config, context, inv.activation_dtype)
    if sequences == "auto":
        sequences = choose_sequences(inv, budget, context, reader_threads, stream_trunk,
                                     cap=max(1, int(max_sequences)))
    if int(sequences) < 1:
        raise BudgetError(f"the number of sequences must be at least 1 (got {sequences})")
    sequences = int(sequences)
    state = sequences * (recurrent + kv)
    working = WORKING_BYTES + (reader_threads + 1) * inv.record_size
    fixed = state + working

    candidates = streamable_units(inv) if stream_trunk else []
    on_demand_ok = stream_trunk and not inv.embed_tied and inv.embed_bytes > 0
    res, ring, _ = _trunk_layout(inv, set(candidates), on_demand_ok)
    min_prefill = min_prefill_bytes(inv.config, inv.moe, context, inv.activation_dtype)
    # The smallest prefill chunk's activations count as working buffers.
    floor_parts = {"resident trunk": res, "streamed-layer buffers": ring, "KV/state": state,
                   "working buffers": working + min_prefill,
                   ("one token's experts in each layer" if per > 1 else "one token's experts"):
                   k * per * one}
    floor = sum(floor_parts.values())
    if budget < floor:
        prefill = (f", prefill activations {min_prefill / 1e9:.3f} GB"
                   f" beyond working buffers" if min_prefill else "")
        raise BudgetError(
            f"memory budget {human_bytes(budget)} is below this model's floor of "
            f"{human_bytes(floor)} ({floor} bytes = "
            + " + ".join(f"{what} {human_bytes(n)}" for what, n in floor_parts.items())
            + f"; KV/state at {context} tokens of context"
            + (f" x {sequences} sequences" if sequences > 1 else "")
            + f", {k} experts per token{prefill}); a smaller --context lowers it"
        )

    # Prefill activations, in WORKING_BYTES (and the floor's share) or up to 1/16 of
    # a larger budget: the largest attention chunk that fits, then as many tokens
    # per pass as the rest holds (a pass reads each expert its tokens use once).
    least = WORKING_BYTES + min_prefill
    allowance = max(least, min(budget // PREFILL_SHARE, budget - floor + least))
    # Half of it bounds the attention chunk, the rest holds the pass: a pass reads
    # each expert once, a bigger chunk only saves calls.
    step = prefill_step(inv.config, inv.moe, context, inv.activation_dtype, allowance // 2)
    passing = kept_pass_tokens(inv.config, inv.moe, step, context, inv.activation_dtype,
                               allowance)
    extra = max(0, prefill_bytes(inv.config, inv.moe, step, context, inv.activation_dtype)
                + passing * pass_bytes_per_token(inv.config, inv.moe, inv.activation_dtype)
                - WORKING_BYTES)
    fixed += extra

    # Pin trunk layers while they fit (each saves its size in reads per token),
    # keeping room for the experts one token needs.
    streamed = list(candidates)
    while streamed:
        trial = set(streamed[:-1])
        r, g, _ = _trunk_layout(inv, trial, on_demand_ok)
        if fixed + r + g + k * per * one > budget:
            break
        streamed.pop()
    res, ring, read = _trunk_layout(inv, set(streamed), on_demand_ok)
    spare = budget - (fixed + res + ring)
    limit = pool_limit(len(inv.moe_layers), k, inv.num_experts, min(
        max_chunk_slots(s, inv.activation_dtype)
        for s in [inv.sections, *inv.layer_sections.values()]))
    slots = min(all_experts, spare // one, limit)
    if max_slots is not None:
        slots = min(slots, max_slots)
    if per > 1:  # equal partitions
        slots = slots // per * per
        if slots < k * per:
            raise BudgetError(("memory budget: " if max_slots is None else
                               f"--cache-slots {max_slots}: ")
                              + "this model's experts are quantized differently from layer "
                              f"to layer and need at least {k * per} cache slots (one "
                              "token's experts in each layer)")
    embed_on_demand = on_demand_ok
    if on_demand_ok and slots == all_experts and not streamed:
        if spare - slots * one >= inv.embed_bytes:
            embed_on_demand = False
            res += inv.embed_bytes
    pinned = [key for key in inv.units if key not in set(streamed)]
    # The cache is decode's: during a pass each expert is read once whatever it
    # holds, so it gives its slots back (engine/pass_pool.py) and the pass has them
    # but for its own groups of experts. A cache of every expert stays.
    # (Per-layer layouts keep the cache through a pass: its pool would need one per layout.)
    pass_slots = 0 if slots >= all_experts or per > 1 else pass_pool_slots(int(slots), k)
    released = (int(slots) - pass_slots) * one if pass_slots else 0
    # Such a pass streams the pinned layers of each shape that has more of them
    # than its buffers, through buffers of its own (engine/trunk_pass.py).
    pass_trunk, trunk_released = [], 0
    if pass_slots:
        pass_trunk = passable_units(inv, [key for key in candidates if key not in set(streamed)])
        _, buffers, _ = _trunk_layout(inv, set(pass_trunk), False)
        trunk_released = sum(inv.units[key].memory_bytes for key in pass_trunk) - buffers
    plan = MemoryPlan(
        budget=budget, context=context, state_bytes=state, working_bytes=working,
        pinned=pinned, streamed=streamed, ring_bytes=ring, embed_on_demand=embed_on_demand,
        embed_bytes=inv.embed_bytes, resident_bytes=res, slot_bytes=one, slots=int(slots),
        floor=floor, experts_per_token=k, num_experts=inv.num_experts,
        shared_width=inv.moe.shared_width,
        moe_layers=len(inv.moe_layers), streamed_read_bytes=read, floor_parts=floor_parts,
        sequences=sequences, sequence_recurrent_bytes=recurrent, sequence_kv_bytes=kv,
        prefill_step=step, prefill_bytes=extra, pass_slots=pass_slots,
        pass_released_bytes=released, pass_trunk=pass_trunk, pass_trunk_bytes=trunk_released,
    )
    # A pass gets the budget but what stays resident: the one size (pass_tokens).
    plan.prefill_pass = prefill_pass_tokens(inv.config, plan, inv.activation_dtype)
    plan.pass_kept_tokens = prefill_pass_tokens(inv.config, plan, inv.activation_dtype,
                                                keep_cache=True)
    return plan


STATE_SHARE = 0.5  # of the memory above the one-sequence floor


def choose_sequences(inv: Inventory, budget, context: int = 4096, reader_threads: int = 1,
                     stream_trunk: bool = True, cap: int = MAX_SEQUENCES) -> int:
    """How many sequences to decode together: the most (up to `cap`) whose extra
    state takes at most half of the memory above the one-sequence floor, so the other
    half stays expert cache (reads shared by more sequences are worth less when the
    cache that would avoid them shrinks). K3's 0.45 GB of recurrent state per
    sequence makes this the binding limit; small models reach `cap`."""
    budget = default_budget() if budget is None else parse_size(budget)
    one = plan_memory(inv, budget, context, reader_threads, stream_trunk=stream_trunk)
    per = one.sequence_recurrent_bytes + one.sequence_kv_bytes
    if per <= 0:
        return cap
    spare = (budget - one.floor) * STATE_SHARE
    return max(1, min(cap, 1 + int(spare // per)))
