"""Every repository path the prose names exists: in README.md, docs/*.md and
bench/README.md, and in the comments and docstrings of deltafin_mlx/, bench/ and tests/.

A path named is a token rooted at the repository (`deltafin_mlx/engine/load.py`,
`tests/plan/`, `bench/results/latest.json`, `docs/LEARNED.md`), a stage-relative one
(`engine/load.py`, resolved against deltafin_mlx/), a module and a name in it
(`engine/allocator.tune_malloc`: the name must be defined there), or a dotted module
(`bench.studies.iobound`, `deltafin_mlx.engine.load.load`). A user's paths
(`~/models/...`, `../shared/...`, `OUT.jsonl`), placeholders (`<stage>`, `NAME`) and
glob patterns are not the repository's and are left alone."""

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "deltafin_mlx"
STAGES = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
ROOTS = ("deltafin_mlx", "tests", "bench", "docs")

_EDGE = r"(?<![\w./~*<>{$-])"  # not the middle of a longer path, a glob or a placeholder
_TAIL = r"(?![\w*<>{])"
SLASHED = re.compile(_EDGE + r"((?:%s)/[\w./-]*[\w/])" % "|".join(ROOTS + tuple(STAGES)) + _TAIL)
DOTTED = re.compile(_EDGE + r"((?:deltafin_mlx|bench)(?:\.[A-Za-z_]\w*)+)" + _TAIL)
PLACEHOLDER = re.compile(r"(?<![A-Za-z])(?:NAME|MODULE|STAGE|FILE|DIR|MODEL)(?![A-Za-z])|\.\.\.")
PATTERN_NEXT = re.compile(r"\.?[{*<]")  # `bench/results/batch.{json,md}`, `tests/cli/*`


def prose_files():
    yield REPO / "README.md"
    yield REPO / "bench" / "README.md"
    yield from sorted((REPO / "docs").glob("*.md"))


def code_files():
    for root in ("deltafin_mlx", "bench", "tests"):
        yield from (p for p in sorted((REPO / root).rglob("*.py")) if p != Path(__file__))


def code_text(path: Path) -> str:
    """A module's prose: its comments and docstrings (a string standing as a statement),
    not the strings its code computes with."""
    text = path.read_text()
    out = [tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
           if tok.type == tokenize.COMMENT]
    out += [node.value.value for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)]
    return "\n".join(out)


def defines(module: Path, name: str) -> bool:
    text = module.read_text()
    return re.search(rf"^\s*(?:def|class|async def)\s+{name}\b|^\s*{name}\s*[:=]|"
                     rf"^\s*(?:from\s+\S+\s+)?import\s+.*\b{name}\b|"
                     rf"[\"'](?:[\w.]*\.)?{name}[\"']\s*:", text, re.M) is not None  # or a table's key


def module_file(parts) -> Path | None:
    base = REPO.joinpath(*parts)
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    if base.with_suffix(".py").exists():
        return base.with_suffix(".py")
    return None


def resolve_dotted(token: str) -> bool:
    parts = token.split(".")
    for n in range(len(parts), 0, -1):
        found = module_file(parts[:n])
        if found:
            rest = parts[n:]
            return not rest or defines(found, rest[0])
    return False


def resolve_slashed(token: str) -> bool:
    root = REPO if token.split("/")[0] in ROOTS else PACKAGE
    path = root / token
    if path.exists() or path.with_name(path.name + ".py").exists():  # `engine/cache`
        return True
    # `stage/module.name`: a name defined in stage/module.py
    head, _, last = token.rpartition("/")
    module, dot, name = last.partition(".")
    if dot and name.isidentifier() and (root / head / f"{module}.py").exists():
        return defines(root / head / f"{module}.py", name.split(".")[0])
    return False


def named_paths(text: str):
    for line in text.splitlines():
        if PLACEHOLDER.search(line) and "/" not in line:
            continue
        for m in SLASHED.finditer(line):
            token = m.group(1).rstrip("./")
            if PATTERN_NEXT.match(line, m.start(1) + len(token)):
                continue
            if token in ROOTS + tuple(STAGES) or PLACEHOLDER.search(token):
                continue
            if token.endswith((".rst", ".html")):
                continue
            yield token, resolve_slashed(token)
        for m in DOTTED.finditer(line):
            token = m.group(1).rstrip(".")
            if PATTERN_NEXT.match(line, m.start(1) + len(token)) or token.endswith("__"):
                continue
            if token.endswith((".py", ".md", ".json", ".jsonl", ".txt")) or PLACEHOLDER.search(token):
                continue
            yield token, resolve_dotted(token)


def stale():
    out = []
    for path in prose_files():
        out += [f"{path.relative_to(REPO)}: {t}" for t, ok in named_paths(path.read_text()) if not ok]
    for path in code_files():
        out += [f"{path.relative_to(REPO)}: {t}" for t, ok in named_paths(code_text(path)) if not ok]
    return sorted(set(out))


def test_every_repository_path_named_in_the_docs_and_the_code_exists():
    assert stale() == []


def test_the_check_sees_paths_in_each_form(tmp_path):
    """A check that finds nothing proves nothing: each form resolves when it exists
    and is reported when it does not."""
    text = ("see `engine/load.py`, deltafin_mlx/plan/memory.py, bench.studies.iobound, "
            "`engine/allocator.tune_malloc` and tests/structure/; not engine/nowhere.py, "
            "deltafin_mlx/plan/gone.py, bench.studies.gone, `engine/load.model_config`, "
            "but ~/models/x/engine/y.py, ../shared/kimi-k3/config.json and tests/*/x.py are "
            "a user's or a pattern")
    found = dict(named_paths(text))
    assert found == {"engine/load.py": True, "deltafin_mlx/plan/memory.py": True,
                     "bench.studies.iobound": True, "engine/allocator.tune_malloc": True,
                     "tests/structure": True, "engine/nowhere.py": False,
                     "deltafin_mlx/plan/gone.py": False, "bench.studies.gone": False,
                     "engine/load.model_config": False}


def test_the_package_and_the_tests_name_no_file_beside_the_repository():
    """A clean clone has nothing beside it: what the code points to is inside."""
    outside = re.compile(r"\.\./shared\b|/work/shared\b")
    found = [f"{p.relative_to(REPO)}" for p in code_files()
             if p.parts[len(REPO.parts)] != "bench" and outside.search(code_text(p))]
    assert found == []
