"""mlx-lm's DWQ from a teacher streamed through the drop-in (issue 41): `mlx_lm dwq
--model CONVERTED --trust-remote-code --target-dir T --targets-only` writes the
targets (top-1024 logits and their ids per position) that mlx-lm's own teacher
fully in memory writes, each batch one pass reading each routed expert once; then
`--quantized-model STUDENT --target-dir T` trains the student from those files
alone, the teacher never loaded. No network: the data is a local directory of
JSONL that `datasets` reads (dwq's --data-path goes to `datasets.load_dataset`).

The teacher is a tiny 8-bit Qwen3-MoE as mlx_lm.convert writes it (its vocabulary of
2048 ids, more than the 1024 DWQ keeps, so the top-1024 is a real choice); the
student the same model at 4 bits. mlx-lm's in-memory teacher is compared at
float32, as the drop-in computes on MLX's CPU backend (engine/load.py's "auto"
activation dtype)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.testing import zoo

SIZES = {"vocab_size": 2048, "num_experts": 64, "moe_intermediate_size": 512}
OFF = 1.3  # the student's trainable scales, times the quantizer's (set_off)
SEED, SAMPLES, BATCH, MAX_LENGTH = 123, 8, 2, 65  # dwq's own seed; 4 batches of 2
# At 20 MB the expert cache holds 11 of the 128 experts (64 in each of 2 layers), so
# every batch streams.
DROPIN_ENV = {"DELTAFIN_BUDGET": "20MB", "DELTAFIN_CONTEXT": "256"}
WORDS = ("the experts stream from disk while the trunk stays in memory and every "
         "token routes to a few of them 12 34 def route(x): return x").split()


@pytest.fixture(scope="module")
def dwq_models(tmp_path_factory):
    """The teacher as mlx-lm saved it (`src`), its conversion, the 4-bit student and
    a local dataset of 16 texts."""
    root = tmp_path_factory.mktemp("dwq")
    src = zoo.write(root / "teacher", "qwen3_moe", bits=8, sizes=SIZES)
    student = zoo.write(root / "student", "qwen3_moe", bits=4, sizes=SIZES)
    set_off(student)
    convert(str(src), root / "converted", ConvertOptions(progress=False))
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    (data / "train.jsonl").write_text("".join(
        json.dumps({"text": " ".join(rng.choice(WORDS, size=int(rng.integers(8, 30))))}) + "\n"
        for _ in range(16)))
    return {"src": src, "converted": root / "converted", "student": student, "data": data,
            "root": root}


def set_off(student):
    """Every scale DWQ trains (the 4-bit layers'; the 8-bit router stays frozen) made
    30% too large. A student fresh from quantization sits near its optimum, where four
    Adam steps land on either side by the machine's rounding (a CI machine once saw
    0.019 -> 0.032 at 1e-3, where this one sees 0.057 -> 0.046); from 30% off, the loss
    the steps remove is far larger than what rounding moves (0.096 -> 0.073 here)."""
    quant = json.loads((student / "config.json").read_text())["quantization"]
    frozen = {k + ".scales" for k, v in quant.items() if isinstance(v, dict) and v["bits"] >= 8}
    weights = mx.load(str(student / "model.safetensors"))
    mx.save_safetensors(str(student / "model.safetensors"), {
        k: v * OFF if k.endswith(".scales") and k not in frozen else v
        for k, v in weights.items()}, metadata={"format": "mlx"})


def offline_env(root, **extra):
    """No network: the hub and datasets offline, their caches in the test's directory."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(root / "hf_home"), **extra}


def mlx_lm_dwq(models, *args, **env):
    cmd = [str(Path(sys.executable).parent / "mlx_lm"), "dwq", "--model",
           str(models["converted"]), "--trust-remote-code", "--data-path", str(models["data"]),
           "--num-samples", str(SAMPLES), "--batch-size", str(BATCH),
           "--max-seq-length", str(MAX_LENGTH), "--seed", str(SEED), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=offline_env(models["root"], **env))
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout + p.stderr


@pytest.fixture(scope="module")
def streamed_targets(dwq_models):
    """`mlx_lm dwq ... --targets-only` through the drop-in at a streaming budget."""
    targets = dwq_models["root"] / "targets"
    mlx_lm_dwq(dwq_models, "--target-dir", str(targets), "--targets-only", **DROPIN_ENV)
    return targets


def dwq_data(models):
    """dwq's train and valid samples, drawn as its main() draws them."""
    from mlx_lm.quant.dwq import load_data
    from mlx_lm.utils import load_tokenizer

    np.random.seed(SEED)
    return load_data(load_tokenizer(models["converted"]), str(models["data"]), SAMPLES,
                     MAX_LENGTH)


def test_dwq_targets_through_the_drop_in_equal_mlx_lms_in_memory_teachers(
        dwq_models, streamed_targets, tmp_path):
    import mlx_lm
    from mlx_lm.quant.dwq import compute_dwq_targets

    model, _ = mlx_lm.load(str(dwq_models["src"]))
    model.set_dtype(mx.float32)
    train, valid = dwq_data(dwq_models)
    compute_dwq_targets(model, tmp_path / "want", train, valid, BATCH, MAX_LENGTH, SEED)
    for split in ("train", "valid"):
        want = sorted(p.name for p in (tmp_path / "want" / split).glob("*.safetensors"))
        got = sorted(p.name for p in (streamed_targets / split).glob("*.safetensors"))
        assert got == want and len(want) == SAMPLES // BATCH, (split, got, want)
        for name in want:
            a = mx.load(str(tmp_path / "want" / split / name))
            b = mx.load(str(streamed_targets / split / name))
            assert b["indices"].shape[-1] == 1024 < zoo.vocab(dwq_models["src"])
            assert b["logits"].shape == a["logits"].shape
            assert mx.array_equal(b["indices"], a["indices"]).item(), (split, name)
            assert mx.allclose(b["logits"], a["logits"], rtol=0, atol=1e-4).item(), (split, name)


# One run of dwq's own target loop on the drop-in's model, in a fresh interpreter
# (loading through mlx-lm patches it: dropin/shim.py), each batch's call observed.
COUNTED = """
import json, sys
from pathlib import Path
import mlx.core as mx, mlx_lm, numpy as np
from mlx_lm.quant.dwq import compute_dwq_targets, load_data
from mlx_lm.utils import load_tokenizer
from deltafin_mlx import runtime

converted, data, out = map(Path, sys.argv[1:4])
seed, samples, batch, length = map(int, sys.argv[4:8])
np.random.seed(seed)
train, valid = load_data(load_tokenizer(converted), str(data), samples, length)
model, _ = mlx_lm.load(str(converted), trust_remote_code=True)
state = runtime(model._inner)
record = state.manifest.experts["record_size"]
batches = []

def counted(tokens):
    routed, layers = set(), []
    s = state.stats
    before = (s.hits, s.misses, state.store.bytes_read)
    with state.observe(on_route=lambda l, idx: routed.update((l, int(e)) for e in np.unique(idx)),
                       on_pass_layer=lambda done, of: layers.append([done, of])):
        logits = model(tokens)
        mx.eval(logits)
    batches.append({"hits": s.hits - before[0], "misses": s.misses - before[1],
                    "records_read": (state.store.bytes_read - before[2]) / record,
                    "routed": len(routed), "pass_layers": layers})
    return logits

compute_dwq_targets(counted, out, train, valid, batch, length, seed)
print(json.dumps({"batches": batches, "cache_slots": state.plan.slots,
                  "moe_layers": len(state.manifest.moe_layers)}))
"""


def test_each_dwq_batch_is_one_pass_reading_each_routed_expert_once(dwq_models, tmp_path):
    p = subprocess.run(
        [sys.executable, "-c", COUNTED, str(dwq_models["converted"]), str(dwq_models["data"]),
         str(tmp_path / "targets"), str(SEED), str(SAMPLES), str(BATCH), str(MAX_LENGTH)],
        capture_output=True, text=True, timeout=600,
        env=offline_env(dwq_models["root"], **DROPIN_ENV))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    n = out["moe_layers"]
    assert len(out["batches"]) == 2 * SAMPLES // BATCH  # valid, then train
    for b in out["batches"]:
        # One pass: each MoE layer computed once, in order.
        assert b["pass_layers"] == [[i + 1, n] for i in range(n)], b
        # Each (layer, expert) the batch routes to is found once: resident, or read.
        assert b["hits"] + b["misses"] == b["routed"], b
        assert b["records_read"] == b["misses"] > 0, b
        assert b["routed"] > out["cache_slots"], b  # more than the cache holds


def test_a_student_trains_from_the_streamed_targets_alone(dwq_models, streamed_targets):
    """The training run reads the targets, never the teacher: a budget below the
    teacher's floor would make the drop-in refuse to load it. From 30% off, its
    validation loss falls."""
    before = mx.load(str(dwq_models["student"] / "model.safetensors"))
    out_dir = dwq_models["root"] / "distilled"
    log = mlx_lm_dwq(dwq_models, "--quantized-model", str(dwq_models["student"]),
                     "--target-dir", str(streamed_targets), "--mlx-path", str(out_dir),
                     "--learning-rate", "3e-4", DELTAFIN_BUDGET="1MB")
    losses = [float(v) for v in re.findall(r"Validation: it=\d+, loss=([0-9.]+)", log)]
    assert len(losses) == 2 and losses[-1] < losses[0], log[-2000:]
    assert "worse than initial validation loss" not in log
    after = mx.load(str(out_dir / "model.safetensors"))
    trained = [k for k in before if k.endswith(".scales")
               and not mx.array_equal(before[k], after[k]).item()]
    assert trained, "no scale changed"
    packed = [k[:-len("scales")] + "weight" for k in before if k.endswith(".scales")]
    assert all(mx.array_equal(before[k], after[k]).item() for k in packed)  # the bits stay
    assert "model_file" not in json.loads((out_dir / "config.json").read_text())
