"""`deltafin-run bench`: the context it reserves, and its measurement against plan's projection."""

import re

import pytest

from deltafin_mlx.cli.main import main

from helpers import run_json


@pytest.mark.usefixtures("no_disk_measurement")
def test_bench_reserves_what_its_runs_need_or_the_context_given(converted, capsys):
    model = converted("kimi_k3")
    base = ["bench", model, "-n", "2", "--prompt-tokens", "4", "--repeats", "1", "--budget", "200MB"]
    assert run_json(capsys, *base)["context"] == 256  # 4 + 2 tokens, rounded up as a run does
    assert run_json(capsys, *base, "--context", "1000")["context"] == 1000


@pytest.mark.usefixtures("no_disk_measurement")
def test_bench_reports_the_projection_against_its_measurement_and_calibrates_plan(
        converted, capsys):
    model = converted("kimi_k3")
    bench = run_json(capsys, "bench", model, "-n", "16", "--repeats", "1", "--budget", "30MB")
    measured = bench["tokens_per_second_median"]
    assert bench["projected_over_measured"] == pytest.approx(
        bench["projected_tokens_per_second"] / measured)
    plan = run_json(capsys, "plan", model, "--budget", "30MB", "--context", str(bench["context"]))
    assert "calibrated by deltafin-run bench" in plan["layer_rate_from"]
    assert plan["layer_seconds"] == pytest.approx(bench["calibrated_layer_seconds"])
    # Calibrated, plan's projection is the measured speed (less its waits for reads).
    assert 0.6 < plan["projection"]["real_routing_tokens_per_second"] / measured < 2.5
    capsys.readouterr()
    assert main(["bench", str(model), "-n", "4", "--repeats", "1", "--budget", "30MB"]) == 0
    assert re.search(r"plan's projection: [\d.]+ tok/s .* measured [\d.]+: projected/measured "
                     r"[\d.]+", capsys.readouterr().out)


@pytest.mark.usefixtures("no_disk_measurement")
def test_plan_shows_seconds_per_token_below_one_token_a_second(converted, capsys):
    capsys.readouterr()
    assert main(["plan", str(converted("kimi_k3")), "--budget", "30MB", "--disk-gbps", "1",
                 "--compute-gwps", "0.0001", "--prefill-gwps", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"projection .*: [\d.]+-[\d.]+ s/token", out), out


@pytest.mark.usefixtures("no_disk_measurement")
def test_calibrations_are_per_model_never_zero_and_averaged(converted, capsys, monkeypatch):
    import deltafin_mlx.plan.speed as speed

    k3, qwen = converted("kimi_k3"), converted("qwen3_moe")
    bench = ["bench", k3, "-n", "8", "--repeats", "1", "--budget", "30MB"]
    first, second = run_json(capsys, *bench), run_json(capsys, *bench)
    assert (first["calibration_runs"], second["calibration_runs"]) == (1, 2)
    assert second["calibrated_layer_seconds"] == pytest.approx(
        (first["run_layer_seconds"] + second["run_layer_seconds"]) / 2)
    plan = run_json(capsys, "plan", k3, "--budget", "30MB")
    assert "bench on this model (the mean of 2 runs" in plan["layer_rate_from"]
    assert plan["layer_seconds"] == pytest.approx(second["calibrated_layer_seconds"])
    # another model keeps the machine's microbenchmark: k3's cost says nothing of it
    other = run_json(capsys, "plan", qwen, "--budget", "30MB")
    assert "microbenchmark" in other["layer_rate_from"] and "bench on" not in other[
        "layer_rate_from"]
    # a run that leaves no time for the per-layer cost (0) changes nothing and says so
    monkeypatch.setattr(speed, "layer_seconds_from_run", lambda *a: 0.0)
    zero = run_json(capsys, *bench)
    assert zero["calibrated_layer_seconds"] is None and zero["calibration_runs"] == 0
    assert run_json(capsys, "plan", k3, "--budget", "30MB")["layer_seconds"] == pytest.approx(
        second["calibrated_layer_seconds"])
    assert main([str(a) for a in bench]) == 0
    assert "no per-layer cost calibrated" in capsys.readouterr().out
