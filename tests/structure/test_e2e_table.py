"""The table of end-to-end tests (tests/conftest.py's E2E) names tests that exist: a
renamed or deleted test leaves no pattern behind that marks nothing, so the fast run
(`-m "not e2e"`) cannot quietly grow a slow test back while its entry rots."""

import ast
import fnmatch
from pathlib import Path

from conftest import E2E

ROOT = Path(__file__).resolve().parents[2]


def node_ids():
    """Every test function's node id without parameters, read from the files."""
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                yield f"{rel}::{node.name}"
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                        yield f"{rel}::{node.name}::{item.name}"


def test_every_e2e_pattern_marks_some_test():
    ids = list(node_ids())
    assert len(ids) > 400
    assert [p for p in E2E if not any(fnmatch.fnmatchcase(i, p) for i in ids)] == []
