"""docs/ARCHITECTURE.md stays a map, not a second copy of the docstrings: short, and
true to the folders it maps (a folder renamed or added shows up here, not in a
reader's confusion)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGE = ROOT / "deltafin_mlx"
MAX_LINES = 250


def stage_folders():
    return sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))


def test_the_architecture_page_is_at_most_250_lines():
    lines = DOC.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines: module detail belongs in docstrings"


def test_every_deltafin_mlx_folder_the_page_names_exists():
    """Named as `deltafin_mlx/engine/` or, in code spans, as `engine/` or
    `engine/cache.py` (the repository's own folders apart)."""
    text = DOC.read_text()
    named = set(re.findall(r"deltafin_mlx/(\w+)/", text))
    named |= set(re.findall(r"`(\w+)/", text)) - {"deltafin_mlx", "tests", "bench", "docs"}
    missing = sorted(n for n in named if not (PACKAGE / n).is_dir())
    assert missing == []


def test_every_stage_folder_is_on_the_map():
    text = DOC.read_text()
    absent = [f for f in stage_folders()
              if f"`{f}/`" not in text and f"`deltafin_mlx/{f}/`" not in text]
    assert absent == [], "add each to the map's table in docs/ARCHITECTURE.md"
