"""The pass plan: how many tokens a pass (a prompt's prefill, a scoring pass) may
hold when it is given the budget.

During a pass every trunk layer is used once and every expert its tokens route to
is read at most once, whatever the expert cache holds: neither a pinned trunk nor
the cache saves a pass more than one read of each. So a pass gets the whole budget
except what the pass itself needs resident:

* the trunk, streamed one layer at a time (the memory plan's floor: the resident
  units and the buffers streamed layers pass through, read ahead of their use),
  unless holding it whole costs the pass no tokens;
* its groups of experts (PASS_GROUPS of one token's, `experts_per_token` slots
  each: one computing while the next is read, engine/pass_pool.py);
* one block of logits and its log-softmax (`LOGIT_ROWS` positions);
* the KV/state the prompt keeps (for a prefill: the prompt's, for decoding after
  it; for a scoring pass: each layer's KV for the pass's tokens);
* the working buffers and one attention chunk's activations;
* and each token's activations between layers (`pass_bytes_per_token`).

The expert cache is decode's: it gives its slots back while a pass runs and decode's
first token reads what it routes to. The figures are what a pass is sized to; a
loaded model runs its passes in the memory plan's prefill allowance plus the cache's
slots and the pinned trunk layers the pass streams (plan/memory.py
`pass_released_bytes`, `pass_trunk_bytes`; engine/trunk_pass.py), which is smaller
by the scoring allowance's shares for an attention call and a logits block (plan/
scoring.py; their figures are in docs/PERFORMANCE.md).
"""

from dataclasses import dataclass

from deltafin_mlx.model.config import text_config
from deltafin_mlx.plan.footprint import Inventory
from deltafin_mlx.plan.memory import (MemoryPlan, _trunk_layout, pass_bytes_per_token,
                                      pass_pool_slots, prefill_bytes, sequence_state,
                                      streamable_units)
from deltafin_mlx.plan.speed import distinct_experts, weights_per_token

MAX_PASS_TOKENS = 65536  # past this a pass's bookkeeping outweighs a sweep saved
LOGIT_ROWS = 128  # positions per block of logits in a pass
LOGIT_COPIES = 4  # float32 logits, their log-softmax and a sort's scratch


@dataclass
class PassPlan:
    budget: int
    trunk_streamed: bool  # the trunk goes through a pass a layer at a time
    trunk_bytes: int  # what the trunk holds during a pass (resident units + buffers)
    trunk_read_bytes: int  # trunk bytes read per pass
    expert_group_bytes: int  # the groups of experts a pass reads into
    logits_bytes: int  # one block of logits
    fixed_bytes: int  # working buffers and one attention chunk's activations
    token_bytes: int  # each token's activations between layers
    step: int  # tokens per attention call

    def state_bytes(self, inv: Inventory, tokens: int) -> int:
        recurrent, kv = sequence_state(inv.config, max(tokens, 1), inv.activation_dtype)
        return recurrent + kv

    def room(self) -> int:
        """What tokens and state may take."""
        return (self.budget - self.trunk_bytes - self.expert_group_bytes - self.logits_bytes
                - self.fixed_bytes)

    def prefill_tokens(self, inv: Inventory, prompt: int) -> int:
        """Tokens per pass of a `prompt`-token prefill: the room less the KV/state the
        prompt keeps, over each token's activations (at least one attention chunk)."""
        room = self.room() - self.state_bytes(inv, prompt)
        n = room // max(self.token_bytes, 1)
        return int(max(self.step, min(n, MAX_PASS_TOKENS)))

    def scoring_tokens(self, inv: Inventory) -> int:
        """Tokens per scoring pass: each token also holds its KV in the layer the pass
        is in (a text's attention over its own tokens), nothing across layers."""
        recurrent, kv = sequence_state(inv.config, 1, inv.activation_dtype)
        layers = max(text_config(inv.config).get("num_hidden_layers", 1), 1)
        per_token = self.token_bytes + -(-kv // layers)
        n = (self.room() - -(-recurrent // layers)) // max(per_token, 1)
        return int(max(self.step, min(n, MAX_PASS_TOKENS)))


def pass_plan(inv: Inventory, plan: MemoryPlan) -> PassPlan:
    act = inv.activation_dtype
    k, one = inv.experts_per_token, inv.slot_bytes
    vocab = text_config(inv.config).get("vocab_size", 1)
    on_demand = not inv.embed_tied and inv.embed_bytes > 0
    # What the trunk holds streamed: the memory plan's floor layout.
    res, ring, read = _trunk_layout(inv, set(streamable_units(inv)), on_demand)
    whole = sum(u.memory_bytes for u in inv.units.values()) - (inv.embed_bytes if on_demand else 0)
    fixed = plan.working_bytes + prefill_bytes(inv.config, plan.prefill_step, plan.context, act)
    group = max(k, pass_pool_slots(plan.slots, k)) * one  # the engine's pass pool
    common = dict(budget=plan.budget, expert_group_bytes=group,
                  logits_bytes=LOGIT_ROWS * LOGIT_COPIES * 4 * vocab, fixed_bytes=fixed,
                  token_bytes=pass_bytes_per_token(inv.config, act), step=plan.prefill_step)
    streamed = PassPlan(trunk_streamed=bool(read), trunk_bytes=res + ring,
                        trunk_read_bytes=read, **common)
    held = PassPlan(trunk_streamed=False, trunk_bytes=whole, trunk_read_bytes=0, **common)
    # Holding the trunk saves its reads; keep it where that costs no tokens.
    if held.scoring_tokens(inv) >= streamed.scoring_tokens(inv):
        return held
    return streamed


def expert_read_bytes(inv: Inventory, tokens: int) -> float:
    """Expert bytes a pass of `tokens` tokens reads: each expert they route to once,
    under uniform routing (real routing is skewed: fewer), none held from a cache."""
    union = distinct_experts(tokens, inv.num_experts, inv.experts_per_token)
    return len(inv.moe_layers) * union * inv.record_size


def pass_figures(inv: Inventory, plan: MemoryPlan, disk_gbps: float,
                 prefill_gwps: float, prompts=()) -> dict:
    """`plan --json`'s "passes": tokens per pass for prefill and scoring, the trunk
    and expert bytes each pass reads, and rates projected from the matrix-product
    rate (every weight a token touches, at `prefill_gwps`) overlapped with the
    pass's reads at `disk_gbps`."""
    p = pass_plan(inv, plan)
    weights = weights_per_token(inv)

    def timed(tokens: int) -> dict:
        experts = expert_read_bytes(inv, tokens)
        compute = tokens * weights / (prefill_gwps * 1e9)
        reads = (experts + p.trunk_read_bytes) / (disk_gbps * 1e9)
        return {"tokens": tokens, "trunk_read_bytes": p.trunk_read_bytes,
                "expert_read_bytes": experts, "compute_seconds": compute,
                "read_seconds": reads, "seconds": max(compute, reads)}

    scoring = timed(p.scoring_tokens(inv))
    scoring["tokens_per_second"] = scoring["tokens"] / scoring["seconds"]
    prefill = timed(p.prefill_tokens(inv, plan.context))
    projected = []
    for n in prompts:
        per = p.prefill_tokens(inv, n)
        passes = -(-n // per)
        parts = [timed(min(per, n - i * per)) for i in range(passes)]
        projected.append({"prompt_tokens": n, "pass_tokens": per, "passes": passes,
                          "read_bytes": sum(q["expert_read_bytes"] + q["trunk_read_bytes"]
                                            for q in parts),
                          "seconds_to_first_token": sum(q["seconds"] for q in parts)})
    return {
        "budget_bytes": p.budget,
        "trunk_streamed": p.trunk_streamed,
        "trunk_bytes": p.trunk_bytes,
        "expert_group_bytes": p.expert_group_bytes,
        "logits_bytes": p.logits_bytes,
        "token_bytes": p.token_bytes,
        "attention_step": p.step,
        "prefill_tokens": prefill["tokens"],
        "prefill_state_bytes": p.state_bytes(inv, plan.context),
        "prefill": prefill,
        "scoring_tokens": scoring["tokens"],
        "scoring": scoring,
        "prefill_projection": projected,
        "prefill_gweights_per_second": prefill_gwps,
    }
