"""Sizes in bytes as a person reads them (plans, errors, reports and the CLIs)."""


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
