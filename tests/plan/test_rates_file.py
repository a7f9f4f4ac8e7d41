"""The measured-rates cache (~/.cache/deltafin/rates.json) is read as the hot-set
files are: a regular file, opened non-blocking, at most a bounded size, holding a
JSON object whose rates are plausible measurements. Anything else (a FIFO, a link
to /dev/zero, a 4 GB file, a rate of 1e-300, Infinity or 10**400, nesting deep
enough to break the parser) means measuring again, with one line naming the file,
and `plan` goes on as on a machine with no cache."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import BIN

# Every rate but the matvec's given: the compute rate is the one read from the cache.
GIVEN = ["--disk-gbps", "2", "--prefill-gwps", "3", "--layer-ms", "1"]


def plan(model, cache_home: Path):
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    return subprocess.run([str(BIN / "deltafin-run"), "plan", str(model), *GIVEN, "--json"],
                          capture_output=True, text=True, timeout=300, env=env)


def measured_again(r, rates: Path) -> dict:
    """plan succeeded, saying in one line that the cache was not used."""
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    said = [l for l in r.stderr.splitlines() if str(rates) in l]
    assert len(said) == 1 and "measuring again" in said[0], r.stderr
    out = json.loads(r.stdout)
    assert "measured now" in json.dumps(out), out
    return out


@pytest.fixture
def cache_home(tmp_path):
    (tmp_path / "deltafin").mkdir()
    return tmp_path


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "4GB", "deep", "array"])
def test_a_rates_file_that_is_not_one_is_measured_again(converted, cache_home, kind):
    rates = cache_home / "deltafin" / "rates.json"
    if kind == "fifo":
        os.mkfifo(rates)
    elif kind == "dev-zero":
        rates.symlink_to("/dev/zero")
    elif kind == "4GB":
        with open(rates, "wb") as f:
            f.truncate(4 << 30)  # sparse: takes no disk
    elif kind == "deep":
        rates.write_text("[" * 100000 + "]" * 100000)
    else:
        rates.write_text("[1, 2]")
    measured_again(plan(converted("kimi_k3"), cache_home), rates)


@pytest.fixture(scope="module")
def sound_rates(converted, tmp_path_factory) -> str:
    """rates.json as plan writes it on this machine (measured once)."""
    home = tmp_path_factory.mktemp("xdg")
    assert plan(converted("kimi_k3"), home).returncode == 0
    return (home / "deltafin" / "rates.json").read_text()


@pytest.mark.parametrize("value", ["1e-300", "Infinity", "-1", "NaN", "1" + "0" * 400,
                                   "1e400", '"fast"'])
def test_an_implausible_cached_rate_is_measured_again(converted, sound_rates, cache_home,
                                                      value):
    model = converted("kimi_k3")
    rates = cache_home / "deltafin" / "rates.json"
    rates.write_text(sound_rates)
    entries = json.loads(rates.read_text())
    key = next(k for k in entries if k.startswith("compute:"))
    text = rates.read_text()
    cached = json.dumps(entries[key]["value"])
    rates.write_text(text.replace(f'"value": {cached}', f'"value": {value}', 1))
    assert rates.read_text() != text
    out = measured_again(plan(model, cache_home), rates)
    assert 1e-4 < json.loads(rates.read_text())[key]["value"] < 1e7


def test_a_sound_cache_is_used_quietly(converted, sound_rates, cache_home):
    (cache_home / "deltafin" / "rates.json").write_text(sound_rates)
    r = plan(converted("kimi_k3"), cache_home)
    assert r.returncode == 0 and "rates.json" not in r.stderr, r.stderr
    assert "cached in" in r.stdout


@pytest.mark.parametrize("runs", ['"x"', "-1", "0", "[1]", "1e400", "10" * 200, "true", None],
                         ids=["a string", "-1", "0", "a list", "1e400", "a 400-digit int", "true",
                              "no measured"])
def test_a_calibration_that_is_not_well_typed_is_none_and_plan_measures(cache_home, monkeypatch,
                                                                        runs):
    """A bench's calibration in the cache is the mean of `runs` (an int from 1) bench
    runs, the last `measured`: any other entry is no calibration, so that plan uses
    the machine's microbenchmark and the next bench starts it afresh, not a
    ValueError, ZeroDivisionError, TypeError, OverflowError or KeyError."""
    from types import SimpleNamespace

    import mlx.core as mx

    from deltafin_mlx.plan import rates
    from deltafin_mlx.plan.report import decode_rates

    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    key = rates.layer_key(mx.float32, "model-digest")
    inv = SimpleNamespace(sections=[SimpleNamespace(dtype="uint32")])  # an affine model
    measured = '"2026-01-01T00:00:00Z"'
    entry = (f'"value": 0.001, "measured": {measured}, "runs": {runs}' if runs else
             '"value": 0.001, "runs": 2')
    compute = rates.compute_key("affine", 4, 64, mx.float32)
    (cache_home / "deltafin" / "rates.json").write_text(
        f'{{"{key}": {{{entry}}}, "{compute}": {{"value": 5.0, "measured": {measured}}}, '
        f'"{rates.layer_key(mx.float32)}": {{"value": 0.0002, "measured": {measured}}}}}')
    assert rates.calibration(key) is None
    _, _, layer, layer_from = decode_rates(inv, mx.float32, model="model-digest")
    assert layer == 0.0002 and "calibrated" not in layer_from
    assert rates.store_calibration(key, 0.003, "a bench run")["runs"] == 1
    assert rates.calibration(key)["value"] == 0.003
    _, _, layer, layer_from = decode_rates(inv, mx.float32, model="model-digest")
    assert layer == 0.003 and "calibrated by deltafin-run bench" in layer_from
    assert "the mean of 1 runs" in layer_from
