"""Shared pieces of the benchmark: bench models, page-cache drops, cgroups, stats."""

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

from bench.lib import ROOT, worker

BENCH = ROOT / "bench"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
CGROUP_PREFIX = "deltafin-bench-"

# Kimi K3's routed expert shape (see docs/FORMAT.md):
# latent 3584, intermediate 3072, MXFP4, 16 of them per token.
K3_EXPERT = dict(routed_expert_hidden_size=3584, moe_intermediate_size=3072,
                 experts_per_token=16)
K3_RECORD_SIZE = 17_547_264


def log(msg: str):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def summary(values) -> dict:
    """Median and range of a list of numbers (None entries ignored)."""
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    a = np.array(v, dtype=float)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()),
            "n": len(v)}


# --- bench models -----------------------------------------------------------


def finish_report(report: dict, json_path=None, workdir=None) -> int:
    """Print a study's report, write it to `json_path` if given, remove its scratch
    `workdir`; 0, the study's exit status."""
    print(json.dumps(report, indent=1))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def model_overrides(hidden: int, layers: int, experts: int, vocab: int = 1024) -> dict:
    """A K3-layout model with K3's real expert shape and a small trunk.
    `layers` decoder layers: layer 0 dense, the rest MoE."""
    return dict(hidden_size=hidden, num_layers=layers, num_experts=experts,
                vocab_size=vocab, **K3_EXPERT)


def ensure_model(workdir: Path, name: str, overrides: dict, seed: int = 0) -> Path:
    """Generate and convert a bench model once; reuse it when the spec matches."""
    from deltafin_mlx.testing.synthetic import checkpoint_size, make_checkpoint

    base = Path(workdir) / name
    out = base / "model"
    spec_file = base / "spec.json"
    spec = {"arch": "kimi_k3", "seed": seed, "overrides": overrides}
    if (out / "deltafin.json").exists() and spec_file.exists():
        if json.loads(spec_file.read_text()) == spec:
            log(f"model {name}: reusing {out}")
            return out
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    size = checkpoint_size("kimi_k3", **overrides)
    free = shutil.disk_usage(base).free
    if free < 2.2 * size:
        raise SystemExit(f"{base}: {free / 1e9:.1f} GB free, need about {2.2 * size / 1e9:.1f} GB "
                         "(source and converted model; the source is deleted afterwards)")
    from deltafin_mlx.convert.convert import ConvertOptions, convert

    src = base / "src"
    log(f"model {name}: generating a {size / 1e9:.2f} GB K3-layout checkpoint {overrides}")
    t = time.perf_counter()
    make_checkpoint(src, "kimi_k3", seed=seed, **overrides)
    log(f"model {name}: generated in {time.perf_counter() - t:.0f} s; converting")
    t = time.perf_counter()
    convert(str(src), out, ConvertOptions(progress=False))
    log(f"model {name}: converted in {time.perf_counter() - t:.0f} s")
    shutil.rmtree(src)
    spec_file.write_text(json.dumps(spec, indent=1))
    return out


def model_info(model_dir: Path) -> dict:
    m = json.loads((Path(model_dir) / "deltafin.json").read_text())
    files = m["files"]
    banks = sum(s for rel, s in files.items() if rel.endswith(".bank"))
    trunk = sum(s for rel, s in files.items() if rel.startswith("trunk/"))
    ex = m["experts"]
    return {
        "path": str(model_dir),
        "num_layers": m["num_layers"],
        "moe_layers": len(ex["layers"]),
        "num_experts": ex["num_experts"],
        "experts_per_token": ex["experts_per_token"],
        "record_size": ex["record_size"],
        "expert_bytes": ex["num_experts"] * ex["record_size"] * len(ex["layers"]),
        "bank_file_bytes": banks,
        "trunk_file_bytes": trunk,
        "quantization": m.get("quantization"),
    }


# --- page cache -------------------------------------------------------------


def drop_caches() -> bool:
    """Write back and drop the page cache (root only); False where not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


# --- cgroup v1 memory caps ---------------------------------------------------


def cgroups_writable() -> bool:
    probe = CGROUP_ROOT / f"{CGROUP_PREFIX}probe-{os.getpid()}"
    try:
        probe.mkdir()
        (probe / "memory.limit_in_bytes").write_text(str(1 << 30))
        return True
    except OSError:
        return False
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass


def remove_stale_cgroups():
    """Remove empty cgroups left by an interrupted earlier run of this benchmark:
    only those whose creating process (the pid in the name) is gone, so that a
    benchmark running beside this one keeps its own."""
    if not CGROUP_ROOT.is_dir():
        return
    for d in CGROUP_ROOT.glob(CGROUP_PREFIX + "*"):
        owner = d.name[len(CGROUP_PREFIX):].split("-", 1)[0]
        if not owner.isdigit() or Path(f"/proc/{owner}").exists():
            continue
        try:
            if not (d / "cgroup.procs").read_text().strip():
                d.rmdir()
                log(f"removed stale cgroup {d}")
        except OSError:
            pass


class Cgroup:
    """A cgroup v1 directory at `self.path`: children enter it (`preexec`), and
    `close()` removes it once they have left."""

    path: Path

    def preexec(self):
        procs = str(self.path / "cgroup.procs")

        def enter():
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        return enter

    def close(self):
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        log(f"warning: could not remove cgroup {self.path}")


class MemoryCap(Cgroup):
    """A cgroup v1 memory cgroup with `limit` bytes (page cache is charged too).
    Create, run children in it (`preexec`), then `close()` to remove it."""

    def __init__(self, limit: int, tag: str):
        self.limit = int(limit)
        self.path = CGROUP_ROOT / f"{CGROUP_PREFIX}{os.getpid()}-{tag}"
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
        memsw = self.path / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # no swap escape either, where swap accounting exists
            try:
                memsw.write_text(str(self.limit))
            except OSError:
                pass

    def counters(self) -> dict:
        out = {}
        for name in ("memory.max_usage_in_bytes", "memory.failcnt"):
            try:
                out[name.split(".", 1)[1]] = int((self.path / name).read_text())
            except (OSError, ValueError):
                pass
        try:
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                k, v = line.split()
                out[f"oom_control.{k}"] = int(v)
        except (OSError, ValueError):
            pass
        return out



# --- running one configuration ----------------------------------------------


def run_worker(args: list, timeout: float, cap: "MemoryCap" = None, mode: str = "decode") -> dict:
    """Run a worker mode (by default the profiled decode, `python -m bench.lib.worker
    decode`) in a fresh process; returns its JSON result, or a status record when
    it was killed, timed out or failed."""
    cmd = worker.command(mode, *args)
    env = worker.environment()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=str(ROOT), preexec_fn=cap.preexec() if cap else None)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        return {"status": "timeout", "timeout_s": timeout, "wall_s": time.perf_counter() - t0,
                "stderr_tail": err[-1500:]}
    wall = time.perf_counter() - t0
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            res = json.loads(line)
            res.setdefault("status", "ok")
            res["process_wall_s"] = wall
            return res
    status = "killed" if p.returncode and p.returncode < 0 else "failed"
    return {"status": status, "returncode": p.returncode, "wall_s": wall,
            "stderr_tail": err[-1500:], "stdout_tail": out[-500:]}


def _busy_ticks():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    return busy, sum(v[:8])


def cpu_busy_share(interval: float = 1.0) -> float:
    """Share of all CPUs busy over `interval` seconds (while this process sleeps)."""
    try:
        b0, t0 = _busy_ticks()
        time.sleep(interval)
        b1, t1 = _busy_ticks()
        return (b1 - b0) / max(t1 - t0, 1)
    except (OSError, ValueError, IndexError):
        return 0.0


def wait_for_quiet(max_busy: float = 0.15, timeout: float = 300.0) -> dict:
    """Wait until other processes leave the CPUs mostly idle (on a shared machine
    a test suite running meanwhile would skew every number)."""
    t0 = time.perf_counter()
    busy = cpu_busy_share()
    said = False
    while busy > max_busy and time.perf_counter() - t0 < timeout:
        if not said:
            log(f"  waiting for other processes to leave the CPUs ({busy:.0%} busy)")
            said = True
        busy = cpu_busy_share(2.0)
    return {"waited_s": time.perf_counter() - t0, "busy_share": busy}


def code_fingerprint() -> dict:
    """sha256 of the runtime's and converter's sources as measured (no VCS needed):
    other work lands concurrently, so a result names the code it measured."""
    import hashlib

    files = {}
    for d in ("deltafin_mlx", "convert"):
        for p in sorted((ROOT / d).rglob("*.py")):
            files[p.relative_to(ROOT).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()[:12]
    total = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    return {"sha256": total, "files": files}


def machine_info() -> dict:
    import platform

    info = {"platform": platform.platform(), "machine": platform.machine(),
            "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                info["mem_total_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import mlx.core as mx
        import mlx_lm

        info["mlx"] = mx.__version__
        info["mlx_lm"] = mlx_lm.__version__
        info["mlx_device"] = str(mx.default_device())
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        info["hypervisor"] = "hypervisor" in open("/proc/cpuinfo").read().split("flags", 2)[1][:4000]
    except (OSError, IndexError):
        pass
    return info


def demo_model(budget=None):
    """(path, budget) of the demo model (built on first use): the budget given, or
    the demo's own, which caches a quarter of its experts."""

    from deltafin_mlx.format.catalog import demo_root
    from deltafin_mlx.format.model_dir import open_model_dir
    from deltafin_mlx.testing.demo import demo_plan, prepare

    path = str(prepare(demo_root()))
    if budget is None:
        budget = demo_plan(open_model_dir(path)).budget
    return path, budget

