"""How far a conversation's context may grow: re-planned in steps (doubling) up to
what the model takes and the memory budget holds, the expert cache giving up the
room the KV cache and recurrent state need. Arithmetic only: each candidate is a
memory plan (plan/memory.py)."""

from deltafin_mlx.errors import BudgetError
from deltafin_mlx.model.config import max_context
from deltafin_mlx.plan.memory import plan_memory, round_context

STEP = 256  # contexts are planned in multiples of this (round_context's step)


def fits(inv, budget: int, context: int, reader_threads: int = 1) -> bool:
    try:
        plan_memory(inv, budget, context=context, reader_threads=reader_threads)
    except BudgetError:
        return False
    return True


def grown_context(inv, budget: int, current: int, needed: int, reader_threads: int = 1) -> int:
    """The context to re-plan at for a conversation that needs `needed` tokens:
    `current` doubled until it holds them, cut to the model's maximum and then to
    the largest multiple of STEP the budget holds; `current` when nothing larger
    fits (the caller then has to make the conversation shorter)."""
    limit = max_context(inv.config)
    target = current
    while target < needed:
        target *= 2
    target = round_context(target)
    if limit:
        target = min(target, limit)
    if target <= current:
        return current
    if fits(inv, budget, target, reader_threads):
        return target
    lo, hi = current, target  # lo fits (it is planned now), hi does not
    while hi - lo > STEP:
        mid = (lo + hi) // 2 // STEP * STEP
        if mid <= lo:
            break
        if fits(inv, budget, mid, reader_threads):
            lo = mid
        else:
            hi = mid
    return lo


def largest_context(inv, budget: int, current: int, reader_threads: int = 1) -> int:
    """The longest context this budget holds for the model (at most its maximum)."""
    limit = max_context(inv.config) or 1 << 24
    return grown_context(inv, budget, current, limit, reader_threads)
