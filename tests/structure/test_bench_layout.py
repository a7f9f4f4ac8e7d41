"""How bench/ is laid out: a package run from the repository root as modules
(`python -m bench.run`, `python -m bench.studies.NAME`), each with a main; tests
import nothing of it (what both need is in deltafin_mlx/testing/), no file edits the
import path, and nothing in bench imports the tests."""

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
    from the files)."""
    studies = sorted(p.stem for p in (BENCH / "studies").glob("*.py") if p.stem != "__init__")
    return ["bench.run", "bench.experiments", *(f"bench.studies.{s}" for s in studies)]


def test_no_file_in_bench_or_tests_edits_the_import_path():
    offenders = [str(p.relative_to(REPO)) for root in (BENCH, TESTS) for p in python_files(root)
                 if IMPORT_PATH_EDIT.search(p.read_text())]
    assert not offenders


def test_tests_import_nothing_from_bench():
    found = {f"{p.relative_to(REPO)}: {m}" for p in python_files(TESTS)
             for m in imported_modules(p) if m.split(".")[0] == "bench"}
    assert not found


def test_bench_imports_nothing_from_tests():
    test_modules = {"tests"} | {p.stem for p in TESTS.glob("*.py")}
    found = {f"{p.relative_to(REPO)}: {m}" for p in python_files(BENCH)
             for m in imported_modules(p) if m.split(".")[0] in test_modules}
    assert not found


@pytest.mark.parametrize("name", entry_points())
def test_every_study_imports_cleanly_and_has_a_main(name):
    module = importlib.import_module(name)
    assert callable(getattr(module, "main", None))


def test_the_decode_profiler_finds_every_runtime_method_it_times():
    """A renamed reader or cache method fails here, not as a profile of zero time
    (the hooks read from bench/lib/worker/decode.py's source, not imported)."""
    tree = ast.parse((BENCH / "lib" / "worker" / "decode.py").read_text())
    hooks = next(ast.literal_eval(node.value) for node in ast.walk(tree)
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "HOOKS")
    missing = []
    for module, names in hooks.items():
        for dotted in names:
            obj = importlib.import_module(module)
            for part in dotted.split("."):
                obj = getattr(obj, part, None)
            if obj is None:
                missing.append(f"{module}.{dotted}")
    assert hooks and missing == []
