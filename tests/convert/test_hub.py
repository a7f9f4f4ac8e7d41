"""Hub ids, against a Hugging Face hub on loopback (deltafin_mlx/testing/fake_hub.py):
conversion from the hub (its cache's snapshot files are symlinks into blobs/), plan and
info fetching only config.json, and one line for each way fetching can fail."""

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from deltafin_mlx.format.manifest import MANIFEST_NAME, read_manifest
from deltafin_mlx.testing.fake_hub import FakeHub
from helpers import BIN

PLAN_RATES = ["--disk-gbps", "2", "--compute-gwps", "3"]


def run(args, env, tool="deltafin-run", timeout=300):
    return subprocess.run([str(BIN / tool), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


def one_error_line(p, *words):
    err = p.stderr.strip()
    assert p.returncode == 1, (p.returncode, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


@pytest.fixture
def hub(sources):
    with FakeHub() as h:
        h.add("someone/k3", sources("kimi_k3"))
        h.add("someone/gated", sources("kimi_k3"), gated=True)
        yield h


def same_files(a: Path, b: Path):
    """Two conversions hold the same files with the same bytes (the manifest
    apart: it names its source and the time)."""
    ma, mb = read_manifest(a), read_manifest(b)
    assert ma.files == mb.files and ma.checksums == mb.checksums


def test_convert_a_hub_id_downloads_and_converts_it_like_the_local_directory(
        hub, tmp_path, converted):
    env = hub.env(tmp_path / "hf")
    p = run(["someone/k3", tmp_path / "out", "--quiet"], env, tool="deltafin-convert")
    assert p.returncode == 0, p.stderr
    snapshot = next((tmp_path / "hf" / "hub" / "models--someone--k3" / "snapshots").iterdir())
    # The hub cache keeps files as symlinks into blobs/: they are the source's files.
    assert (snapshot / "config.json").is_symlink()
    same_files(tmp_path / "out", converted("kimi_k3"))
    assert read_manifest(tmp_path / "out").source["id"] == "someone/k3"


@pytest.mark.parametrize("tool", ["deltafin-convert", "plan", "info"])
@pytest.mark.parametrize("repo,revision,words", [
    ("someone/none", None, ["someone/none", "no such repository"]),
    ("someone/gated", None, ["someone/gated", "gated", "hf auth login"]),
    ("someone/k3", "v9", ["someone/k3", "no revision 'v9'", "--revision"]),
])
def test_a_missing_or_gated_repository_or_a_wrong_revision_is_one_line(
        hub, tmp_path, tool, repo, revision, words):
    env = hub.env(tmp_path / "hf")
    extra = ["--revision", revision] if revision else []
    if tool == "deltafin-convert":
        p = run([repo, tmp_path / "out", *extra], env, tool=tool)
        assert not (tmp_path / "out").exists()
    else:
        p = run([tool, repo, *extra, *(PLAN_RATES if tool == "plan" else [])], env)
    one_error_line(p, *words)


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("command", ["plan", "info", "convert"])
def test_an_unreachable_hub_fails_fast_in_one_line_naming_hf_hub_offline(tmp_path, command):
    env = {"HF_ENDPOINT": _closed_port(), "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0"}

    def timed(env):
        start = time.perf_counter()
        if command == "convert":
            p = run(["someone/k3", tmp_path / "out"], env, tool="deltafin-convert")
        else:
            p = run([command, "someone/k3", *(PLAN_RATES if command == "plan" else [])], env)
        return p, time.perf_counter() - start

    # The baseline: the same command told to stay offline fails without a connection,
    # so what it costs is starting the process, as slow as the machine is loaded.
    _, baseline = timed({**env, "HF_HUB_OFFLINE": "1"})
    p, took = timed(env)
    one_error_line(p, "someone/k3", "offline", "HF_HUB_OFFLINE")
    # It was ~24 s of silent retries (sleeps, which a loaded machine does not stretch).
    assert took < 2 * baseline + 10, f"{took:.1f} s before failing, {baseline:.1f} s offline"


def test_plan_and_info_of_a_hub_id_fetch_only_config_json(hub, tmp_path, sources):
    env = hub.env(tmp_path / "hf")
    p = run(["plan", "someone/k3", "--json", "--budget", "50MB", *PLAN_RATES], env)
    assert p.returncode == 0, p.stderr
    local = run(["plan", sources("kimi_k3") / "config.json", "--json", "--budget", "50MB",
                 *PLAN_RATES], {})
    assert json.loads(p.stdout)["floor_bytes"] == json.loads(local.stdout)["floor_bytes"]
    p = run(["info", "someone/k3", "--json"], env)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    weights = sum(f.stat().st_size for f in sources("kimi_k3").glob("*.safetensors"))
    assert (r["architecture"], r["checkpoint_bytes"], r["converted"]) == ("kimi_k3", weights,
                                                                           False)
    p = run(["info", "someone/k3"], env)
    assert p.returncode == 0 and "deltafin-convert someone/k3" in p.stdout, p.stderr
    fetched = {path.rsplit("/", 1)[1] for method, path in hub.requests if "/resolve/" in path}
    assert fetched == {"config.json"}


def test_a_hub_snapshot_file_resolving_outside_the_repository_cache_is_refused(
        hub, tmp_path):
    """The source root is the repository's cache folder (blobs/ included), no wider."""
    env = hub.env(tmp_path / "hf")
    assert run(["plan", "someone/k3", *PLAN_RATES], env).returncode == 0  # caches config.json
    snap = next((tmp_path / "hf" / "hub" / "models--someone--k3" / "snapshots").iterdir())
    outside = tmp_path / "elsewhere.json"
    outside.write_text((snap / "config.json").read_text())
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(outside)
    p = run(["someone/k3", tmp_path / "out", "--quiet"], env, tool="deltafin-convert")
    one_error_line(p, "config.json", "outside the source directory")
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()


def test_plan_prints_the_disk_of_each_route_from_the_published_sizes(hub, tmp_path, sources,
                                                                     converted):
    """download + packed, linked, and from the hub with a scratch: the hub's listing
    and a local directory give the same figures, close to what conversion writes."""
    env = hub.env(tmp_path / "hf")
    p = run(["plan", "someone/k3", "--json", *PLAN_RATES], env)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)["disk_routes"]
    local = json.loads(run(["plan", sources("kimi_k3"), "--json", *PLAN_RATES], {}).stdout)
    assert local["disk_routes"] == d
    src = sources("kimi_k3")
    assert d["download_bytes"] == sum(f.stat().st_size for f in src.iterdir())
    assert d["largest_shard_bytes"] == max(f.stat().st_size for f in src.glob("*.safetensors"))
    written = sum(read_manifest(converted("kimi_k3")).files.values())
    assert abs(d["packed_output_bytes"] - written) < 0.05 * written
    assert d["linked_output_bytes"] < d["packed_output_bytes"] / 2
    assert d["download_and_packed_bytes"] == d["download_bytes"] + d["packed_output_bytes"]
    assert d["hub_with_scratch_bytes"] < d["download_and_packed_bytes"]
    text = run(["plan", "someone/k3", *PLAN_RATES], env).stdout
    assert "disk routes" in text and "--link-experts" in text and "--scratch-limit" in text


def test_a_downloaded_shard_not_matching_its_oid_is_refused(sources, tmp_path):
    """huggingface-hub keeps what it downloaded without checking it: the converter
    hashes each hub-cache shard against the sha256 its blob is named by."""
    bad = sorted(p.name for p in sources("kimi_k3").glob("*.safetensors"))[1]
    with FakeHub() as h:
        h.add("someone/k3", sources("kimi_k3"), corrupt={bad})
        p = run(["someone/k3", tmp_path / "out", "--quiet"], h.env(tmp_path / "hf"),
                tool="deltafin-convert")
    one_error_line(p, bad, "do not match the hub's sha256")
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
