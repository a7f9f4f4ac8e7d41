"""The expert store's state is the engine's own: nothing outside
deltafin_mlx/engine/ assigns an attribute of an ExpertStore (`store.x = ...`,
`state.store.x = ...`, `setattr(store, ...)`); callers go through the Runtime's
scoped methods (`observe`, `real_tokens`, `hint_logits_unread`).

Read from the source with `ast`: any object named `store` or `_store`, or reached
as `something.store`, counts as an expert store."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "deltafin_mlx" / "engine"
STORE_NAMES = {"store", "_store"}


def is_store(node) -> bool:
    return ((isinstance(node, ast.Name) and node.id in STORE_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr in STORE_NAMES))


def store_assignments(source: str):
    """(line, text) of each assignment to an attribute of a store in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and node.args and is_store(node.args[0])
              and ((isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"))
                   or (isinstance(node.func, ast.Attribute)
                       and node.func.attr in ("setattr", "delattr")))):
            found.append((node.lineno, ast.unparse(node)))
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets.extend(t.elts)
            elif isinstance(t, ast.Starred):
                targets.append(t.value)
            elif isinstance(t, ast.Attribute) and is_store(t.value):
                found.append((node.lineno, ast.unparse(t)))
    return sorted(found)


def test_the_check_finds_each_kind_of_assignment():
    source = ("store.on_route = f\nstate.store.token_mask = m\nself._store.k += 1\n"
              "setattr(store, 'x', 1)\nmonkeypatch.setattr(state.store, 'y', 2)\n"
              "a, store.b = 1, 2\nstore.cache.x = 1\nother.on_route = f\n")
    assert [line for line, _ in store_assignments(source)] == [1, 2, 3, 4, 5, 6]


def test_no_expert_store_attribute_is_assigned_outside_the_engine():
    files = [p for folder in ("deltafin_mlx", "bench", "tests")
             for p in (ROOT / folder).rglob("*.py") if ENGINE not in p.parents]
    assert files
    found = [f"{p.relative_to(ROOT)}:{line}: {text}" for p in files
             for line, text in store_assignments(p.read_text())]
    assert not found, "\n".join(found)
