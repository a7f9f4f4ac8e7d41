"""Sizes as people write them: "8GB" in, "17.5 MB" out (decimal units, as disks are sold);
what counts as an integer in a file or a request (JSON's true is no integer here)."""

import re

from deltafin_mlx.errors import BudgetError

_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 1 << 10, "M": 1e6, "MB": 1e6,
          "MIB": 1 << 20, "G": 1e9, "GB": 1e9, "GIB": 1 << 30, "T": 1e12, "TB": 1e12,
          "TIB": 1 << 40}


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_size(value) -> int:
    """Bytes from an int or a string like "8GB", "512MiB", "1.5G"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not value > 0 or value == float("inf"):
            raise BudgetError(f"memory budget must be a positive, finite size (got {value})")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise BudgetError(f"bad memory size {value!r} (examples: 8GB, 512MB, 1.5GiB, 1000000000)")
    n = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if not n < 1e18:
        raise BudgetError(f"memory budget {value!r} is not a sensible size")
    n = int(n)
    if n <= 0:
        raise BudgetError(f"memory budget must be positive (got {value!r})")
    return n


def human_bytes(n: float) -> str:
    """A size in the unit that suits it: 512 B, 8.19 KB, 17.5 MB, 3.41 GB, 1.45 TB."""
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 999.5 or unit == "TB":
            break
        n /= 1000
    if unit == "B":
        return f"{int(n)} B"
    return f"{n:.2f} {unit}" if abs(n) < 10 else f"{n:.1f} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"


def count(n: int, noun: str, plural: str = "") -> str:
    """`n` and the noun, singular for 1: "1 sweep", "3 sweeps", "2 passes"."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
