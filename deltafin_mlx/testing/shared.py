"""Where the tests find the project's shared files (Kimi K3's release config.json).

A checkout's shared/ lies beside it (CI clones the repository next to a copy of
shared/); a git worktree may sit further down, so every folder above the checkout is
tried, nearest first.
"""

import os
from pathlib import Path

K3_ENV = "DELTAFIN_K3_CONFIG"

# Kimi K3's facts from shared/kimi-k3/CHECKPOINT.md, which the plan's figures are
# checked against.
EXPERT = 17_547_264  # "One expert is 17,547,264 bytes on disk."
STATE_4K = 69 * (96 * 128 * 128 * 4 + 3 * 3 * 12288 * 2) + 24 * 4096 * (512 + 64) * 2


def k3_config() -> Path:
    """$DELTAFIN_K3_CONFIG, else the nearest shared/kimi-k3/config.json above the
    checkout (a path that may not exist: the caller skips)."""
    given = os.environ.get(K3_ENV)
    if given:
        return Path(given)
    checkout = Path(__file__).resolve().parents[2]
    for folder in checkout.parents:
        found = folder / "shared" / "kimi-k3" / "config.json"
        if found.exists():
            return found
    return checkout.parent / "shared" / "kimi-k3" / "config.json"
