"""Nothing that comes with a model runs. A hub repository in mlx-community's layout that
ships a tokenizer module (`tokenization_x.py`, named by `auto_map`) is converted, run and
verified on a real terminal: transformers' "run the custom code? [y/N]" question never
appears, the module is never imported (it would leave a marker file), the conversion
copies neither the module nor `auto_map`, and `verify` names a directory that carries
either as dangerous."""

import json
import os
import pty
import select
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from deltafin_mlx.testing.fake_hub import FakeHub
from helpers import BIN

MODULE = '''import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PreTrainedTokenizerFast as XTokenizer
'''


def with_code(src: Path, dst: Path, marker: Path) -> Path:
    """A copy of `src` whose tokenizer and config name a module it carries."""
    shutil.copytree(src, dst, symlinks=False)
    (dst / "tokenization_x.py").write_text(MODULE.format(marker=str(marker)))
    for name in ("tokenizer_config.json", "config.json"):
        doc = json.loads((dst / name).read_text())
        doc["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
        (dst / name).write_text(json.dumps(doc))
    return dst


def on_a_terminal(args, env, answer=b"y\n", timeout=300):
    """Run a command with its standard input and output on a pseudo-terminal,
    answering `answer` to anything it asks; returns (exit status, all it printed)."""
    main, side = pty.openpty()
    p = subprocess.Popen([str(a) for a in args], stdin=side, stdout=side, stderr=side,
                         env={**os.environ, **env}, close_fds=True)
    os.close(side)
    out, answered, end = b"", False, time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the command closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
                if not answered and b"[y/N]" in out:
                    os.write(main, answer)  # what a careless user would type
                    answered = True
            elif p.poll() is not None:
                break
        rc = p.wait(timeout=max(1.0, end - time.monotonic()))
    finally:
        if p.poll() is None:
            p.kill()
        os.close(main)
    return rc, out.decode("utf-8", "replace")


@pytest.fixture
def repo(sources, tmp_path):
    marker = tmp_path / "code-ran"
    src = with_code(sources("qwen3_moe"), tmp_path / "repo", marker)
    return src, marker


def test_a_hub_repository_carrying_code_converts_without_running_or_copying_it(repo, tmp_path):
    src, marker = repo
    with FakeHub() as hub:
        hub.add("someone/with-code", src)
        env = hub.env(tmp_path / "hf")
        out = tmp_path / "out"
        rc, said = on_a_terminal([BIN / "deltafin-convert", "someone/with-code", out, "--quiet"],
                                 env)
    assert rc == 0, said
    assert "[y/N]" not in said and "custom code" not in said, said
    assert not marker.exists()
    assert not [p.name for p in out.glob("*.py") if p.name != "deltafin_model.py"]
    for name in ("config.json", "tokenizer_config.json"):
        assert "auto_map" not in (out / name).read_text(), name
    r = subprocess.run([BIN / "deltafin-run", "verify", out], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "DANGEROUS" not in r.stderr, r.stderr


def test_a_model_directory_given_code_runs_none_of_it_and_verify_names_it(
        repo, converted, tmp_path):
    _, marker = repo
    model = tmp_path / "model"
    shutil.copytree(converted("qwen3_moe"), model)
    (model / "tokenization_x.py").write_text(MODULE.format(marker=str(marker)))
    doc = json.loads((model / "tokenizer_config.json").read_text())
    doc["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}
    (model / "tokenizer_config.json").write_text(json.dumps(doc))
    # The manifest checksums tokenizer_config.json: an edited one is refused before any
    # tokenizer is read; either way nothing runs and nothing is asked.
    rc, said = on_a_terminal([BIN / "deltafin-run", model, "Hello", "-n", "2", "--json"], {})
    assert "[y/N]" not in said and "custom code" not in said, said
    assert not marker.exists()
    r = subprocess.run([BIN / "deltafin-run", "verify", model], capture_output=True, text=True,
                       timeout=300)
    dangers = [l for l in r.stderr.splitlines() if "DANGEROUS" in l]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert any("tokenizer_config.json" in l and "tokenization_x.XTokenizer" in l
               for l in dangers), r.stderr
    assert any("tokenization_x.py" in l for l in dangers), r.stderr


def test_a_tokenizer_naming_its_own_code_loads_with_remote_code_off(repo, tmp_path):
    """The tokenizer is read as every command reads it: the module is not imported,
    whatever stdin holds (score from stdin once answered the question with its input)."""
    from deltafin_mlx.tokenizer.read import read_tokenizer

    src, marker = repo
    config = json.loads((src / "config.json").read_text())
    try:
        read_tokenizer(src, "huggingface", config)
    except Exception as e:  # refusing is fine; running the code is not
        assert "Traceback" not in str(e)
    assert not marker.exists()
