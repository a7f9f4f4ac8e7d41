"""Odd memory budgets: far below the floor, beyond the machine, not finite, malformed on the
mlx-lm path: a clear error or a capped plan."""

import os
import subprocess

import mlx.core as mx
import pytest

from deltafin_mlx import runtime
from deltafin_mlx.engine.load import load
from deltafin_mlx.plan.memory import BudgetError

from helpers import BIN, FAST, close, first_logits, only_stderr_line


def test_bad_deltafin_budget_on_the_mlx_lm_path_is_one_line(converted):
    env = {**os.environ, "DELTAFIN_BUDGET": "lots"}
    p = subprocess.run([str(BIN / "mlx_lm.generate"), "--model", str(converted("kimi_k3")),
                        "--trust-remote-code", "--prompt", "hi", "-m", "1"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1
    assert "DELTAFIN_BUDGET" in only_stderr_line(p.stderr)


def test_budget_far_below_the_floor_states_the_floor(k3, clean):
    model, _ = load(k3, **{**FAST, "memory_budget": "4GB", "cache_slots": None})
    floor = runtime(model).plan.floor
    close(model)
    for budget in (1, 4096, floor // 100, floor - 1):
        with pytest.raises(BudgetError, match=rf"below this model's floor of [0-9.]+ [KMGT]?B "
                                              rf"\({floor} bytes"):
            load(k3, **{**FAST, "memory_budget": budget, "cache_slots": None})
    # At the floor exactly it runs, with the least cache, and gives the same logits.
    model, _ = load(k3, **{**FAST, "memory_budget": floor, "cache_slots": None})
    try:
        assert runtime(model).plan.cache_bytes <= floor
        assert mx.array_equal(first_logits(model), clean).item()
    finally:
        close(model)


def test_budget_larger_than_the_machine_loads_and_is_capped_by_the_model(k3, clean):
    """Decision: a budget beyond physical memory is accepted (no error, no warning):
    the plan never holds more than every expert once, so memory use is bounded by
    the model, not by the budget."""
    from deltafin_mlx.plan.memory import physical_memory

    huge = max(physical_memory(), 1 << 30) * 1000
    for budget in (huge, f"{huge // 10**12 + 1}TB"):
        model, _ = load(k3, **{**FAST, "memory_budget": budget, "cache_slots": None})
        try:
            plan = runtime(model).plan
            all_experts = plan.num_experts * plan.moe_layers * plan.slot_bytes
            assert plan.cache_bytes <= all_experts
            assert mx.array_equal(first_logits(model), clean).item()
        finally:
            close(model)


@pytest.mark.parametrize("budget", [float("inf"), float("nan"), float("-inf"), "1e30"])
def test_non_finite_budget_is_a_budget_error(k3, budget):
    with pytest.raises(BudgetError, match="memory"):
        load(k3, **{**FAST, "memory_budget": budget})
