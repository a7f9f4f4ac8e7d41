"""On a Mac the plan never sizes past what the GPU can keep resident: the default
budget is bounded by Metal's recommended working set, and a loaded model's
resident arrays are wired up to its budget (as mlx-lm's wired_limit wires a
model's) until it is closed. Tested through the seam that stands a Mac's device
info in (plan/memory.device_info); not measured on a Mac."""

from deltafin_mlx.engine import wired
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.plan import memory

MAC = {"architecture": "applegpu_g15s", "max_recommended_working_set_size": 48_000_000}


def test_the_default_budget_stays_within_the_working_set(monkeypatch):
    monkeypatch.setattr(memory, "available_memory", lambda: 64_000_000_000)
    monkeypatch.setattr(memory, "device_info", lambda: dict(MAC))
    assert memory.default_budget() == MAC["max_recommended_working_set_size"]
    monkeypatch.setattr(memory, "device_info", lambda: {"architecture": "x86_64"})
    assert memory.default_budget() == int(64_000_000_000 * memory.HEADROOM)


def test_a_loaded_model_is_wired_to_its_budget_until_closed(monkeypatch, converted):
    calls = []

    def set_limit(n):
        calls.append(n)
        return 7  # the limit that was in force before

    monkeypatch.setattr(memory, "device_info", lambda: dict(MAC))
    monkeypatch.setattr(wired, "set_wired_limit", set_limit)
    model, _ = load(converted("kimi_k3"), "40MB", tokenizer=False, warm_start=False)
    assert calls == [40_000_000]  # the budget, within the working set
    runtime(model).close()
    assert calls == [40_000_000, 7]  # put back


def test_nothing_is_wired_where_the_device_reports_no_working_set(monkeypatch, converted):
    calls = []
    monkeypatch.setattr(memory, "device_info", lambda: {"architecture": "x86_64"})
    monkeypatch.setattr(wired, "set_wired_limit", calls.append)
    model, _ = load(converted("kimi_k3"), "40MB", tokenizer=False, warm_start=False)
    runtime(model).close()
    assert calls == []
