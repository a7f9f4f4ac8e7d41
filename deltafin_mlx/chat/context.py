"""A conversation's context, growing with it: when a turn needs more tokens than
the model was planned for, the model is re-planned at a larger context
(plan/context_steps.py: doubling, up to what the budget holds, the expert cache
shrinking) and loaded again by the caller's `reload`; the conversation's own
cache (KV and recurrent state, mlx-lm's objects) is kept, so nothing is
prefilled again. Beyond what the budget holds the caller may drop the oldest
turns (ChatSession.drop_oldest), which plans the model back to the context the
rest of the conversation needs (`shrink`), so the expert cache gets its room back."""

from dataclasses import dataclass
from typing import Optional

from deltafin_mlx.engine.runtime import find_runtime
from deltafin_mlx.plan.context_steps import grown_context, largest_context


@dataclass
class Growth:
    """One re-plan: the context before and after, and the expert cache's slots."""

    old_context: int
    new_context: int
    old_slots: int
    new_slots: int
    experts: int  # of all MoE layers

    def line(self) -> str:
        how = "grown" if self.new_context > self.old_context else "back"
        return (f"context {how} from {self.old_context:,} to {self.new_context:,} tokens: "
                f"re-planned, the expert cache now {self.new_slots} slots "
                f"({self.new_slots / self.experts:.0%} of experts, was {self.old_slots})")


@dataclass
class ContextStatus:
    used: int  # tokens in the conversation
    planned: int  # the context the model is planned for now
    largest: int  # the longest the budget holds
    slots: int
    experts: int
    pending: int = 0  # of `used`, not in the cache (prefilled at the next turn)

    def line(self) -> str:
        return (f"context: {self.used:,} of {self.planned:,} planned tokens in use; the budget "
                f"holds up to {self.largest:,} (the expert cache shrinks as it grows); expert "
                f"cache {self.slots} slots ({self.slots / self.experts:.0%} of experts)"
                + (f"; {self.pending:,} of the tokens are prefilled again at the next turn"
                   if self.pending else ""))


def grow(model, reload, needed: int, least: int = 0):
    """(model, Growth or None): the model re-planned and reloaded (`reload(context)`
    returns it) when `needed` tokens exceed its planned context and the budget
    holds more, at least `least` tokens (the prompt: a context that cannot hold it
    is not worth a reload); the same model otherwise."""
    state = find_runtime(model)
    if reload is None or state is None or state.inventory is None or needed <= state.plan.context:
        return model, None
    plan = state.plan
    new = grown_context(state.inventory, plan.budget, plan.context, needed, state.reader_threads)
    if new <= plan.context or new < least:
        return model, None
    grown = reload(new)
    after = find_runtime(grown).plan
    experts = plan.num_experts * plan.moe_layers
    return grown, Growth(plan.context, after.context, plan.slots, after.slots, experts)


def shrink(model, reload, needed: int, planned: int):
    """(model, Growth or None): after the conversation got shorter (turns
    dropped), the model re-planned at the context it would have grown to from
    `planned` (the context it started with) for `needed` tokens, when that is
    less than its context now, so the expert cache gets its room back."""
    state = find_runtime(model)
    if reload is None or state is None or state.inventory is None:
        return model, None
    plan = state.plan
    target = planned if needed <= planned else grown_context(
        state.inventory, plan.budget, planned, needed, state.reader_threads)
    if target >= plan.context:
        return model, None
    smaller = reload(target)
    after = find_runtime(smaller).plan
    experts = plan.num_experts * plan.moe_layers
    return smaller, Growth(plan.context, after.context, plan.slots, after.slots, experts)


def status(model, used: int, pending: int = 0) -> Optional[ContextStatus]:
    state = find_runtime(model)
    if state is None or state.inventory is None:
        return None
    plan = state.plan
    largest = largest_context(state.inventory, plan.budget, plan.context, state.reader_threads)
    return ContextStatus(used, plan.context, largest, plan.slots,
                         plan.num_experts * plan.moe_layers, pending)
