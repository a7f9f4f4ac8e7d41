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
import time
from pathlib import Path
from typing import Callable, Tuple


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deltafin"


def rates_file() -> Path:
    return cache_dir() / "rates.json"


def disk_key(path) -> str:
    """The block device (and host) a file or directory is on."""
    st = os.stat(path)
    return f"disk:{platform.node()}:{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def compute_key(mode: str, bits: int, group_size: int, dtype) -> str:
    import mlx.core as mx

    return (f"compute:{platform.node()}:{platform.machine()}:{mx.default_device()}:"
            f"mlx-{mx.__version__}:{mode}:{bits}:{group_size}:{str(dtype).split('.')[-1]}")


def _read() -> dict:
    try:
        d = json.loads(rates_file().read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def cached_rate(key: str, measure: Callable[[], float], remeasure: bool = False
                ) -> Tuple[float, dict]:
    """(rate, entry): the cached value for `key`, or `measure()` stored for next time.
    entry says where it came from: {"value", "measured" (UTC time), "cached": bool}."""
    entries = _read()
    entry = entries.get(key)
    if not remeasure and isinstance(entry, dict) and isinstance(entry.get("value"), (int, float)) \
            and entry["value"] > 0:
        return float(entry["value"]), {**entry, "cached": True, "file": str(rates_file())}
    value = measure()
    entry = {"value": value, "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    entries[key] = entry
    try:  # a cache that cannot be written only means measuring again next time
        rates_file().parent.mkdir(parents=True, exist_ok=True)
        tmp = rates_file().with_name(f"rates.json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, rates_file())
    except OSError:
        pass
    return value, {**entry, "cached": False, "file": str(rates_file())}
