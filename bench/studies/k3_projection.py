"""Kimi K3 projection: per-layer decode times measured here at K3's real widths,
extended to the full model (93 layers), next to the I/O its experts need.

A generated K3-layout model at K3's real dimensions (hidden 7168; KDA attention
with 96 heads of 128; gated MLA with q_lora 1536, kv_lora 512, 96 heads; latent
MoE 7168 -> 3584 with 16 MXFP4 experts of 3584x3072 per token; two shared experts
6144 wide; dense SiTU MLP 33792 wide in layer 0), with 3 decoder layers
(0: KDA + dense, 1: KDA + MoE, 2: MLA + MoE) and 16 experts per layer (all 16 are
used by every token, as K3 uses 16 of its 896), converted with deltafin-convert's
defaults (trunk 4-bit affine, experts MXFP4 as released), run fully in memory by
mlx-lm's own kimi_k3 code on this CPU with an evaluation barrier after every
attention and every MLP/MoE block. K3's lm_head (163,840 x 7168) and its 896-way
router are timed as single quantized matmuls of their real shapes.

    python -m bench.studies.k3_projection [--workdir /tmp/deltafin-bench]
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.common import K3_RECORD_SIZE, ROOT, drop_caches, ensure_model, log

K3 = dict(layers=93, moe_layers=92, kda_moe_layers=68, mla_moe_layers=24, experts=896, k=16,
          hidden=7168, vocab=163840, record_size=K3_RECORD_SIZE)
K3_WIDTH = dict(
    hidden_size=7168, num_layers=3, intermediate_size=33792, num_experts=16,
    experts_per_token=16, routed_expert_hidden_size=3584, moe_intermediate_size=3072,
    vocab_size=1024, num_attention_heads=96, num_key_value_heads=96, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    num_shared_experts=2, kda_num_heads=96, kda_head_dim=128, attn_res_block_size=12,
)


# --- measuring (in a fresh process) -------------------------------------------


def measure(model_dir: str, tokens: int = 6, warmup: int = 2, reps: int = 9) -> dict:
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from deltafin_mlx.testing.decode import load_resident

    t = time.perf_counter()
    model = load_resident(model_dir)
    load_s = time.perf_counter() - t
    layers = model.language_model.model.layers
    times = {}
    ev = mx.eval

    def barrier(module, key):
        base = type(module)

        def __call__(self, *a, **k):
            out = base.__call__(self, *a, **k)
            t0 = time.perf_counter()
            ev(out)
            times.setdefault(key, []).append(time.perf_counter() - t0)
            return out

        module.__class__ = type(f"Timed{base.__name__}", (base,), {"__call__": __call__})

    kinds = {}
    for i, layer in enumerate(layers):
        attn = "kda" if layer.is_linear else "mla"
        mlp = "moe" if hasattr(layer.mlp, "switch_mlp") else "dense"
        kinds[i] = (attn, mlp)
        barrier(layer.self_attn, f"{i}.attn")
        barrier(layer.mlp, f"{i}.mlp")

    cache = make_prompt_cache(model)
    prompt = mx.array(np.arange(1, 5, dtype=np.int32)[None])
    logits = model(prompt, cache=cache)[:, -1]
    ev(logits)
    step_s, tail_s = [], []
    for i in range(warmup + tokens):
        if i == warmup:
            times.clear()
        y = mx.argmax(logits, axis=-1)
        t0 = time.perf_counter()
        logits = model(y[:, None], cache=cache)[:, -1]
        t1 = time.perf_counter()
        ev(logits)
        t2 = time.perf_counter()
        if i >= warmup:
            step_s.append(t2 - t0)
            tail_s.append(t2 - t1)  # after the last barrier: final mix, norm, head
    med = {k: float(np.median(v)) for k, v in times.items()}

    def bench(fn, *args):
        out = fn(*args)
        ev(out)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            ev(fn(*args))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    # Components of one MoE block (layer 1), each evaluated on its own.
    moe = layers[1].mlp
    x = mx.random.normal((1, 1, K3["hidden"])).astype(mx.float32)
    z = mx.random.normal((1, 1, 3584)).astype(mx.float32)
    inds = mx.arange(16, dtype=mx.uint32).reshape(1, 1, 16)
    ev(x, z, inds)
    comp = {
        "router_gate_16": bench(moe.gate, x),
        "latent_down_7168_to_3584": bench(moe.routed_expert_down_proj, x),
        "routed_experts_16_of_3584x3072_mxfp4": bench(moe.switch_mlp, z, inds),
        "shared_experts_6144": bench(moe.shared_experts, x),
        "latent_up_3584_to_7168": bench(moe.routed_expert_up_proj, z),
    }
    # K3-sized matmuls the 3-layer model does not have.
    def qmm_weights(out_dim, in_dim, bits, group):
        w = mx.random.randint(0, 2**31, (out_dim, in_dim * bits // 32)).astype(mx.uint32)
        s = mx.random.uniform(shape=(out_dim, in_dim // group)).astype(mx.float32) * 1e-2
        b = mx.random.uniform(shape=(out_dim, in_dim // group)).astype(mx.float32) * 1e-3
        ev(w, s, b)
        return w, s, b

    def qmm(w, s, b, bits, group):
        return lambda v: mx.quantized_matmul(v, w, s, b, transpose=True, group_size=group,
                                             bits=bits)

    w, s, b = qmm_weights(K3["experts"], K3["hidden"], 8, 64)
    comp["router_gate_896"] = bench(qmm(w, s, b, 8, 64), x)
    del w, s, b
    w, s, b = qmm_weights(K3["vocab"], K3["hidden"], 4, 64)
    comp["lm_head_163840"] = bench(qmm(w, s, b, 4, 64), x)
    del w, s, b
    return {
        "load_s": load_s,
        "kinds": {str(k): v for k, v in kinds.items()},
        "block_s": med,
        "step_s": float(np.median(step_s)),
        "tail_s": float(np.median(tail_s)),
        "components_s": comp,
        "tokens": tokens,
        "context_tokens": 4 + warmup + tokens,
    }


# --- projecting ---------------------------------------------------------------


def trunk_bytes_by_layer(model_dir: Path) -> dict:
    """In-memory trunk bytes (floats at float32, as the runtime holds them on
    this CPU) per decoder layer index and for 'globals', from the manifest."""
    import mlx.core as mx

    m = json.loads((model_dir / "deltafin.json").read_text())
    try:
        from deltafin_mlx.plan.memory import tensor_bytes
    except ImportError:  # pragma: no cover - fall back to a plain size estimate
        def tensor_bytes(info, dt):
            n = 1
            for s in info["shape"]:
                n *= s
            return n * (4 if info["dtype"] in ("float32", "bfloat16", "float16", "uint32") else 1)
    out = {}
    for name, info in m["tensors"].items():
        g = re.search(r"\blayers\.(\d+)\.", name)
        key = g.group(1) if g else "globals"
        sub = "gate" if re.search(r"\.mlp\.gate\.", name) else "rest"
        out.setdefault(key, {}).setdefault(sub, 0)
        out[key][sub] += tensor_bytes(info, mx.float32)
    return out


def project(workdir: Path, disk: dict, mode: str = "quick", drops: bool = True) -> dict:
    """Generate (once) the K3-width model, measure it in a fresh process, project."""
    model = ensure_model(workdir, "k3-width-l3-e16", K3_WIDTH)
    if drops:
        drop_caches()
    log("K3 projection: timing blocks of the K3-width model (fresh process)")
    n = {"quick": ["--tokens", "4", "--reps", "5"], "full": ["--tokens", "8", "--reps", "9"]}
    cmd = [sys.executable, "-m", "bench.studies.k3_projection", "--measure", str(model)] + n[mode]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), timeout=900)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode or not lines:
        log(f"K3 projection failed: {p.stderr[-1500:]}")
        return {"status": "failed", "stderr_tail": p.stderr[-1500:]}
    meas = json.loads(lines[-1])
    b, c = meas["block_s"], meas["components_s"]
    kda_attn = b["1.attn"]
    mla_attn = b["2.attn"]
    moe = (b["1.mlp"] + b["2.mlp"]) / 2
    gate_extra = c["router_gate_896"] - c["router_gate_16"]
    layer0 = b["0.attn"] + b["0.mlp"]
    head = c["lm_head_163840"]
    compute = (layer0 + K3["kda_moe_layers"] * (kda_attn + moe + gate_extra)
               + K3["mla_moe_layers"] * (mla_attn + moe + gate_extra) + head + meas["tail_s"])
    experts_part = K3["moe_layers"] * c["routed_experts_16_of_3584x3072_mxfp4"]

    # Memory: the trunk at K3's size, from the K3-width model's per-layer bytes.
    tb = trunk_bytes_by_layer(model)
    per = {k: sum(v.values()) for k, v in tb.items()}
    gate_scale = K3["experts"] / K3_WIDTH["num_experts"]
    kda_moe_layer = tb["1"]["rest"] + tb["1"].get("gate", 0) * gate_scale
    mla_moe_layer = tb["2"]["rest"] + tb["2"].get("gate", 0) * gate_scale
    globals_k3 = per["globals"] * K3["vocab"] / K3_WIDTH["vocab_size"]  # embed + head dominate
    trunk = per["0"] + K3["kda_moe_layers"] * kda_moe_layer + K3["mla_moe_layers"] * mla_moe_layer \
        + globals_k3
    expert_total = K3["moe_layers"] * K3["experts"] * K3["record_size"]
    floor = trunk + K3["k"] * K3["record_size"]
    bw = disk["qd1"]["gbps_median"] * 1e9

    # Hit rates from the cache simulator (deltafin_mlx.testing.cache_simulator, SlotMap policy,
    # "skewed" routing preset: Zipf 1.0, ~35% overlap with the previous token).
    from bench.lib.simulate import k3_hit_rates

    rows = []
    per_token_all_miss = K3["moe_layers"] * K3["k"] * K3["record_size"]
    for mem_gb in (24, 64, 128, 256, 512):
        cache = mem_gb * 1e9 - trunk - (256 << 20)
        row = {"memory_gb": mem_gb}
        if cache < K3["k"] * K3["record_size"]:
            row.update(fits=False)
            rows.append(row)
            continue
        frac = cache / expert_total
        row.update(fits=True, cache_fraction=frac)
        rows.append(row)
    fracs = [r["cache_fraction"] for r in rows if r.get("fits")]
    hits = k3_hit_rates(fracs, mode) if fracs else {}
    for r in rows:
        if not r.get("fits"):
            continue
        h = hits.get(r["cache_fraction"], 0.0)
        io = per_token_all_miss * (1 - h) / bw
        r.update(hit_rate=h, io_bytes_per_token=per_token_all_miss * (1 - h), io_s=io,
                 serial_s=compute + io, overlapped_s=max(compute, io),
                 tok_s_serial=1 / (compute + io), tok_s_overlapped=1 / max(compute, io))
    res = {
        "status": "ok",
        "model": str(model),
        "measured": meas,
        "per_layer_s": {"kda_attention": kda_attn, "mla_attention": mla_attn, "moe_block": moe,
                        "router_896_extra": gate_extra, "layer0_dense": layer0,
                        "lm_head_163840": head, "final_tail": meas["tail_s"]},
        "compute_s_per_token": compute,
        "routed_experts_s_per_token": experts_part,
        "trunk_bytes_f32_scales": trunk,
        "expert_bytes_total": expert_total,
        "floor_bytes": floor,
        "io_bytes_per_token_all_miss": per_token_all_miss,
        "io_s_per_token_all_miss": per_token_all_miss / bw,
        "disk_gbps": bw / 1e9,
        "by_memory": rows,
    }
    log(f"K3 projection: compute {compute:.1f} s/token on this CPU (routed experts "
        f"{experts_part:.1f} s of it); all-miss I/O {per_token_all_miss / 1e9:.1f} GB/token = "
        f"{per_token_all_miss / bw:.1f} s at {bw / 1e9:.2f} GB/s; trunk {trunk / 1e9:.1f} GB")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", help="(internal) measure this model and print JSON")
    ap.add_argument("--workdir", default="/tmp/deltafin-bench")
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, tokens=args.tokens, reps=args.reps,
                                 warmup=1 if args.tokens < 6 else 2)))
        return
    from bench.studies.diskprobe import run_probe

    model = ensure_model(Path(args.workdir), "k3-width-l3-e16", K3_WIDTH)
    disk = run_probe(model, reads=32)
    print(json.dumps(project(Path(args.workdir), disk), indent=1))


if __name__ == "__main__":
    main()
