"""The projected speed of a plan: a cost model, stated once.

    compute per token = weights touched per token / quantized matvec rate
                        + layers x the per-layer cost of a step (its small operations
                          and synchronisations: what dominates a small model, measured
                          by a microbenchmark or, better, by `deltafin-run bench`)
    reads per token   = streamed trunk bytes + expected expert misses x record size
    time per token    = max(compute, reads / disk bandwidth)  (reads overlap compute)
                        .. compute + reads / disk bandwidth     (no overlap)

with the expert hit rate taken two ways: the cache's share of all experts (no skew,
a floor), and the hit rate the runtime's pool policy reaches on real routing at the
same number of slots per layer per routed expert (REAL_ROUTING_HITS, measured by the
cache simulator on the OLMoE trace; docs/PERFORMANCE.md).
"""

import numpy as np

from deltafin_mlx.plan.footprint import Inventory
from deltafin_mlx.plan.memory import MemoryPlan

# Hit rate of the shipped pool policy on OLMoE's real routing (16 layers x 64 experts,
# 8 per token; python -m bench.studies.simulate_cache --trace olmoe_299.jsonl), by
# cache slots per layer per routed expert: 10%, 25% and 50% of its experts.
REAL_ROUTING_HITS = ((0.0, 0.0), (0.8, 0.369), (2.0, 0.614), (4.0, 0.819), (8.0, 1.0))


def real_routing_hit_rate(slots: int, moe_layers: int, experts_per_token: int,
                          cache_fraction: float) -> float:
    """The hit rate REAL_ROUTING_HITS gives for this many slots per layer per routed
    expert (linear between the measured points), never below the cache's share."""
    per = slots / max(moe_layers * experts_per_token, 1)
    xs, ys = zip(*REAL_ROUTING_HITS)
    return max(cache_fraction, float(np.interp(per, xs, ys)))


def decoder_layers(inv: Inventory) -> int:
    return sum(1 for name in inv.units if name != "globals")


def weights_per_token(inv: Inventory) -> int:
    return (sum(u.weights for u in inv.units.values())
            + len(inv.moe_layers) * inv.experts_per_token * inv.expert_weights)


def layer_seconds_from_run(inv: Inventory, compute_gwps: float, seconds_per_token: float,
                           stall_seconds_per_token: float) -> float:
    """The per-layer cost a real decode implies: its time per token less the time it
    waited for reads and the weights' arithmetic, over the layers (never negative)."""
    rest = seconds_per_token - stall_seconds_per_token - weights_per_token(inv) / (compute_gwps * 1e9)
    return max(0.0, rest / max(decoder_layers(inv), 1))


def project(inv: Inventory, plan: MemoryPlan, disk_gbps: float, compute_gwps: float,
            layer_seconds: float = 0.0) -> dict:
    weights = weights_per_token(inv)
    overhead = decoder_layers(inv) * layer_seconds
    compute = weights / (compute_gwps * 1e9) + overhead
    routed = len(inv.moe_layers) * inv.experts_per_token
    read = plan.streamed_read_bytes + routed * (1 - plan.cache_fraction) * inv.mean_record_size
    io = read / (disk_gbps * 1e9)
    hit = real_routing_hit_rate(plan.slots, len(inv.moe_layers), inv.experts_per_token,
                                plan.cache_fraction)
    real_read = plan.streamed_read_bytes + routed * (1 - hit) * inv.mean_record_size
    real_io = real_read / (disk_gbps * 1e9)
    return {"weights_per_token": weights,
            "compute_seconds": compute,
            "layer_overhead_seconds": overhead,
            "read_bytes_per_token": read,
            "read_seconds": io,
            "tokens_per_second_overlapped": 1 / max(compute, io),
            "tokens_per_second_serial": 1 / (compute + io),
            "real_routing_hit_rate": hit,
            "real_routing_read_bytes_per_token": real_read,
            "real_routing_tokens_per_second": 1 / max(compute, real_io)}


def distinct_experts(tokens: int, experts: int, per_token: int) -> float:
    """Expected distinct experts `tokens` tokens route to in one layer, under
    uniform routing (real routing is skewed: fewer)."""
    return experts * (1 - (1 - per_token / experts) ** tokens)


def project_prefill(inv: Inventory, plan: MemoryPlan, prompt_tokens: int, disk_gbps: float,
                    compute_gwps: float, pass_tokens: int = None) -> dict:
    """Time to first token for a prompt, in the plan's passes (or of `pass_tokens`
    tokens): each pass reads the experts its tokens route to once (less the cache's
    share of them) and the streamed trunk layers once, overlapped with its
    computation (every weight touched per token, at `compute_gwps`: the rate of
    matrix products over many tokens, which a pass's are)."""
    weights = sum(u.weights for u in inv.units.values())
    weights += len(inv.moe_layers) * inv.experts_per_token * inv.expert_weights
    passes, seconds, read = 0, 0.0, 0.0
    left = prompt_tokens
    while left > 0:
        tokens = min(left, pass_tokens or plan.prefill_pass)
        union = distinct_experts(tokens, inv.num_experts, inv.experts_per_token)
        pass_read = (len(inv.moe_layers) * union * (1 - plan.cache_fraction)
                     * inv.mean_record_size + plan.streamed_read_bytes)
        compute = tokens * weights / (compute_gwps * 1e9)
        seconds += max(compute, pass_read / (disk_gbps * 1e9))
        read += pass_read
        passes += 1
        left -= tokens
    return {"prompt_tokens": prompt_tokens, "passes": passes, "read_bytes": read,
            "seconds_to_first_token": seconds}


def project_scoring(inv: Inventory, plan: MemoryPlan, pass_tokens: int, disk_gbps: float,
                    compute_gwps: float) -> dict:
    """Scored tokens per second with passes of `pass_tokens` tokens: one pass is
    a prefill pass of that size (plan/scoring.py sizes it), so its time is
    project_prefill's."""
    one = project_prefill(inv, plan, pass_tokens, disk_gbps, compute_gwps, pass_tokens)
    seconds = one["seconds_to_first_token"]
    return {"pass_tokens": pass_tokens, "pass_seconds": seconds, "pass_read_bytes": one["read_bytes"],
            "tokens_per_second": pass_tokens / seconds if seconds > 0 else 0.0}
