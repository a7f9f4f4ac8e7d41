"""A non-editable install carries every file the package reads: each file under
deltafin_mlx/ that is not Python (Kimi K3's config.json in testing/) matches a
pattern of pyproject.toml's [tool.setuptools.package-data]."""

import ast
import fnmatch
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def package_data() -> dict:
    text = (REPO / "pyproject.toml").read_text()
    section = re.search(r"^\[tool\.setuptools\.package-data\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, "pyproject.toml has no [tool.setuptools.package-data]"
    return {m.group(1): ast.literal_eval(m.group(2))
            for m in re.finditer(r'^"([\w.]+)"\s*=\s*(\[.*?\])', section.group(1), re.M)}


def test_every_data_file_of_the_package_is_packaged():
    patterns = package_data()
    data = [p for p in (REPO / "deltafin_mlx").rglob("*")
            if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert data  # the K3 config at least
    missing = []
    for path in data:
        package = ".".join(path.parent.relative_to(REPO).parts)
        if not any(fnmatch.fnmatch(path.name, g) for g in patterns.get(package, ())):
            missing.append(str(path.relative_to(REPO)))
    assert missing == []
