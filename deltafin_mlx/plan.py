"""`deltafin-run plan`: the memory plan and a projected speed, without loading weights.

Works on a converted model, or on a source `config.json` plus the conversion options
(plan Kimi K3 before downloading 1.4 TB). The projection is a cost model:

    compute per token = weights touched per token / quantized matvec rate
    reads per token   = streamed trunk bytes + expected expert misses x record size
    time per token    = max(compute, reads / disk bandwidth)  (reads overlap compute)
                        .. compute + reads / disk bandwidth     (no overlap)

with the expert hit rate taken as the cache's share of all experts (no skew assumed:
real routing is skewed, so measured hit rates are higher; see docs/PERFORMANCE.md).
"""

import json
import os
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from .inventory import Inventory, inventory_from_config, inventory_from_manifest
from .manifest import MANIFEST_NAME, ModelError, read_manifest
from .planner import MemoryPlan, plan_memory
from .shard import expert_layout, sharded_inventory

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def measure_disk_gbps(path=None, nbytes: int = 256 << 20, block: int = 16 << 20) -> float:
    """O_DIRECT reads of `block`-sized pieces of a bank (or of a scratch file)."""
    from .reader import aligned_empty

    scratch = None
    if path is None:
        fd, scratch = tempfile.mkstemp(prefix="deltafin-disk-", dir=os.environ.get("TMPDIR"))
        with os.fdopen(fd, "wb") as f:
            chunk = np.random.default_rng(0).integers(0, 255, block, dtype=np.uint8).tobytes()
            for _ in range(nbytes // block):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        path = scratch
    try:
        flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(path, flags)
        except OSError:
            fd = os.open(path, os.O_RDONLY)
        size = os.fstat(fd).st_size
        buf = aligned_empty(block)
        offsets = list(range(0, max(size - block, 0) + 1, block))[: nbytes // block]
        np.random.default_rng(1).shuffle(offsets)
        start = time.perf_counter()
        done = 0
        for off in offsets:
            done += os.preadv(fd, [memoryview(buf)], off)
        os.close(fd)
        return done / (time.perf_counter() - start) / 1e9
    finally:
        if scratch:
            os.unlink(scratch)


def measure_compute_gwps(mode: str = "affine", bits: int = 4, group_size: int = 64,
                         dim: int = 4096, act: mx.Dtype = mx.float32) -> float:
    """Batch-1 quantized matvec rate, in G weights per second."""
    w = mx.random.normal((dim, dim)).astype(act)
    q = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
    x = mx.random.normal((1, dim)).astype(act)
    biases = q[2] if len(q) > 2 else None
    mx.eval(q, x)
    y = mx.quantized_matmul(x, q[0], q[1], biases, transpose=True, group_size=group_size,
                            bits=bits, mode=mode)
    mx.eval(y)
    n = 20
    start = time.perf_counter()
    for _ in range(n):
        y = mx.quantized_matmul(x, q[0], q[1], biases, transpose=True,
                                group_size=group_size, bits=bits, mode=mode)
        mx.eval(y)
    return n * dim * dim / (time.perf_counter() - start) / 1e9


def project(inv: Inventory, plan: MemoryPlan, disk_gbps: float, compute_gwps: float) -> dict:
    weights = sum(u.weights for u in inv.units.values())
    weights += len(inv.moe_layers) * inv.experts_per_token * inv.expert_weights
    compute = weights / (compute_gwps * 1e9)
    misses = len(inv.moe_layers) * inv.experts_per_token * (1 - plan.cache_fraction)
    read = plan.streamed_read_bytes + misses * inv.record_size
    io = read / (disk_gbps * 1e9)
    return {
        "weights_per_token": weights,
        "compute_seconds": compute,
        "read_bytes_per_token": read,
        "read_seconds": io,
        "tokens_per_second_overlapped": 1 / max(compute, io),
        "tokens_per_second_serial": 1 / (compute + io),
    }


def plan_from_path(args) -> dict:
    target = Path(args.model).expanduser()
    act = DTYPES[args.dtype] if getattr(args, "dtype", None) else (
        mx.float32 if mx.default_device() == mx.cpu else None)
    bank = None
    if target.is_dir() and (target / MANIFEST_NAME).exists():
        from mlx_lm.utils import load_config

        manifest = read_manifest(target)
        act = act or getattr(mx, manifest.dtype)
        config = load_config(target)
        inv = inventory_from_manifest(manifest, config, act)
        layout = expert_layout(manifest)
        bank = manifest.bank_path(manifest.moe_layers[0])
        source = str(target)
    else:
        config_path = target / "config.json" if target.is_dir() else target
        if not config_path.exists():
            raise ModelError(f"{target}: no such model directory or config.json")
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as e:
            raise ModelError(f"{config_path}: unreadable config ({e})") from None
        act = act or mx.bfloat16
        inv = inventory_from_config(config, act, bits=args.bits or None,
                                    group_size=args.group_size, expert_bits=args.expert_bits,
                                    expert_group_size=args.expert_group_size)
        layout = None  # as deltafin-convert --ranks N would write it
        source = str(config_path)
    ranks = getattr(args, "ranks", 1)
    whole = inv
    if ranks > 1:
        inv = sharded_inventory(inv, config, ranks, 0, layout, target)
    plan = plan_memory(inv, args.budget, context=args.context, stream_trunk=ranks == 1)
    disk = args.disk_gbps or measure_disk_gbps(bank if bank and os.path.getsize(bank) > 64 << 20 else None)
    mode = "mxfp4" if inv.sections[0].dtype == "uint32" and any(
        s.dtype == "uint8" for s in inv.sections) else "affine"
    compute = args.compute_gwps or measure_compute_gwps(
        mode, group_size=32 if mode == "mxfp4" else 64, act=act)
    streamed = [int(k) for k in plan.streamed]
    return {
        "model": source,
        "ranks": ranks,  # every figure below is per rank
        "whole_trunk_bytes": whole.trunk_bytes,
        "whole_expert_record_bytes": whole.record_size,
        "model_type": inv.model_type,
        "activation_dtype": str(act).split(".")[-1],
        "budget_bytes": plan.budget,
        "context": plan.context,
        "floor_bytes": plan.floor,
        "trunk_bytes": inv.trunk_bytes,
        "resident_trunk_bytes": plan.resident_bytes,
        "pinned_layers": sorted(int(k) for k in plan.pinned if k != "globals"),
        "streamed_layers": streamed,
        "stream_buffer_bytes": plan.ring_bytes,
        "embedding_on_demand": plan.embed_on_demand,
        "embedding_bytes": inv.embed_bytes,
        "state_bytes": plan.state_bytes,
        "working_bytes": plan.working_bytes,
        "expert_record_bytes": inv.record_size,
        "expert_slot_bytes": plan.slot_bytes,
        "experts_total": inv.num_experts * len(inv.moe_layers),
        "expert_bytes_on_disk": inv.expert_disk_bytes,
        "expert_cache_slots": plan.slots,
        "expert_cache_bytes": plan.cache_bytes,
        "expert_cache_fraction": plan.cache_fraction,
        "disk_gbps": disk,
        "compute_gweights_per_second": compute,
        "projection": project(inv, plan, disk, compute),
    }


def _gb(n):
    return f"{n / 1e9:.2f} GB"


def _ranges(xs):
    if not xs:
        return "none"
    out, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ", ".join(out)


def format_plan(r: dict) -> str:
    p = r["projection"]
    lines = [
        f"model          {r['model']} ({r['model_type']}), activations {r['activation_dtype']}",
        *([f"ranks          {r['ranks']} (tensor parallel): every figure below is per rank; "
           f"whole trunk {_gb(r['whole_trunk_bytes'])}, whole expert record "
           f"{r['whole_expert_record_bytes']} bytes"] if r.get("ranks", 1) > 1 else []),
        f"budget         {_gb(r['budget_bytes'])}   floor {_gb(r['floor_bytes'])} "
        f"({r['floor_bytes']} bytes) at {r['context']} tokens of context",
        f"trunk          {_gb(r['trunk_bytes'])} in all; resident {_gb(r['resident_trunk_bytes'])}",
        f"  pinned       layers {_ranges(r['pinned_layers'])}",
        f"  streamed     layers {_ranges(r['streamed_layers'])} "
        f"(through {_gb(r['stream_buffer_bytes'])} of buffers, read ahead in order)",
        f"  embedding    {_gb(r['embedding_bytes'])}, "
        + ("rows read on demand" if r["embedding_on_demand"] else "resident"),
        f"KV/state       {_gb(r['state_bytes'])}",
        f"experts        {r['experts_total']} of {r['expert_record_bytes']} bytes "
        f"({_gb(r['expert_bytes_on_disk'])} on disk); cache {r['expert_cache_slots']} slots, "
        f"{_gb(r['expert_cache_bytes'])} ({r['expert_cache_fraction']:.1%} of experts)",
        f"machine        disk {r['disk_gbps']:.2f} GB/s, quantized matvec "
        f"{r['compute_gweights_per_second']:.2f} G weights/s",
        f"projection     {p['weights_per_token'] / 1e9:.2f} G weights and "
        f"{p['read_bytes_per_token'] / 1e9:.3f} GB read per token: "
        f"{p['tokens_per_second_serial']:.3f}-{p['tokens_per_second_overlapped']:.3f} tok/s "
        "(no overlap .. full overlap; hit rate taken as the cache share)",
    ]
    return "\n".join(lines)
