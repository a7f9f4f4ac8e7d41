"""`deltafin-convert OWNER/NAME OUT` against a hub on loopback that misbehaves
while a shard downloads: each failure is one line saying what happened, never
"offline: the Hugging Face hub cannot be reached" (the hub was reached).

- a shard sent with no Content-Length and an endless body is stopped at the size
  the hub lists (with --scratch-limit, where Deltafin downloads shards itself; at
  the largest listed file through huggingface-hub's snapshot download), so it
  cannot fill the disk;
- a hub that drops the connection mid-shard, or closes it early, is a
  "download cut short" (both with --scratch-limit and through huggingface-hub's
  snapshot download);
- a full disk is "disk full", naming the path that could not be written (a small
  tmpfs of the test's own: skipped where mounting one is not permitted)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltafin_mlx.convert.scratch import SCRATCH_NAME
from deltafin_mlx.testing.fake_hub import ENDLESS_BYTES, FakeHub
from helpers import fill, small_filesystem

CONVERT = Path(sys.executable).parent / "deltafin-convert"
REPO = "someone/k3"


def convert(args, env, timeout=300):
    p = subprocess.run([str(CONVERT), *map(str, args)], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stderr


def a_shard(src: Path) -> Path:
    return sorted(src.glob("*.safetensors"))[1]


def one_line(code, err):
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and "offline" not in err and "cannot be reached" not in err
    return err.strip()


@pytest.fixture
def small_fs(tmp_path):
    with small_filesystem(tmp_path, "16m") as mnt:
        yield mnt


@pytest.mark.parametrize("scratch", [True, False], ids=["scratch-limit", "snapshot"])
def test_an_endless_shard_is_stopped_at_its_listed_size(sources, tmp_path, scratch):
    """With --scratch-limit at the shard's own size; through huggingface-hub's
    snapshot download at the largest file the listing names."""
    src = sources("kimi_k3")
    shard = a_shard(src)
    with FakeHub() as hub:
        hub.add(REPO, src, misbehave={shard.name: "endless"})
        code, err = convert([REPO, tmp_path / "out", "--quiet",
                             *(["--scratch-limit", "40MB"] if scratch else [])],
                            hub.env(tmp_path / "hf"))
        served = hub.bytes_served
    line = one_line(code, err)
    assert "the hub sent more" in line, line
    if scratch:
        assert shard.name in line and f"more than the {shard.stat().st_size} bytes" in line
    # Stopped at the listed size: what the hub got out is that plus what the
    # sockets and one read chunk held, nowhere near the endless body.
    assert served < ENDLESS_BYTES // 8, served
    assert not list((tmp_path / "out" / SCRATCH_NAME).glob("*.part"))


@pytest.mark.parametrize("mode", ["die", "truncate"])
@pytest.mark.parametrize("scratch", [True, False], ids=["scratch-limit", "snapshot"])
def test_a_shard_broken_off_is_a_download_cut_short(sources, tmp_path, mode, scratch):
    """"die": the connection is dropped after half of the declared bytes;
    "truncate": no Content-Length, and a clean close after half."""
    src = sources("kimi_k3")
    shard = a_shard(src)
    with FakeHub() as hub:
        hub.add(REPO, src, misbehave={shard.name: mode})
        code, err = convert([REPO, tmp_path / "out", "--quiet",
                             *(["--scratch-limit", "40MB"] if scratch else [])],
                            hub.env(tmp_path / "hf"))
    line = one_line(code, err)
    assert "download cut short" in line, line
    if scratch:  # Deltafin's own download names the shard
        assert shard.name in line, line
    if scratch and mode == "truncate":  # ended cleanly: the count says it
        assert f"of the {shard.stat().st_size} bytes the hub lists" in line, line


def test_a_full_disk_under_the_scratch_is_said_naming_the_file(sources, tmp_path, small_fs):
    """The free space is checked up front; the disk fills up while a shard downloads
    (another program's doing): the line says so and names the file."""
    src = sources("kimi_k3")
    out = small_fs / "out"
    filler = None
    with FakeHub(rate=2e5) as hub:  # slow enough to fill the disk mid-shard
        hub.add(REPO, src)
        p = subprocess.Popen([str(CONVERT), REPO, str(out), "--scratch-limit", "8MB", "--quiet"],
                             env={**os.environ, **hub.env(tmp_path / "hf")},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while p.poll() is None and time.monotonic() < deadline:
            if list((out / SCRATCH_NAME).glob("*.safetensors.part")):
                filler = fill(small_fs)
                break
            time.sleep(0.005)
        _, err = p.communicate(timeout=300)
    assert filler is not None, "no shard download was seen: " + err
    line = one_line(p.returncode, err)
    assert "disk full" in line and str(out / SCRATCH_NAME) in line, line
    assert not list((out / SCRATCH_NAME).glob("*.part"))  # the partial file is gone


def test_a_full_hub_cache_is_said_naming_it(sources, tmp_path, small_fs):
    """Without --scratch-limit huggingface-hub downloads into its cache (HF_HOME),
    here a tmpfs smaller than the checkpoint."""
    src = sources("kimi_k3")
    subprocess.run(["mount", "-o", "remount,size=1m", str(small_fs)], check=True)
    with FakeHub() as hub:
        hub.add(REPO, src)
        code, err = convert([REPO, tmp_path / "out", "--quiet"], hub.env(small_fs / "hf"))
    line = one_line(code, err)
    assert "disk full" in line and str(small_fs / "hf") in line, line
