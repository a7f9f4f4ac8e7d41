"""How bench/ is laid out: a package run from the repository root as modules
(`python -m bench.run`, `python -m bench.studies.NAME`), whose shared part,
bench.lib, is the only part tests import; no file edits the import path, and
nothing in bench imports the tests."""

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH, TESTS = REPO / "bench", REPO / "tests"
IMPORT_PATH_EDIT = re.compile(r"\bsys\.path\b")


def python_files(root: Path):
    return sorted(root.rglob("*.py"))


def imported_modules(path: Path):
    """Every module an import statement in `path` names (absolute imports)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


def entry_points():
    """bench.run, bench.experiments and every bench.studies module, by name (read
    from the files: only bench.lib is imported by statement)."""
    studies = sorted(p.stem for p in (BENCH / "studies").glob("*.py") if p.stem != "__init__")
    return ["bench.run", "bench.experiments", *(f"bench.studies.{s}" for s in studies)]


def test_no_file_in_bench_or_tests_edits_the_import_path():
    offenders = [str(p.relative_to(REPO)) for root in (BENCH, TESTS) for p in python_files(root)
                 if IMPORT_PATH_EDIT.search(p.read_text())]
    assert not offenders


def test_tests_import_only_bench_lib():
    outside = {f"{p.name}: {m}" for p in python_files(TESTS) for m in imported_modules(p)
               if (m == "bench" or m.startswith("bench."))
               and not (m == "bench.lib" or m.startswith("bench.lib."))}
    assert not outside


def test_bench_imports_nothing_from_tests():
    test_modules = {"tests"} | {p.stem for p in TESTS.glob("*.py")}
    found = {f"{p.relative_to(REPO)}: {m}" for p in python_files(BENCH)
             for m in imported_modules(p) if m.split(".")[0] in test_modules}
    assert not found


def test_every_study_is_a_module_of_bench_studies():
    assert {m.split(".")[-1] for m in entry_points()} >= {
        "run", "experiments", "batch", "chat_turns", "diskprobe", "distributed",
        "integrity_cost", "iobound", "k3_projection", "policy_bound", "prefill_memory",
        "read_modes", "serve_clients", "serve_memory", "simulate_cache", "stress_server", "trunk_budget"}


@pytest.mark.parametrize("name", entry_points())
def test_each_entry_point_imports_cleanly_and_has_a_main(name):
    module = importlib.import_module(name)
    assert callable(getattr(module, "main", None))


def test_the_decode_profiler_finds_every_runtime_method_it_times():
    """A renamed reader or cache method fails here, not as a profile of zero time."""
    import importlib

    from bench.lib.worker.decode import Profiler, _has_path

    missing = [f"{m}.{name}" for m, names in Profiler.HOOKS.items() for name in names
               if not _has_path(importlib.import_module(m), name)]
    assert missing == []
