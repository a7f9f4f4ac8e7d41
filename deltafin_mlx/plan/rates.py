"""Measured machine rates (disk read bandwidth, quantized matvec speed), measured
once and cached, so that two `deltafin-run plan` runs on one machine agree.

The cache is `~/.cache/deltafin/rates.json` (under $XDG_CACHE_HOME when set). A disk
rate is keyed by the device the measured file lives on, a compute rate by the
machine, MLX's device and version, and the kind of matvec; `--remeasure` measures
again and replaces the entry.
"""

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Tuple

import mlx.core as mx
import numpy as np

from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.aligned import aligned_empty
from deltafin_mlx.format.integrity import read_inside
from deltafin_mlx.units import is_int


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deltafin"


def rates_file() -> Path:
    return cache_dir() / "rates.json"


def disk_key(path) -> str:
    """The block device (and host) a file or directory is on."""
    st = os.stat(path)
    return f"disk:{platform.node()}:{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def compute_key(mode: str, bits: int, group_size: int, dtype, batch: int = 1) -> str:
    return (f"compute:{platform.node()}:{platform.machine()}:{mx.default_device()}:"
            f"mlx-{mx.__version__}:{mode}:{bits}:{group_size}:{str(dtype).split('.')[-1]}"
            + (f":batch{batch}" if batch > 1 else ""))


# The cache holds a few dozen entries; anything larger is not one Deltafin wrote.
RATES_MAX_BYTES = 1 << 20
# What a measured rate can be, by the key's kind: disk GB/s, compute G weights/s,
# seconds a layer costs a decode step. A value outside is not a measurement (an
# edit, a corrupted file) and would project nonsense: it is measured again.
PLAUSIBLE = {"disk": (1e-4, 1e4), "compute": (1e-4, 1e7), "layer": (1e-8, 10.0)}
_warned = set()


def _say_ignored(why: str):
    """One line per reason and process: the cache is ignored and rates measured again."""
    if why not in _warned:
        _warned.add(why)
        print(f"[deltafin] {rates_file()}: {why}; measuring again", file=sys.stderr)


def _read(quiet: bool = False) -> dict:
    """The cached entries: {} when there is no cache, or one that is not a regular
    file of at most RATES_MAX_BYTES holding a JSON object (read as the hot-set files
    are: opened non-blocking, bounded, so a FIFO, /dev/zero or a huge file cannot
    hang or exhaust memory); `quiet`: without the line saying it is ignored."""
    if not os.path.lexists(rates_file()):
        return {}
    try:
        raw = read_inside(cache_dir(), rates_file().name, RATES_MAX_BYTES,
                          inside="the cache directory")
        d = json.loads(raw)
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        return d
    except (ModelError, ValueError, RecursionError, UnicodeDecodeError) as e:
        if not quiet:
            detail = str(e).replace(f"{rates_file()}: ", "").splitlines()[0][:200]
            _say_ignored(f"ignored ({detail})")
        return {}


def _plausible(key: str, value) -> bool:
    low, high = PLAUSIBLE.get(key.split(":")[0], (0.0, 1e30))
    # Compared, never converted: 10**400 has no float, NaN fails every comparison.
    return type(value) in (int, float) and low <= value <= high


def cached_rate(key: str, measure: Callable[[], float], remeasure: bool = False
                ) -> Tuple[float, dict]:
    """(rate, entry): the cached value for `key`, or `measure()` stored for next time.
    entry says where it came from: {"value", "measured" (UTC time), "cached": bool}."""
    entry = _read().get(key)
    if not remeasure and isinstance(entry, dict) and "value" in entry:
        if _plausible(key, entry["value"]):
            return float(entry["value"]), {**entry, "cached": True, "file": str(rates_file())}
        _say_ignored(f"the cached rate {key.split(':')[0]} "
                     f"{str(entry['value'])[:30]} is not a plausible measurement")
    return store_rate(key, measure())


def store_rate(key: str, value: float, **more) -> Tuple[float, dict]:
    """Cache `value` under `key` (`more`: fields beside it, e.g. a calibration's
    `how` and `runs`); returns it with its entry as cached_rate does."""
    entries = _read(quiet=True)
    entry = {"value": value, "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             **more}
    entries[key] = entry
    try:  # a cache that cannot be written only means measuring again next time
        rates_file().parent.mkdir(parents=True, exist_ok=True)
        tmp = rates_file().with_name(f"rates.json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, rates_file())
    except OSError:
        pass
    return value, {**entry, "cached": False, "file": str(rates_file())}


def layer_key(dtype, model: str = "") -> str:
    """The per-layer cost of a decode step: the machine, MLX's device and version,
    and for a bench's calibration the model (its manifest's digest): one model's
    cost says little of another's."""
    return (f"layer:{platform.node()}:{platform.machine()}:{mx.default_device()}:"
            f"mlx-{mx.__version__}:{str(dtype).split('.')[-1]}"
            + (f":model-{model}" if model else ""))


def calibration(key: str) -> Optional[dict]:
    """The entry a bench calibrated under `key` (layer_key with a model): a plausible
    `value`, the mean of `runs` bench runs (an int from 1, exact as a float: the
    mean's weight), the last `measured` (a time); None for anything else."""
    entry = _read().get(key)
    sound = (isinstance(entry, dict) and _plausible(key, entry.get("value"))
             and is_int(entry.get("runs")) and 1 <= entry["runs"] <= 1 << 53
             and isinstance(entry.get("measured"), str))
    return entry if sound else None


def store_calibration(key: str, seconds: float, how: str) -> Optional[dict]:
    """Average one bench run's per-layer cost into `key`'s calibration (its entry
    says of how many runs it is the mean). A cost that is no plausible measurement
    (0: the run left no time beyond the weights' arithmetic and its reads) is not
    stored: None."""
    if not _plausible(key, seconds):
        return None
    old = calibration(key)
    runs = old["runs"] if old else 0
    mean = (old["value"] * runs + seconds) / (runs + 1) if old else seconds
    return store_rate(key, mean, how=how, runs=runs + 1)[1]


def measure_layer_seconds(act: mx.Dtype = mx.float32, ops: int = 30, dim: int = 256) -> float:
    """What one decoder layer costs a decode step besides its weights: `ops` small
    operations (norms, rope, the router's softmax and top-k, ...) and the two
    synchronisations a streamed MoE layer makes (its routing read back, its output).
    A lower bound: `deltafin-run bench` replaces it with what a real run measures."""
    x = mx.random.normal((1, dim)).astype(act)
    w = mx.random.normal((dim, dim)).astype(act) / dim
    mx.eval(x, w)

    def layer(y):
        for _ in range(ops // 3):
            y = mx.fast.rms_norm(y, None, 1e-5) @ w
            y = y * mx.sigmoid(y)
        mx.eval(y)
        mx.argpartition(y, 8, axis=-1).tolist()
        return y

    layer(x)
    n, start = 0, time.perf_counter()
    while n < 20 or (n < 2000 and time.perf_counter() - start < 0.3):
        x = layer(x)
        n += 1
    return (time.perf_counter() - start) / n


def measure_disk_gbps(path=None, nbytes: int = 256 << 20, block: int = 16 << 20,
                      scratch_dir=None) -> float:
    """O_DIRECT reads of `block`-sized pieces of a bank (or of a scratch file written
    in `scratch_dir`, default the temporary directory)."""
    scratch = None
    if path is None:
        fd, scratch = tempfile.mkstemp(prefix="deltafin-disk-", dir=scratch_dir)
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
                         dim: int = 4096, act: mx.Dtype = mx.float32, batch: int = 1) -> float:
    """Quantized matrix product rate, in G weights (times tokens) per second: a
    matvec at batch 1 (decoding), a matrix product at a prefill pass's batch."""
    w = mx.random.normal((dim, dim)).astype(act)
    q = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
    x = mx.random.normal((batch, dim)).astype(act)
    biases = q[2] if len(q) > 2 else None
    mx.eval(q, x)
    y = mx.quantized_matmul(x, q[0], q[1], biases, transpose=True, group_size=group_size,
                            bits=bits, mode=mode)
    mx.eval(y)
    # Up to 20 products, but no more than about a second of them (a slow backend
    # and dtype, bfloat16 on a CPU, would otherwise take minutes).
    n, start = 0, time.perf_counter()
    while n < 20 and (n < 2 or time.perf_counter() - start < 1.0):
        y = mx.quantized_matmul(x, q[0], q[1], biases, transpose=True,
                                group_size=group_size, bits=bits, mode=mode)
        mx.eval(y)
        n += 1
    return n * batch * dim * dim / (time.perf_counter() - start) / 1e9
