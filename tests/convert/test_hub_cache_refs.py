"""A conversion from the hub leaves the hub cache as huggingface-hub's own downloads
leave it: Deltafin downloads by the commit it listed, and writes `refs/main` (or the
branch asked for) as `snapshot_download` does for a download by name, so the model
is found by name offline afterwards, by mlx-lm and by Deltafin (loopback hub:
deltafin_mlx/testing/fake_hub.py)."""

import os
import subprocess
import sys

import pytest

from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.testing import zoo
from deltafin_mlx.testing.fake_hub import FakeHub
from helpers import BIN


def run(args, env, tool="deltafin-convert"):
    return subprocess.run([str(BIN / tool), *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return zoo.write(tmp_path_factory.mktemp("src") / "moe", "ernie4_5_moe", bits=4)


def test_after_a_hub_conversion_the_model_is_found_by_name_offline(source, tmp_path):
    with FakeHub() as hub:
        commit = hub.add("someone/moe", source).commit
        env = hub.env(tmp_path / "hf")
        p = run(["someone/moe", tmp_path / "out", "--quiet"], env)
        assert p.returncode == 0, p.stderr
    repo = tmp_path / "hf" / "hub" / "models--someone--moe"
    assert (repo / "refs" / "main").read_text() == commit
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    # mlx-lm by name, from the cache alone (the hub is gone).
    p = subprocess.run([sys.executable, "-c", "import mlx_lm; mlx_lm.load('someone/moe')"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, **offline})
    assert p.returncode == 0, p.stderr[-2000:]
    # Deltafin by name: experts linked where they lie in that cache.
    p = run(["someone/moe", tmp_path / "linked", "--link-experts", "--quiet"], offline)
    assert p.returncode == 0, p.stderr
    assert read_manifest(tmp_path / "linked").linked is not None


def test_a_branch_asked_for_is_the_ref_written(source, tmp_path):
    with FakeHub() as hub:
        commit = hub.add("someone/moe", source).commit
        p = run(["someone/moe", tmp_path / "out", "--quiet", "--revision", "main"],
                hub.env(tmp_path / "hf"))
        assert p.returncode == 0, p.stderr
        p = run(["someone/moe", tmp_path / "again", "--quiet", "--revision", commit],
                hub.env(tmp_path / "hf2"))
        assert p.returncode == 0, p.stderr
    assert (tmp_path / "hf" / "hub" / "models--someone--moe" / "refs" / "main").read_text() \
        == commit
    # Asked by commit, as huggingface-hub does: no ref names it.
    assert not (tmp_path / "hf2" / "hub" / "models--someone--moe" / "refs" / "main").exists()
