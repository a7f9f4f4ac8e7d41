"""The package's structure: one folder per stage of the data path, imports that
only run down it, and no circle among them.

The import graph is read from the source with `ast`, function-local imports
included (a local import hides a circle from Python, not from a reader).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"deltafin_mlx": ROOT / "deltafin_mlx", "deltafin_convert": ROOT / "convert"}


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
    # `import deltafin_mlx.x` names the package too: the package's __init__ is a
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


def test_the_runtime_never_imports_the_converter():
    """Only the command-line layer may run a conversion (the demo does)."""
    offenders = {n: sorted(t for t in ts if t.startswith("deltafin_convert"))
                 for n, ts in graph().items()
                 if n.startswith("deltafin_mlx") and not n.startswith("deltafin_mlx.cli")}
    assert {n: t for n, t in offenders.items() if t} == {}


def test_the_converter_library_uses_only_format_model_plan_and_tokenizer():
    allowed = ("deltafin_mlx.format", "deltafin_mlx.model", "deltafin_mlx.plan",
               "deltafin_mlx.tokenizer",
               "deltafin_mlx.errors", "deltafin_mlx.units", "deltafin_mlx.compat", "deltafin_mlx.mlx_lm_shim",
               "deltafin_mlx.__init__", "deltafin_convert")
    cli_helpers = ("deltafin_mlx.cli.common",)  # help format, --version: the tools share them
    bad = {}
    for n, ts in graph().items():
        if n.startswith("deltafin_convert"):
            ok = allowed + (cli_helpers if n == "deltafin_convert.cli" else ())
            wrong = sorted(t for t in ts if t.startswith("deltafin_mlx") and not t.startswith(ok))
            if wrong:
                bad[n] = wrong
    assert bad == {}


@pytest.mark.parametrize("stage", ["format", "model", "plan", "engine", "tokenizer", "server"])
def test_library_stages_never_import_the_command_line_layer(stage):
    bad = {n: sorted(t for t in ts if t.startswith("deltafin_mlx.cli"))
           for n, ts in graph().items() if n.startswith(f"deltafin_mlx.{stage}")}
    assert {n: t for n, t in bad.items() if t} == {}


def test_lower_stages_never_import_higher_ones():
    """format < model < plan < engine: each stage builds only on those below it."""
    order = ["format", "model", "plan", "engine"]
    bad = {}
    for n, ts in graph().items():
        for i, stage in enumerate(order):
            if n.startswith(f"deltafin_mlx.{stage}."):
                higher = tuple(f"deltafin_mlx.{s}" for s in order[i + 1:])
                wrong = sorted(t for t in ts if higher and t.startswith(higher))
                if wrong:
                    bad[n] = wrong
    assert bad == {}


def test_only_tests_bench_and_the_demo_use_the_fixture_generators():
    bad = {n: sorted(t for t in ts if t.startswith("deltafin_mlx.testing"))
           for n, ts in graph().items()
           if not n.startswith(("deltafin_mlx.testing", "deltafin_mlx.cli.demo"))}
    assert {n: t for n, t in bad.items() if t} == {}


def test_every_package_folder_is_installed():
    """`pip install .` (not editable) ships exactly the packages pyproject lists: a
    stage folder missing there imports in the source tree and fails once installed."""
    import re

    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text,
                                                     re.S | re.M).group(1)))
    found = {".".join(("deltafin_mlx",) + p.parent.relative_to(ROOT / "deltafin_mlx").parts)
             for p in (ROOT / "deltafin_mlx").rglob("__init__.py")}
    found |= {"deltafin_convert"} if (ROOT / "convert" / "__init__.py").exists() else set()
    assert found <= listed, f"not in pyproject's packages: {sorted(found - listed)}"
