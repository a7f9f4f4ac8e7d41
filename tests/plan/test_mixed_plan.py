"""A model mlx-lm's mixed_3_6 recipe quantized (down_proj at 6 bits in some layers,
3 in the others) is planned with each layer's own record: its slots, disk and floor
equal a hand computation, and the cache the runtime allocates is the plan's."""

import json
import math

import mlx.core as mx
import pytest

from deltafin_mlx import runtime
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.engine.load import load
from deltafin_mlx.errors import BudgetError
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.plan.footprint import inventory_from_config, inventory_from_manifest
from deltafin_mlx.plan.memory import plan_memory
from deltafin_mlx.testing.mlx_lm_format import write_mlx_lm_format

from helpers import run_command

ALIGN = 4096


def affine(out_dim, in_dim, bits, scale_size):
    """(bytes in memory, bytes on disk) of an affine group-64 matrix: packed words,
    scales and biases (bf16 on disk, `scale_size` bytes in memory)."""
    words = out_dim * in_dim * bits // 32 * 4
    groups = out_dim * (in_dim // 64)
    pad = lambda n: -(-n // ALIGN) * ALIGN  # noqa: E731 (each section is aligned on disk)
    return words + 2 * groups * scale_size, pad(words) + 2 * pad(groups * 2)


@pytest.fixture(scope="module")
def mixed(sources, tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    src = write_mlx_lm_format(sources("qwen3_moe"), root / "src", 4, recipe="mixed_3_6")
    convert(str(src), root / "out", ConvertOptions(progress=False))
    return src, root / "out"


def hand(config, down_bits):
    """Per MoE layer (slot bytes at float32 activations, record bytes)."""
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    out = {}
    for layer, bits in down_bits.items():
        parts = [affine(inter, hidden, 3, 4), affine(inter, hidden, 3, 4),
                 affine(hidden, inter, bits, 4)]
        out[layer] = (sum(m for m, _ in parts), sum(d for _, d in parts))
    return out


def test_a_mixed_model_is_planned_with_each_layers_record(mixed):
    src, out = mixed
    config = json.loads((src / "config.json").read_text())
    q = config["quantization"]
    down = {i: q[f"model.layers.{i}.mlp.switch_mlp.down_proj"]["bits"]
            for i in range(config["num_hidden_layers"])}
    assert set(down.values()) == {3, 6}
    layers = hand(config, down)
    L, E, k = len(layers), config["num_experts"], config["num_experts_per_tok"]
    slot = math.ceil(sum(m for m, _ in layers.values()) / L)  # equal slots per layer
    for inv in (inventory_from_config(config, mx.float32),
                inventory_from_manifest(read_manifest(out), config, mx.float32)):
        assert inv.slot_bytes == slot
        assert inv.record_size == max(d for _, d in layers.values())  # the reader's buffer
        assert inv.expert_disk_bytes == E * sum(d for _, d in layers.values())
        low = plan_memory(inv, 1 << 30, context=256, max_slots=E * L // 2 + 1)
        assert low.slots == E * L // 2  # whole partitions: a multiple of the layers
        assert low.cache_bytes == low.slots * slot and low.pass_slots == 0
        assert low.floor_parts["one token's experts in each layer"] == k * L * slot
    assert sum(d for _, d in layers.values()) * E == sum(
        size for rel, size in read_manifest(out).files.items() if rel.endswith(".bank")) - L * ALIGN


def test_the_runtime_allocates_the_plans_cache_and_refuses_less_than_every_layer_needs(mixed):
    src, out = mixed
    config = json.loads((src / "config.json").read_text())
    L, E, k = config["num_hidden_layers"], config["num_experts"], config["num_experts_per_tok"]
    model, _ = load(out, cache_slots=E * L // 4, tokenizer=False, activation_dtype=mx.float32)
    try:
        rt = runtime(model)
        held = sum(a.nbytes for arrays in rt.cache.chunk_arrays for a in arrays.values())
        # Each layer's share of slots in its own layout: the layers' sum, never more
        # than the plan counted.
        q = config["quantization"]
        down = {i: q[f"model.layers.{i}.mlp.switch_mlp.down_proj"]["bits"] for i in range(L)}
        layers = hand(config, down)
        assert held == E // 4 * sum(m for m, _ in layers.values()) <= rt.plan.cache_bytes
    finally:
        rt.close()
    with pytest.raises(BudgetError, match=f"need at least {k * L} cache slots"):
        load(out, cache_slots=k * L - 1, tokenizer=False)


def test_plan_reports_a_set_of_slot_arrays_per_layout_and_the_records_on_disk(mixed):
    src, out = mixed
    for target in (src, out):  # from config.json, and converted
        p = run_command(["plan", str(target), "--json", "--disk-gbps", "2", "--compute-gwps",
                         "3", "--context", "256"])
        assert p.returncode == 0, p.stderr
        r = json.loads(p.stdout)
        assert r["expert_cache_arrays"] == 2  # 3-bit down_proj layers, 6-bit ones
        assert r["expert_bytes_on_disk"] == sum(
            size for rel, size in read_manifest(out).files.items() if rel.endswith(".bank")
        ) - len(read_manifest(out).moe_layers) * ALIGN
