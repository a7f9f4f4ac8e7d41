"""`deltafin-run plan`: its floor parts, units, ranges, measured rates, hub ids and refusals."""

import json
import re

import deltafin_mlx.cli.main as cli
from deltafin_mlx.cli.main import main
from deltafin_mlx.cli.plan import speed_range
from deltafin_mlx.units import count

from helpers import fake_hub_cache, one_error_line, only_stderr_line, run_command


def plan_json(*args, env=None):
    p = run_command(["plan", *args, "--json"], env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_plan_floor_parts_add_up_and_every_size_is_in_a_fitting_unit(converted, capsys):
    r = plan_json(converted("kimi_k3"), "--budget", "50MB", "--disk-gbps", "2",
                  "--compute-gwps", "3")
    assert sum(r["floor_parts"].values()) == r["floor_bytes"]
    assert list(r["floor_parts"]) == ["resident trunk", "streamed-layer buffers", "KV/state",
                                      "working buffers", "one token's experts"]
    assert r["floor_parts"]["KV/state"] == r["state_bytes"]
    assert r["floor_parts"]["one token's experts"] == 4 * r["expert_slot_bytes"]
    assert main(["plan", str(converted("kimi_k3")), "--budget", "50MB", "--disk-gbps", "2",
                 "--compute-gwps", "3"]) == 0
    text = capsys.readouterr().out
    assert "0.00 GB" not in text and not re.search(r"\b0\.0+ [KMGT]B\b", text), text
    assert f"{r['experts_total']} experts ({r['moe_layers']} MoE layers x " \
           f"{r['experts_per_layer']}, {r['experts_per_token']} per token), 24.6 KB each" in text
    floor_line = next(l for l in text.splitlines() if l.startswith("floor"))
    for what in r["floor_parts"]:
        assert what in floor_line


def test_plan_states_the_activation_dtype_and_mlx_lms(converted, capsys):
    """On this CPU `auto` plans float32 and says that mlx-lm computes in the model's
    bf16; `model` plans the model's dtype, whose KV takes half the bytes."""
    rates = ["--budget", "50MB", "--disk-gbps", "2", "--compute-gwps", "3"]
    auto = plan_json(converted("kimi_k3"), *rates)
    model = plan_json(converted("kimi_k3"), *rates, "--activation-dtype", "model")
    assert (auto["activation_dtype"], auto["model_dtype"]) == ("float32", "bfloat16")
    assert (model["activation_dtype"], model["model_dtype"]) == ("bfloat16", "bfloat16")
    assert model["state_bytes"] < auto["state_bytes"]  # KV at 2 bytes, not 4
    assert main(["plan", str(converted("kimi_k3")), *rates]) == 0
    assert ("activations float32 (mlx-lm computes in bfloat16: --activation-dtype model)"
            in capsys.readouterr().out)


def test_k3_floor_parts_add_up_in_the_budget_error(capsys):
    from deltafin_mlx.testing.kimi_k3 import CONFIG as K3_CONFIG, EXPERT, STATE_4K

    r = plan_json(K3_CONFIG, "--activation-dtype", "bfloat16", "--budget", "16GB", "--disk-gbps", "5",
                  "--compute-gwps", "400")
    assert sum(r["floor_parts"].values()) == r["floor_bytes"]
    assert r["floor_parts"]["KV/state"] == STATE_4K  # hand-computed in test_plan.py
    assert r["floor_parts"]["one token's experts"] == 16 * EXPERT
    assert main(["plan", str(K3_CONFIG), "--activation-dtype", "bfloat16", "--budget", "2GB",
                 "--disk-gbps", "5", "--compute-gwps", "400"]) == 1
    err = one_error_line(capsys.readouterr().err, f"({r['floor_bytes']} bytes = ")
    for what in r["floor_parts"]:
        assert what in err


def test_plan_rates_are_measured_once_then_cached(converted, tmp_path, monkeypatch, capsys):
    """The measurements themselves are tested in test_plan.py; here, how often they run."""
    import itertools

    import deltafin_mlx.plan.report as plan

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rates = itertools.count(1)
    measured = []
    monkeypatch.setattr(plan, "measure_disk_gbps",
                        lambda *a, **k: measured.append("disk") or float(next(rates)))
    monkeypatch.setattr(plan, "measure_compute_gwps", lambda *a, batch=1, **k: measured.append(
        "compute" if batch == 1 else "prefill") or float(next(rates)))

    def plan_of(*extra):
        assert main(["plan", str(converted("kimi_k3")), "--budget", "50MB", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    first, second = plan_of(), plan_of()
    assert measured == ["disk", "compute", "prefill"]  # once, by the first run
    assert first["disk_rate_from"].startswith("measured now")
    assert second["disk_rate_from"].startswith("measured 20")  # the date it was measured
    assert "cached in" in second["compute_rate_from"]
    assert "cached in" in second["prefill_rate_from"]
    assert (tmp_path / "cache" / "deltafin" / "rates.json").exists()
    for key in ("disk_gbps", "compute_gweights_per_second", "prefill_gweights_per_second",
                "projection", "prefill_projection"):
        assert first[key] == second[key]
    again = plan_of("--remeasure")
    assert measured == ["disk", "compute", "prefill"] * 2
    assert again["disk_gbps"] != first["disk_gbps"]
    assert plan_of()["disk_gbps"] == again["disk_gbps"]  # the new measurement is kept
    given = plan_of("--disk-gbps", "1.5", "--compute-gwps", "7")
    assert (given["disk_gbps"], given["disk_rate_from"]) == (1.5, "given")
    assert (given["compute_gweights_per_second"], given["compute_rate_from"]) == (7, "given")
    assert len(measured) == 6  # the prefill rate stays cached


def test_plan_takes_a_hub_id_fetching_only_its_config(tmp_path, sources):
    hf = tmp_path / "hf"
    fake_hub_cache(hf, "someone/k3-like", sources("kimi_k3"), only={"config.json"})
    env = {"HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    r = plan_json("someone/k3-like", "--budget", "50MB", "--disk-gbps", "2", "--compute-gwps",
                  "3", env=env)
    local = plan_json(sources("kimi_k3") / "config.json", "--budget", "50MB", "--disk-gbps", "2",
                      "--compute-gwps", "3")
    assert r["model"] == "someone/k3-like" and r["floor_bytes"] == local["floor_bytes"]
    p = run_command(["plan", "someone/not-cached", "--disk-gbps", "2", "--compute-gwps", "3"], env=env)
    assert p.returncode == 1
    one_error_line(p, "someone/not-cached", "offline", "config.json")

def test_ranges_read_low_to_high_and_one_is_singular():
    assert speed_range(1 / 78, 1 / 53.3) == "53.3-78 s/token"
    assert (count(1, "sweep"), count(1, "text"), count(3, "text")) == \
        ("1 sweep", "1 text", "3 texts")


def test_negative_context_for_plan_is_refused(converted, capsys):
    assert cli.main(["plan", str(converted("kimi_k3")), "--context", "-1"]) != 0
    assert "--context must be at least 1" in only_stderr_line(capsys.readouterr().err)


def test_a_budget_beyond_the_machines_memory_is_warned_of_in_one_line(converted, capsys):
    from deltafin_mlx.plan.memory import physical_memory

    beyond = 2 * physical_memory()
    p = run_command(["plan", converted("kimi_k3"), "--budget", str(beyond), "--disk-gbps", "2",
                     "--compute-gwps", "3"])
    assert p.returncode == 0, p.stderr
    assert "is more than this machine's memory" in only_stderr_line(p.stderr)
    within = run_command(["plan", converted("kimi_k3"), "--budget", "50MB", "--disk-gbps", "2",
                          "--compute-gwps", "3"])
    assert within.returncode == 0 and within.stderr == ""
    assert main([str(converted("kimi_k3")), "hi", "-n", "2", "--budget", str(beyond + 1)]) == 0
    warned = [l for l in capsys.readouterr().err.splitlines() if "machine's memory" in l]
    assert len(warned) == 1 and warned[0].startswith("[deltafin] warning: the memory budget")
