"""Below the whole trunk: layers of the same shape stream through shared buffers and
embedding rows are read on demand — and the tokens and logits stay exactly
mlx-lm's, at every budget down to the floor."""

import mlx.core as mx
import pytest
from mlx_lm.utils import load_config

from helpers import make_source, reference_model
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.plan.footprint import inventory_from_manifest
from deltafin_mlx.engine.load import load
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.plan.memory import BudgetError, plan_memory
from deltafin_mlx.testing.decode import greedy, load_resident
from test_runtime import prompt_of

from deltafin_mlx import runtime


@pytest.fixture(scope="module", params=["kimi_k3", "qwen3_moe"])
def model_and_reference(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    # K3 with 8 layers: five KDA+MoE layers share a shape (streamable), two MLA ones.
    src = make_source(root / "src", arch, **({"num_layers": 8} if arch == "kimi_k3" else {}))
    out = root / "out"
    convert(str(src), out, ConvertOptions(progress=False))
    return out, reference_model(src)


def budgets_of(path):
    """The floor, and budgets that pin more and more of the trunk."""
    m = read_manifest(path)
    inv = inventory_from_manifest(m, load_config(path), mx.float32)
    floor = plan_memory(inv, 1 << 40).floor
    unit = max(u.memory_bytes for k, u in inv.units.items() if k != "globals")
    return [floor, floor + unit, floor + 2 * unit + 3 * inv.slot_bytes]


def test_floor_streams_trunk_layers_and_embedding_rows(model_and_reference):
    path, _ = model_and_reference
    floor = budgets_of(path)[0]
    model, _ = load(path, memory_budget=floor, tokenizer=False)
    plan = runtime(model).plan
    assert len(plan.streamed) >= 3 and plan.embed_on_demand
    assert plan.slots == plan.experts_per_token
    assert plan.used_bytes <= floor
    runtime(model).close()


def test_every_budget_down_to_the_floor_gives_mlx_lm_tokens_and_logits(model_and_reference):
    path, reference = model_and_reference
    ref_tokens, ref_logits = greedy(reference, prompt_of(10), 12)
    ref2_tokens, ref2_logits = greedy(reference, prompt_of(20, batch=2, seed=1), 6)
    streamed_counts = []
    for budget in budgets_of(path):
        model, _ = load(path, memory_budget=budget, tokenizer=False)
        streamed_counts.append(len(runtime(model).plan.streamed))
        tokens, logits = greedy(model, prompt_of(10), 12)
        assert (tokens == ref_tokens).all(), budget
        assert mx.array_equal(logits, ref_logits).item(), budget
        tokens, logits = greedy(model, prompt_of(20, batch=2, seed=1), 6)
        assert (tokens == ref2_tokens).all(), budget
        assert mx.array_equal(logits, ref2_logits).item(), budget
        assert runtime(model).trunk is None or runtime(model).trunk.bytes_read > 0
        runtime(model).close()
    assert streamed_counts[0] > streamed_counts[-1] or streamed_counts[-1] == 0
    assert streamed_counts[0] >= 3


def test_budget_below_the_floor_is_refused_stating_it(model_and_reference):
    path, _ = model_and_reference
    floor = budgets_of(path)[0]
    with pytest.raises(BudgetError, match=rf"below this model's floor of [0-9.]+ [KMGT]?B \({floor} bytes"):
        load(path, memory_budget=floor - 1, tokenizer=False)


def test_at_the_models_dtype_the_floor_gives_its_resident_tokens_and_logits(
        model_and_reference):
    """--activation-dtype model: trunk layers and embedding rows stream in their saved
    dtype, bit for bit the model held whole as mlx-lm holds it (nothing cast)."""
    path, _ = model_and_reference
    m = read_manifest(path)
    floor = plan_memory(inventory_from_manifest(m, load_config(path), mx.bfloat16),
                        1 << 40).floor
    want, want_logits = greedy(load_resident(path, activation_dtype="model"), prompt_of(10), 8)
    model, _ = load(path, memory_budget=floor, tokenizer=False, activation_dtype="model")
    try:
        assert runtime(model).plan.streamed and runtime(model).plan.embed_on_demand
        tokens, logits = greedy(model, prompt_of(10), 8)
    finally:
        runtime(model).close()
    assert m.dtype == "bfloat16" and logits.dtype == mx.bfloat16
    assert (tokens == want).all() and mx.array_equal(logits, want_logits).item()
