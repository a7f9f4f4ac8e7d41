"""One size of a pass: a pass, a prefill's or a scoring one's, gets the budget less
what stays resident through it (plan/memory.py `pass_tokens`), and `plan` prints the
size `load` runs. A scoring pass keeps no KV, so it is never smaller than a prefill
pass. Kimi K3 on a 64 GB Mac scores passes of 30,000 tokens and more and prefills a
30,000-token prompt in one pass; on a 16 GB Mac, passes of 6,000."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from deltafin_mlx.plan.footprint import inventory_from_config
from deltafin_mlx.plan.memory import pass_bytes_per_token, plan_memory, prefill_bytes
from deltafin_mlx.plan.scoring import scoring_pass_tokens
from deltafin_mlx.testing.kimi_k3 import CONFIG as K3

MAC_64GB = ("--budget", "56GB", "--disk-gbps", "5.4", "--compute-gwps", "515")


def plan_json(*args):
    out = subprocess.run([sys.executable, "-m", "deltafin_mlx.cli.main", "plan", *map(str, args),
                          "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def k3_inventory():
    return inventory_from_config(json.loads(K3.read_text()), mx.bfloat16, bits=4)


@pytest.mark.parametrize("budget, tokens", [("56GB", 30_000), ("12GB", 6_000)])
def test_k3_scores_the_bars_tokens_a_pass(k3_inventory, budget, tokens):
    r = plan_json(K3, "--bits", "4", "--activation-dtype", "bfloat16", *MAC_64GB, "--budget", budget)
    assert r["scoring_pass_tokens"] >= tokens
    assert r["scoring_projection"]["tokens_per_second"] > 0


def test_k3_prefills_30000_tokens_in_one_pass_given_the_context(k3_inventory):
    r = plan_json(K3, "--bits", "4", "--activation-dtype", "bfloat16", *MAC_64GB)
    # At the default context a 30,000-token prompt cannot run: no projection.
    assert r["prefill_needs_context"] == [30_000]
    assert [p["prompt_tokens"] for p in r["prefill_projection"]] == [300, 3000]
    r = plan_json(K3, "--bits", "4", "--activation-dtype", "bfloat16", *MAC_64GB, "--context", 32768)
    thirty = next(p for p in r["prefill_projection"] if p["prompt_tokens"] == 30_000)
    assert thirty["passes"] == 1 and r["prefill_needs_context"] == []
    assert r["prefill_pass_tokens"] == 32768
    # What a pass reads: each routed expert once; 30,000 tokens route to every expert.
    assert 1.4e12 < thirty["read_bytes"] < 1.5e12


def test_plan_says_what_context_a_longer_prompt_needs(k3_inventory):
    out = subprocess.run([sys.executable, "-m", "deltafin_mlx.cli.main", "plan", str(K3),
                          "--bits", "4", "--activation-dtype", "bfloat16", *MAC_64GB],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "30,000 tokens: needs --context 30000 or more" in out.stdout


@pytest.mark.parametrize("budget", ["4GB", "12GB", "56GB"])
def test_a_scoring_pass_holds_at_least_a_prefill_pass_on_k3(k3_inventory, budget):
    plan = plan_memory(k3_inventory, budget)
    assert scoring_pass_tokens(k3_inventory.config, plan, mx.bfloat16) >= plan.prefill_pass


@pytest.mark.parametrize("budget, context", [("4GB", 4096), ("12GB", 30_000), ("56GB", 30_000)])
def test_a_prefill_pass_and_what_stays_resident_fit_the_budget(k3_inventory, budget, context):
    """The pass's tokens, the KV/state its prompt keeps, one attention chunk and what
    stays resident through it: no more than the budget."""
    plan = plan_memory(k3_inventory, budget, context=context)
    act = k3_inventory.activation_dtype
    held = (plan.budget - plan.pass_room() + plan.state_bytes
            + prefill_bytes(k3_inventory.config, plan.moe, plan.prefill_step, context, act)
            + plan.prefill_pass * pass_bytes_per_token(k3_inventory.config, plan.moe, act))
    assert held <= plan.budget


def test_plan_prints_one_pass_size_per_kind(converted):
    out = subprocess.run([sys.executable, "-m", "deltafin_mlx.cli.main", "plan",
                          str(converted("kimi_k3")), "--budget", "40MB", "--disk-gbps", "2",
                          "--compute-gwps", "3"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "pass plan" not in out.stdout
    assert [line.split()[0] for line in out.stdout.splitlines()
            if "passes of up to" in line] == ["prefill", "scoring"]
    r = plan_json(converted("kimi_k3"), "--budget", "40MB", "--disk-gbps", "2",
                  "--compute-gwps", "3")
    assert "passes" not in r
    assert f"passes of up to {r['prefill_pass_tokens']:,} tokens" in out.stdout
    assert f"passes of up to {r['scoring_pass_tokens']:,} tokens" in out.stdout


def test_k3_batch_auto_takes_the_sequences_its_state_memory_allows(k3_inventory):
    """About 449 MB of recurrent state per sequence: at 56 GB, 47 sequences (half of
    the memory above the floor), past mlx-lm's default batch of 32."""
    r = plan_json(K3, "--bits", "4", "--activation-dtype", "bfloat16", *MAC_64GB, "--sequences", "auto")
    assert r["sequences"] == r["auto_sequences"] > 32
    per = r["sequence_recurrent_bytes"] + r["sequence_kv_bytes"]
    assert r["auto_sequences"] * per <= r["budget_bytes"] - r["floor_bytes"]


@pytest.fixture(scope="module")
def demo_sized(tmp_path_factory):
    from deltafin_mlx.testing.demo import prepare

    return prepare(tmp_path_factory.mktemp("demo"))


def inventory_of(path):
    from deltafin_mlx.format.model_dir import open_model_dir
    from deltafin_mlx.plan.footprint import inventory_from_manifest
    from deltafin_mlx.format.dtypes import compute_dtype

    m = open_model_dir(path)
    act = compute_dtype("auto", m.manifest.dtype)
    return inventory_from_manifest(m.manifest, m.config, act)


@pytest.mark.parametrize("budget", ["24MB", "40MB", "64MB", "128MB", "2GB"])
@pytest.mark.parametrize("model", ["kimi_k3", "eight_layers", "wide_experts", "demo_sized"])
def test_a_scoring_pass_holds_at_least_a_prefill_pass(request, converted, model, budget):
    """K3's layout (the fixture, eight layers of it, many wide experts, the demo's
    shape), from near the floor to a budget that holds everything: a scoring pass
    keeps no KV."""
    path = converted(model) if model == "kimi_k3" else request.getfixturevalue(model)
    inv = inventory_of(path)
    for slots in (None, 16):  # a cache of every expert, and one a pass gives back
        plan = plan_memory(inv, budget, max_slots=slots)
        for longest in (0, 8, 70):
            scoring = scoring_pass_tokens(inv.config, plan, inv.activation_dtype, longest)
            assert scoring >= plan.prefill_pass, (slots, longest)


def test_plan_prints_the_pass_sizes_load_runs(converted):
    from deltafin_mlx.engine.load import load
    from deltafin_mlx.engine.runtime import runtime
    from deltafin_mlx.jobs.score import Sizing

    path = converted("kimi_k3")
    r = plan_json(path, "--budget", "40MB", "--context", 2048, "--disk-gbps", "2",
                  "--compute-gwps", "3")
    model, _ = load(path, "40MB", context=2048, tokenizer=False, warm_start=False)
    try:
        assert runtime(model).plan.prefill_pass == r["prefill_pass_tokens"]
        assert Sizing(model).capacity(0) == r["scoring_pass_tokens"]
        assert r["scoring_pass_tokens"] > r["prefill_pass_tokens"] > r["prefill_step"]
    finally:
        runtime(model).close()
