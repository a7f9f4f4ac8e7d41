"""`deltafin-convert OWNER/NAME OUT --scratch-limit SIZE` against a hub on loopback:
the disk in use (sampled during the run) stays within the output plus the limit, a
kill mid-download or mid-layer resumes re-downloading at most the shard in flight, a
shard whose bytes do not match its oid is refused, and a limit below the largest
shard is refused up front with the numbers."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltafin_mlx.convert.scratch import SCRATCH_NAME, disk_in_use
from deltafin_mlx.format.manifest import MANIFEST_NAME, PARTIAL_NAME, read_manifest
from deltafin_mlx.testing.fake_hub import FakeHub

CONVERT = Path(sys.executable).parent / "deltafin-convert"


def start(args, env):
    return subprocess.Popen([str(CONVERT), *map(str, args)], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p, timeout=300):
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def shard_sizes(src: Path):
    return {p.name: p.stat().st_size for p in src.glob("*.safetensors")}


def checkpoint_bytes(src: Path) -> int:
    return sum(p.stat().st_size for p in src.iterdir() if p.is_file())


def same_files(a: Path, b: Path):
    ma, mb = read_manifest(a), read_manifest(b)
    assert ma.files == mb.files and ma.checksums == mb.checksums


def scratch_bytes(out: Path) -> int:
    return disk_in_use(out / SCRATCH_NAME) if (out / SCRATCH_NAME).exists() else 0


def test_bounded_scratch_keeps_disk_within_output_plus_limit(sources, converted, tmp_path):
    src = sources("kimi_k3")
    small = checkpoint_bytes(src) - sum(shard_sizes(src).values())  # config, tokenizer
    limit = max(shard_sizes(src).values()) + small  # one shard at a time
    out = tmp_path / "out"
    samples = []
    with FakeHub(rate=2e6) as hub:  # slow enough to be sampled many times
        hub.add("someone/k3", src)
        p = start(["someone/k3", out, "--scratch-limit", str(limit)], hub.env(tmp_path / "hf"))
        while p.poll() is None:
            if out.exists():
                try:  # the state file: bookkeeping the manifest replaces at the end
                    state = (out / PARTIAL_NAME).stat().st_size
                except OSError:
                    state = 0
                samples.append((disk_in_use(out) - state, scratch_bytes(out)))
            time.sleep(0.005)
        code, stdout, err = finish(p)
    assert code == 0, err
    assert "download" in err and "disk in use" in err  # the progress line's figures
    assert len(samples) > 20
    final = disk_in_use(out)
    assert max(s for _, s in samples) <= limit
    assert max(total for total, _ in samples) <= final + limit
    assert not (out / SCRATCH_NAME).exists()
    same_files(out, converted("kimi_k3"))  # the same bytes: the same tokens


@pytest.mark.parametrize("when", ["mid-download", "mid-layer"])
def test_a_kill_then_a_rerun_downloads_at_most_one_shard_again(sources, converted, tmp_path,
                                                                when):
    src = sources("kimi_k3")
    out = tmp_path / "out"
    sizes = shard_sizes(src)
    with FakeHub(rate=1.5e6) as hub:
        hub.add("someone/k3", src)
        env = hub.env(tmp_path / "hf")
        p = start(["someone/k3", out, "--scratch-limit", "10MB"], env)
        deadline = time.time() + 120
        killed = False
        while p.poll() is None and time.time() < deadline:
            state = {}
            try:
                state = json.loads((out / PARTIAL_NAME).read_text())["done"]
            except (OSError, ValueError, KeyError):
                pass
            parts = list((out / SCRATCH_NAME).glob("*.part")) if out.exists() else []
            if when == "mid-download" and "0" in state and any(
                    q.stat().st_size > 0 for q in parts if q.exists()):
                killed = True
            if when == "mid-layer" and "0" in state and "1" not in state and (
                    out / "trunk" / "layer-00001.safetensors").exists():
                killed = True  # layer 1's trunk written, its bank not yet recorded
            if killed:
                p.send_signal(signal.SIGKILL)
                break
            time.sleep(0.0005)
        p.wait()
        assert killed, "the conversion ended before it could be killed"
        assert not (out / MANIFEST_NAME).exists()
        hub.rate = None
        p = start(["someone/k3", out, "--scratch-limit", "10MB", "--quiet"], env)
        code, _, err = finish(p)
        assert code == 0, err
        assert hub.bytes_served <= checkpoint_bytes(src) + max(sizes.values())
    same_files(out, converted("kimi_k3"))


def test_a_shard_not_matching_its_oid_is_refused_and_not_used(sources, tmp_path):
    src = sources("kimi_k3")
    bad = sorted(shard_sizes(src))[1]
    with FakeHub() as hub:
        hub.add("someone/k3", src, corrupt={bad})
        p = start(["someone/k3", tmp_path / "out", "--scratch-limit", "10MB", "--quiet"],
                  hub.env(tmp_path / "hf"))
        code, _, err = finish(p)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert bad in err and "sha256" in err
    assert not (tmp_path / "out" / SCRATCH_NAME / bad).exists()
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_a_scratch_limit_below_the_largest_shard_is_refused_up_front(sources, tmp_path):
    src = sources("kimi_k3")
    largest = max(shard_sizes(src).items(), key=lambda kv: kv[1])
    with FakeHub() as hub:
        hub.add("someone/k3", src)
        p = start(["someone/k3", tmp_path / "out", "--scratch-limit", "100kB"],
                  hub.env(tmp_path / "hf"))
        code, _, err = finish(p)
        served = hub.bytes_served
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "smaller than the largest shard" in err and largest[0] in err
    assert served < largest[1]  # refused before any shard was downloaded
    assert not (tmp_path / "out").exists()  # nothing left behind
