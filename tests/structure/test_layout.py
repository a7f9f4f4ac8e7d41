"""The package's structure: one folder per stage of the data path, imports that
only run down it, and no circle among them.

The import graph is read from the source with `ast`, function-local imports
included (a local import hides a circle from Python, not from a reader).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"deltafin_mlx": ROOT / "deltafin_mlx", "deltafin_mlx.convert": ROOT / "convert"}


def module_name(path: Path) -> str:
    for pkg, folder in PACKAGES.items():
        if folder in path.parents:
            parts = [pkg, *path.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    raise ValueError(path)


def modules():
    return {module_name(p): p for folder in PACKAGES.values() for p in folder.rglob("*.py")}


def imports_of(name: str, path: Path, known) -> set:
    """The project modules `name` imports, anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not (t == "deltafin_mlx" and not name.startswith("deltafin_mlx.__")):
                found.add(t)
    return found


def graph():
    known = modules()
    g = {n: imports_of(n, p, known) for n, p in known.items()}
    # `import deltafin_mlx.engine` names the package too: the package's __init__ is a
    # façade over the modules, not a dependency of them.
    for n in g:
        g[n].discard("deltafin_mlx")
    return g


def cycles(g):
    """Every strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_runtime_and_the_converter():
    assert cycles(graph()) == []


# The stages of the data path, bottom up: a module may import its own stage and
# the stages below it, never one above (peers on one floor do not import each other).
FLOORS = [
    ("errors", "units", "compat", "_version"),   # the shared leaves at the root
    ("format",),                                  # the on-disk contract
    ("model",),                                   # mlx-lm's model, built from config.json
    ("tokenizer",),                               # text <-> ids, as the config names them
    ("plan",),                                    # the memory plan and projections
    ("convert", "engine"),                        # checkpoint -> format; cache + readers
    ("generation",),                              # tokens out of a loaded model
    ("chat", "jobs"),                             # a conversation; batch and score
    ("server",),                                  # serve
    ("dropin",),                                  # mlx-lm's entry points into Deltafin
    ("cli",),                                     # the commands: leaves
]
ROOT_LEAVES = {"__init__", "_version", "errors", "units", "compat"}


def floor_of(name):
    part = name.split(".")[1] if "." in name else "__init__"
    for i, stages in enumerate(FLOORS):
        if part in stages:
            return i, part
    return None, part


def test_the_package_root_holds_only_the_shared_leaves():
    extra = sorted(p.stem for p in (ROOT / "deltafin_mlx").glob("*.py") if p.stem not in ROOT_LEAVES)
    assert extra == []
    folders = {p.parent.name for p in (ROOT / "deltafin_mlx").glob("*/__init__.py")}
    assert folders <= {s for f in FLOORS for s in f} | {"testing"}, folders


def test_no_import_runs_up_the_stages():
    bad = {}
    for n, ts in graph().items():
        floor, stage = floor_of(n)
        if floor is None:  # the package's façade and the test fixtures
            continue
        for t in ts:
            tf, ts_stage = floor_of(t)
            if tf is None:
                if ts_stage == "testing" and n.startswith("deltafin_mlx.cli.demo"):
                    continue
                bad.setdefault(n, []).append(t)
            elif tf > floor or (tf == floor and ts_stage != stage and floor > 0):
                bad.setdefault(n, []).append(t)
    assert bad == {}


def test_no_command_module_imports_another():
    """Commands are leaves: what two commands share lives in a library stage
    (cli.common and cli.options hold only argument and output conventions)."""
    shared = ("deltafin_mlx.cli.common", "deltafin_mlx.cli.options", "deltafin_mlx.cli.reply")
    bad = {n: sorted(t for t in ts if t.startswith("deltafin_mlx.cli.") and t not in shared)
           for n, ts in graph().items()
           if n.startswith("deltafin_mlx.cli.") and n not in shared + ("deltafin_mlx.cli.main",)}
    assert {n: t for n, t in bad.items() if t} == {}


def test_only_tests_bench_and_the_demo_use_the_fixture_generators():
    bad = {n: sorted(t for t in ts if t.startswith("deltafin_mlx.testing"))
           for n, ts in graph().items()
           if not n.startswith(("deltafin_mlx.testing", "deltafin_mlx.cli.demo"))}
    assert {n: t for n, t in bad.items() if t} == {}


def test_every_package_folder_is_installed():
    """`pip install .` (not editable) ships what pyproject's package search finds:
    every folder of the package must be a package (an __init__.py) to be found."""
    import re

    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'include = \["deltafin_mlx\*"\]', text)
    for folder in (ROOT / "deltafin_mlx").rglob("*"):
        if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
            assert (folder / "__init__.py").exists(), folder
