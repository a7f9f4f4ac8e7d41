"""mlx-lm executes the `model_file` config.json names (--trust-remote-code) before
any Deltafin code runs, so nothing of Deltafin's can stop a config.json pointing
it outside the model directory; `deltafin-run verify` names such a config.json as
dangerous (and transformers' `auto_map` code outside it, or from another hub
repository), exits 1, and the README says so where the drop-in is introduced."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import BIN

README = Path(__file__).resolve().parents[2] / "README.md"


def verify(model, *more):
    return subprocess.run([str(BIN / "deltafin-run"), "verify", str(model), *more],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("edit, named", [
    ({"model_file": "../evil.py"}, "../evil.py"),
    ({"model_file": "/tmp/evil.py"}, "/tmp/evil.py"),
    ({"auto_map": {"AutoModel": "../../evil.Model"}}, "../../evil.Model"),
    ({"auto_map": {"AutoTokenizer": ["someone/repo--tok.Tokenizer", None]}},
     "someone/repo--tok.Tokenizer"),
], ids=["model_file ..", "model_file absolute", "auto_map ..", "auto_map other repo"])
def test_verify_names_code_outside_the_model_directory_as_dangerous(converted, tmp_path,
                                                                     edit, named):
    model = tmp_path / "m"
    shutil.copytree(converted("kimi_k3"), model)
    config = json.loads((model / "config.json").read_text())
    config.update(edit)
    (model / "config.json").write_text(json.dumps(config))
    r = verify(model)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    said = [l for l in r.stderr.splitlines() if "DANGEROUS" in l]
    assert len(said) == 1 and "config.json" in said[0] and named in said[0], r.stderr
    report = json.loads(verify(model, "--json").stdout)
    assert not report["ok"] and named in report["dangerous"][0]


def test_a_model_as_converted_is_not_dangerous(converted):
    r = verify(converted("kimi_k3"))
    assert r.returncode == 0 and "DANGEROUS" not in r.stderr, r.stderr


def test_the_readme_says_so_where_the_drop_in_is_introduced():
    section = README.read_text().split("### With mlx-lm", 1)[1].split("\n## ", 1)[0]
    assert "deltafin-run verify" in section and "model_file" in section
