"""The pass plan: a pass gets the budget less what it needs resident (the trunk a
layer at a time, one group of experts, a logits block, the KV/state the prompt
keeps), so Kimi K3 on a 64 GB Mac scores passes of 30,000 tokens and more and
prefills a 30,000-token prompt in one pass; on a 16 GB Mac, passes of 6,000."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from deltafin_mlx.plan.footprint import inventory_from_config
from deltafin_mlx.plan.memory import plan_memory
from deltafin_mlx.plan.passes import pass_plan
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


def test_k3_at_56gb_scores_30000_tokens_a_pass_and_prefills_30000_in_one(k3_inventory):
    r = plan_json(K3, "--bits", "4", "--dtype", "bfloat16", *MAC_64GB)["passes"]
    assert r["scoring_tokens"] >= 30_000
    thirty = next(p for p in r["prefill_projection"] if p["prompt_tokens"] == 30_000)
    assert thirty["passes"] == 1
    # What a pass reads: the trunk once (it does not fit beside such a pass) and
    # each routed expert once; tens of thousands of tokens route to every expert.
    assert r["trunk_streamed"] and r["scoring"]["trunk_read_bytes"] > 30e9
    assert 1.4e12 < r["scoring"]["expert_read_bytes"] < 1.5e12
    assert r["scoring"]["tokens_per_second"] > 0


def test_k3_at_12gb_scores_6000_tokens_a_pass(k3_inventory):
    plan = plan_memory(k3_inventory, "12GB")
    assert pass_plan(k3_inventory, plan).scoring_tokens(k3_inventory) >= 6_000


@pytest.mark.parametrize("budget, tokens", [("56GB", 30_000), ("12GB", 6_000)])
def test_k3_as_loaded_scores_the_bars_tokens_a_pass(k3_inventory, budget, tokens):
    """Not only the pass plan: the passes a loaded model runs (the memory plan's
    allowance, its shares for a logits block and an attention call) are as big."""
    r = plan_json(K3, "--bits", "4", "--dtype", "bfloat16", *MAC_64GB, "--budget", budget)
    assert r["scoring_pass_tokens"] >= tokens


def test_k3_as_loaded_prefills_30000_tokens_in_one_pass_given_the_context(k3_inventory):
    r = plan_json(K3, "--bits", "4", "--dtype", "bfloat16", *MAC_64GB)
    # At the default context a 30,000-token prompt cannot run: no projection.
    assert r["prefill_needs_context"] == [30_000]
    assert [p["prompt_tokens"] for p in r["prefill_projection"]] == [300, 3000]
    r = plan_json(K3, "--bits", "4", "--dtype", "bfloat16", *MAC_64GB, "--context", 32768)
    thirty = next(p for p in r["prefill_projection"] if p["prompt_tokens"] == 30_000)
    assert thirty["passes"] == 1 and r["prefill_needs_context"] == []


def test_plan_says_what_context_a_longer_prompt_needs(k3_inventory):
    out = subprocess.run([sys.executable, "-m", "deltafin_mlx.cli.main", "plan", str(K3),
                          "--bits", "4", "--dtype", "bfloat16", *MAC_64GB],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "30,000 tokens: needs --context 30000 or more" in out.stdout


def test_a_pass_and_what_it_keeps_fit_the_budget(k3_inventory):
    for budget, context in (("4GB", 4096), ("12GB", 30_000), ("56GB", 30_000)):
        plan = plan_memory(k3_inventory, budget, context=context)
        p = pass_plan(k3_inventory, plan)
        for prompt in (300, context):
            n = p.prefill_tokens(k3_inventory, prompt)
            held = (p.trunk_bytes + p.expert_group_bytes + p.logits_bytes + p.fixed_bytes
                    + p.state_bytes(k3_inventory, prompt) + n * p.token_bytes)
            assert held <= plan.budget, (budget, prompt)


def test_a_longer_prompt_leaves_its_passes_fewer_tokens(k3_inventory):
    """The KV/state a prompt keeps comes out of its passes' room."""
    p = pass_plan(k3_inventory, plan_memory(k3_inventory, "12GB"))
    assert p.prefill_tokens(k3_inventory, 30_000) < p.prefill_tokens(k3_inventory, 300)


def test_the_trunk_stays_whole_where_that_costs_a_pass_nothing(converted):
    """A small model at a budget that holds everything: the pass reaches its cap
    with the trunk resident, so the trunk is not read per pass."""
    r = plan_json(converted("kimi_k3"), "--budget", "2GB", "--disk-gbps", "2",
                  "--compute-gwps", "3")["passes"]
    assert not r["trunk_streamed"] and r["scoring"]["trunk_read_bytes"] == 0
    assert r["scoring_tokens"] > r["attention_step"]


def test_k3_batch_auto_takes_the_sequences_its_state_memory_allows(k3_inventory):
    """About 449 MB of recurrent state per sequence: at 56 GB, 47 sequences (half of
    the memory above the floor), past mlx-lm's default batch of 32."""
    r = plan_json(K3, "--bits", "4", "--dtype", "bfloat16", *MAC_64GB, "--sequences", "auto")
    assert r["sequences"] == r["auto_sequences"] > 32
    per = r["sequence_recurrent_bytes"] + r["sequence_kv_bytes"]
    assert r["auto_sequences"] * per <= r["budget_bytes"] - r["floor_bytes"]
