"""Conversions killed at random points or run out of disk: one clear line, and a rerun
resumes to the same bytes."""

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import deltafin_mlx.convert.convert as conv
from deltafin_mlx.cli import convert as cli
from deltafin_mlx.format.bank import BankWriter
from deltafin_mlx.format.manifest import MANIFEST_NAME, Manifest, PARTIAL_NAME, read_manifest

from helpers import fill, report, small_filesystem


def same_files(a: Path, b: Path):
    """Every file the manifest of `b` lists is byte-identical in `a`."""
    ma, mb = read_manifest(a), read_manifest(b)
    assert ma.files == mb.files
    for rel in mb.files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


ZYGOTE = r"""
import os, sys
import shutil
import mlx.core as mx
import deltafin_mlx.convert.convert as conv
from deltafin_mlx.format.bank import BankWriter
from deltafin_mlx.format.manifest import Manifest

SRC = sys.argv[1]

def install(kill_at, labels):
    count = [0]
    def tick(label):
        count[0] += 1
        labels.append(label)
        if count[0] == kill_at:
            os.kill(os.getpid(), 9)
    def wrap(owner, name):
        real = getattr(owner, name)
        def w(*a, **k):
            arg = next((str(x) for x in a[::-1] if isinstance(x, (str, os.PathLike))), "")
            tick(f"before {name} {os.path.basename(arg)}")
            r = real(*a, **k)
            tick(f"after {name} {os.path.basename(arg)}")
            return r
        setattr(owner, name, w)
    for owner, name in [(BankWriter, "__init__"), (BankWriter, "write_record"),
                        (BankWriter, "close"), (conv, "_save_safetensors"),
                        (conv, "write_json"), (mx, "save_safetensors"),
                        (os, "replace"), (os, "fsync"), (shutil, "copyfile"),
                        (Manifest, "write")]:
        wrap(owner, name)

for line in sys.stdin:
    n, out = line.split()
    n = int(n)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            labels = []
            install(n, labels)
            conv.convert(SRC, out, conv.ConvertOptions(progress=False))
            os.write(w, "\n".join(labels).encode())
        except BaseException:
            import traceback
            traceback.print_exc()
            os._exit(4)
        os._exit(3)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, st = os.waitpid(pid, 0)
    if os.WIFSIGNALED(st) and os.WTERMSIG(st) == 9:
        print("KILLED", n, out, flush=True)
    elif os.WIFEXITED(st) and os.WEXITSTATUS(st) == 3:
        print("FINISHED", n, out, flush=True)
        print("LABELS " + b"".join(chunks).decode().replace("\n", "|"), flush=True)
"""


class Zygote:
    """A child process that imports the converter once, then forks one conversion
    per request; the fork SIGKILLs itself at its Nth write-path call (N = 0: never)."""

    def __init__(self, src):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen([sys.executable, "-c", ZYGOTE, str(src)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)

    def run(self, n, out):
        self.p.stdin.write(f"{n} {out}\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline().split()
        assert line and line[0] in ("KILLED", "FINISHED") and line[1] == str(n), (
            f"conversion {n} {out} failed (see its traceback on stderr): {line}")
        labels = None
        if line[0] == "FINISHED":
            labels = self.p.stdout.readline().rstrip("\n")[len("LABELS "):].split("|")
        return line[0] == "KILLED", labels

    def close(self):
        self.p.stdin.close()
        self.p.wait(timeout=60)


@pytest.fixture(scope="module")
def kill_plan(sources, converted, tmp_path_factory):
    """The write-path calls (ticks) of one clean conversion, labelled, and the two
    edge windows: before the first state file exists, and after the manifest."""
    root = tmp_path_factory.mktemp("kills")
    zyg = Zygote(sources("kimi_k3"))
    killed, labels = zyg.run(0, root / "count")
    assert not killed
    same_files(root / "count", converted("kimi_k3"))  # the hooks change nothing
    first_partial = labels.index(f"after replace {PARTIAL_NAME}") + 1  # 1-based tick
    manifest_done = labels.index(f"after replace {MANIFEST_NAME}") + 1
    yield dict(zygote=zyg, root=root, labels=labels, first_partial=first_partial,
               manifest_done=manifest_done)
    zyg.close()


def resume_and_compare(src, out, ref, capsys):
    assert cli.main([str(src), str(out), "--quiet"]) == 0, capsys.readouterr().err
    same_files(out, ref)
    assert not (out / PARTIAL_NAME).exists()
    leftovers = [p.name for p in out.rglob("*") if ".tmp" in p.name]
    assert not leftovers, leftovers


def test_sigkill_at_random_points_always_resumes_to_the_same_bytes(
        kill_plan, sources, converted, capsys):
    src, ref = sources("kimi_k3"), converted("kimi_k3")
    zyg, root, labels = kill_plan["zygote"], kill_plan["root"], kill_plan["labels"]
    rng = random.Random(20240611)
    points = sorted(rng.sample(range(1, len(labels) + 1), 24))
    survived = []
    for n in points:
        out = root / f"kill-{n}"
        killed, _ = zyg.run(n, out)
        assert killed, n
        resume_and_compare(src, out, ref, capsys)
        survived.append(f"{n}:{labels[n - 1]}")
    # Killed again while resuming (early in the rerun), then resumed.
    twice = 0
    for n in sorted(rng.sample(range(1, len(labels) // 2), 4)):
        out = root / f"kill2-{n}"
        assert zyg.run(n, out)[0]
        assert zyg.run(rng.randrange(1, 12), out)[0]
        resume_and_compare(src, out, ref, capsys)
        twice += 1
    report(f"SIGKILL points survived (of {len(labels)} write-path ticks)", len(survived))
    report("double kills (kill, kill while resuming, resume) survived", twice)
    print("[reliability]   ticks:", ", ".join(survived))
    assert len(survived) >= 20


def test_sigkill_before_the_first_state_file_or_after_the_manifest_resumes(
        kill_plan, sources, converted, capsys):
    """The edges: killed before deltafin.partial.json exists (OUT holds only empty
    folders and temporary files), or between writing the manifest and removing the
    partial state. Every tick of both windows."""
    zyg, root = kill_plan["zygote"], kill_plan["root"]
    edges = list(range(1, kill_plan["first_partial"]))
    edges += list(range(kill_plan["manifest_done"], len(kill_plan["labels"]) + 1))
    for n in edges:
        out = root / f"edge-{n}"
        assert zyg.run(n, out)[0]
        resume_and_compare(sources("kimi_k3"), out, converted("kimi_k3"), capsys)
    report("SIGKILL edge points survived", len(edges))
    assert len(edges) >= 3


@pytest.fixture
def small_fs(tmp_path):
    with small_filesystem(tmp_path, "24m") as mnt:
        yield mnt


def fill_on_call(monkeypatch, owner, name, nth, fs, state, dest_in=None):
    """Fill `fs` just before the `nth` call of owner.name (after the converter's
    up-front free-space check has passed); with `dest_in`, counting only calls
    whose destination (second argument) lies in that directory."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def hooked(*a, **k):
        if dest_in is not None and not str(a[1]).startswith(str(dest_in)):
            return real(*a, **k)
        calls["n"] += 1
        if calls["n"] == nth:
            state["filler"] = fill(fs)
        return real(*a, **k)

    monkeypatch.setattr(owner, name, hooked)


DISK_FULL_AT = {
    "expert record": (BankWriter, "write_record", 21),
    "partial state": (conv, "write_json", 3),
    "trunk file": (conv, "_save_safetensors", 2),
    "tokenizer copy": (shutil, "copyfile", 1),  # the first copy into OUT
    "manifest": (Manifest, "write", 1),
}


@pytest.mark.parametrize("stage", sorted(DISK_FULL_AT))
def test_disk_full_mid_conversion_is_one_line_and_resumable(
        stage, small_fs, sources, converted, monkeypatch, capsys):
    src, ref = sources("kimi_k3"), converted("kimi_k3")
    out = small_fs / "out"
    state = {}
    owner, name, nth = DISK_FULL_AT[stage]
    fill_on_call(monkeypatch, owner, name, nth, small_fs, state,
                 dest_in=out if owner is shutil else None)
    code = cli.main([str(src), str(out), "--quiet"])
    err = capsys.readouterr().err
    monkeypatch.undo()
    assert "filler" in state, "the hook never ran"
    assert code == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deltafin-convert: error: "), err
    assert "disk full" in lines[0] and "rerun" in lines[0], err
    assert not (out / MANIFEST_NAME).exists()
    state["filler"].unlink()
    resume_and_compare(src, out, ref, capsys)


def test_too_little_space_up_front_is_one_line_and_rerun_works_once_freed(
        small_fs, sources, converted, capsys):
    src, ref = sources("kimi_k3"), converted("kimi_k3")
    out = small_fs / "out"
    filler = fill(small_fs)
    code = cli.main([str(src), str(out), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("deltafin-convert: error: not enough free disk space")
    assert "\n" not in err
    filler.unlink()
    resume_and_compare(src, out, ref, capsys)
