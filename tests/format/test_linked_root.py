"""A manifest whose linked source root holds a NUL byte (no path can) is refused
in one line naming that root, by every command that reads the manifest, instead
of Python's "embedded null byte"."""

import json
import subprocess

import pytest

from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.format.manifest import MANIFEST_NAME
from helpers import BIN



@pytest.fixture(scope="module")
def nul_root(sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("linked") / "out"
    convert(str(sources("kimi_k3")), out, ConvertOptions(link_experts=True, progress=False))
    d = json.loads((out / MANIFEST_NAME).read_text())
    d["experts"]["linked"]["root"] += "\x00evil"
    (out / MANIFEST_NAME).write_text(json.dumps(d))
    return out


@pytest.mark.parametrize("args", [["info"], ["verify"], [], ["plan"]],
                         ids=["info", "verify", "run", "plan"])
def test_a_nul_in_the_linked_root_is_one_line_naming_it(nul_root, args):
    cmd = [str(BIN / "deltafin-run"), *args, str(nul_root)] + (["hi", "-n", "1"] if not args
                                                               else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "NUL" in lines[0] and "\\x00evil" in lines[0], lines[0]
    assert "embedded null byte" not in lines[0]
