"""Kimi K3's published config.json (kimi_k3_config.json beside this file, copied from
the release) and the facts from its model card that the plan's figures are checked
against, so every K3 plan test runs in a clean clone."""

from pathlib import Path

CONFIG = Path(__file__).with_name("kimi_k3_config.json")

EXPERT = 17_547_264  # "One expert is 17,547,264 bytes on disk."
STATE_4K = 69 * (96 * 128 * 128 * 4 + 3 * 3 * 12288 * 2) + 24 * 4096 * (512 + 64) * 2
