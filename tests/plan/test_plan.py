"""deltafin-run plan: Kimi K3's sizes from its real config.json agree with figures
computed by hand from CHECKPOINT.md, its floor at 4K context is at most 8 GB, and
a converted model plans without loading its weights."""

import json
import subprocess
import sys

import pytest

from deltafin_mlx.cli.main import main
from deltafin_mlx import runtime
from deltafin_mlx.testing.kimi_k3 import CONFIG as K3_CONFIG, EXPERT, STATE_4K

GB = 1e9


def q4(out_dim, in_dim):
    """A 4-bit, group-64 affine matrix: packed weight + bf16 scales and biases."""
    return out_dim * in_dim // 2 + 2 * out_dim * (in_dim // 64) * 2


def q8(out_dim, in_dim):
    return out_dim * in_dim + 2 * out_dim * (in_dim // 64) * 2


def bf16(n):
    return 2 * n


# From CHECKPOINT.md, at 4 bits with bf16 activations (an Apple GPU):
NORMS_AND_RES = 4 * bf16(7168) + 2 * bf16(7168)  # 4 norms; res projs [1, 7168] stay bf16
KDA = (q4(3 * 12288, 7168)  # q, k, v fused by mlx-lm's sanitize
       + bf16(3 * 12288 * 4)  # the three short convolutions, fused
       + q4(128, 7168) + q4(12288, 128) + q4(96, 7168) + q4(12288, 7168)  # f_a, f_b, b, g
       + 4 * 96 + 4 * 12288  # A_log (96 heads, padding dropped), dt_bias: float32
       + bf16(128) + q4(7168, 12288))  # o_norm, o_proj
MLA = (q4(1536, 7168) + bf16(1536) + q4(18432, 1536) + q4(576, 7168) + bf16(512)
       # kv_b_proj [24576, 512], split by mlx-lm's sanitize into embed_q (96, 512, 128)
       # and unembed_out (96, 128, 512): the same number of weights and groups.
       + q4(24576, 512)
       + q4(12288, 7168) + q4(7168, 12288))  # g_proj, o_proj
MOE = (q8(896, 7168) + 4 * 896  # router (8 bits, as mlx-lm quantizes it), score bias
       + q4(3584, 7168) + q4(7168, 3584) + bf16(3584)  # latent down, up, norm
       + 2 * q4(6144, 7168) + q4(7168, 6144))  # shared experts
DENSE = 2 * q4(33792, 7168) + q4(7168, 33792)


def plan_json(*args):
    out = subprocess.run([sys.executable, "-m", "deltafin_mlx.cli.main", "plan", *map(str, args),
                          "--json", "--disk-gbps", "5", "--compute-gwps", "400"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def k3():
    return plan_json(K3_CONFIG, "--bits", "4", "--activation-dtype", "bfloat16", "--budget", "16GB")


def test_k3_expert_record_and_totals_match_the_checkpoint(k3):
    assert k3["expert_record_bytes"] == EXPERT
    assert k3["experts_total"] == 92 * 896
    assert k3["expert_bytes_on_disk"] == 92 * 896 * EXPERT


def test_k3_trunk_layers_match_hand_computed_sizes(k3):
    from deltafin_mlx.plan.footprint import inventory_from_config
    import mlx.core as mx

    inv = inventory_from_config(json.loads(K3_CONFIG.read_text()), mx.bfloat16, bits=4)
    assert inv.units["1"].memory_bytes == NORMS_AND_RES + KDA + MOE  # KDA + MoE layer
    assert inv.units["3"].memory_bytes == NORMS_AND_RES + MLA + MOE  # MLA + MoE layer
    assert inv.units["0"].memory_bytes == NORMS_AND_RES + KDA + DENSE  # layer 0: dense MLP
    embed = q4(163840, 7168)
    assert inv.embed_bytes == embed
    assert inv.units["globals"].memory_bytes == 2 * embed + 3 * bf16(7168)  # + norms, res proj
    assert k3["trunk_bytes"] == sum(u.memory_bytes for u in inv.units.values())
    assert k3["state_bytes"] == STATE_4K


def test_k3_floor_at_4k_context_is_at_most_8_gb(k3):
    layer = NORMS_AND_RES + KDA + MOE
    mla_layer = NORMS_AND_RES + MLA + MOE
    resident = NORMS_AND_RES + KDA + DENSE + q4(163840, 7168) + 3 * bf16(7168)
    buffers = 2 * layer + 2 * mla_layer
    experts = 16 * EXPERT
    # The working buffers hold the smallest prefill pass (16 tokens) and its chunk.
    from deltafin_mlx.plan.footprint import inventory_from_config
    from deltafin_mlx.plan.memory import min_prefill_bytes
    import mlx.core as mx

    config = json.loads(K3_CONFIG.read_text())
    moe = inventory_from_config(config, mx.bfloat16, bits=4).moe
    pass_16 = min_prefill_bytes(config, moe, 4096, mx.bfloat16)
    assert k3["floor_parts"]["working buffers"] == k3["working_bytes"] + pass_16
    assert k3["floor_bytes"] == (resident + buffers + STATE_4K + k3["working_bytes"] + pass_16
                                 + experts)
    assert k3["floor_bytes"] <= 8 * GB


def test_k3_plan_streams_most_layers_at_16_gb_and_states_a_projection(k3):
    assert k3["embedding_on_demand"]
    assert len(k3["streamed_layers"]) > 40 and 0 in k3["pinned_layers"]
    p = k3["projection"]
    assert 100e9 < p["weights_per_token"] < 110e9  # "about 104B active per token"
    assert 0 < p["tokens_per_second_serial"] <= p["tokens_per_second_overlapped"]


def test_budget_below_the_k3_floor_is_refused_stating_the_floor(k3, capsys):
    code = main(["plan", str(K3_CONFIG), "--activation-dtype", "bfloat16", "--budget", "2GB",
                 "--disk-gbps", "5", "--compute-gwps", "400"])
    err = capsys.readouterr().err
    assert code == 1 and "below this model's floor of 3.4" in err


def test_the_floor_error_says_that_a_smaller_context_lowers_the_floor(k3, capsys):
    """At the floor of 4,096 tokens of context, 65,536 is refused, saying that a
    smaller --context lowers the floor; and 4,096 indeed runs at that budget."""
    argv = ["plan", str(K3_CONFIG), "--activation-dtype", "bfloat16", "--disk-gbps", "5",
            "--compute-gwps", "400", "--budget", str(k3["floor_bytes"])]
    assert main(argv + ["--context", "65536"]) == 1
    err = capsys.readouterr().err
    assert "below this model's floor" in err and err.strip().endswith(
        "; a smaller --context lowers it")
    assert main(argv + ["--context", "4096"]) == 0


def test_plan_of_a_converted_model_matches_what_load_does(converted):
    from deltafin_mlx.engine.load import load

    r = plan_json(converted("kimi_k3"), "--budget", "50MB")
    model, _ = load(converted("kimi_k3"), memory_budget="50MB", tokenizer=False)
    plan = runtime(model).plan
    assert r["floor_bytes"] == plan.floor and r["expert_cache_slots"] == plan.slots
    assert r["streamed_layers"] == sorted(int(k) for k in plan.streamed)
    runtime(model).close()


def test_plan_text_output_names_every_part(converted, capsys):
    assert main(["plan", str(converted("kimi_k3")), "--disk-gbps", "2", "--compute-gwps", "3"]) == 0
    out = capsys.readouterr().out
    for word in ("floor", "pinned", "streamed", "KV/state", "cache", "tok/s"):
        assert word in out


def test_plan_measures_disk_and_compute_when_not_given(converted):
    from deltafin_mlx.plan.rates import measure_compute_gwps, measure_disk_gbps

    assert measure_disk_gbps(nbytes=32 << 20, block=4 << 20) > 0.01
    assert measure_compute_gwps(dim=1024) > 0.01


def test_k3_expert_cache_goes_past_one_mlx_array(k3):
    """MLX dimensions are int32: one slot array holds at most 2**31 - 1 - 4096
    elements, so at 3072 x 448 uint32 per K3 gate weight, 1560 slots (27 GB). A
    200 GB budget buys more, in several sets of slot arrays, and plan says so."""
    r = plan_json(K3_CONFIG, "--bits", "4", "--activation-dtype", "bfloat16", "--budget", "200GB")
    assert r["expert_slots_per_array"] == (2**31 - 1 - 4096) // (3072 * 448) == 1560
    assert r["expert_cache_slots"] > 1560
    assert r["expert_cache_bytes"] > 150 * GB
    assert r["expert_cache_arrays"] > 1
    assert r["expert_pool_limit_slots"] == r["experts_total"]
