"""Failing reads: corrupt or truncated records, transient and persistent I/O errors, tmpfs and
filesystems refusing O_DIRECT; a clear error naming the bank, or the clean tokens."""

import errno
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import deltafin_mlx.engine.load as loader_mod
import deltafin_mlx.engine.reader as reader_mod
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.reader import ReadError
from deltafin_mlx.format.bank import read_layout
from deltafin_mlx.format.manifest import ModelError
from deltafin_mlx.testing.decode import greedy

from helpers import FAST, PROMPT, close, demanded_records, no_hang, report


@pytest.mark.parametrize("threads,read_mode", [(0, "direct"), (2, "mmap"), (2, "direct")])
def test_a_corrupt_record_read_during_generation_names_layer_and_expert(
        work, threads, read_mode):
    records = sorted(set(demanded_records(work)))
    rng = random.Random(7 + threads)
    for bank_path, expert in rng.sample(records, 6):
        layout = read_layout(bank_path)
        off = layout.record_offset(expert) + rng.randrange(layout.record_size)
        with open(bank_path, "r+b") as f:
            f.seek(off)
            byte = f.read(1)
            f.seek(off)
            f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
        try:
            model, _ = load(work, **{**FAST, "reader_threads": threads, "read_mode": read_mode,
                                     "lookahead": threads > 0})
            try:
                with no_hang(), pytest.raises(ReadError) as info:
                    greedy(model, PROMPT, 4)
            finally:
                close(model)
            msg = str(info.value)
            assert bank_path in msg and f"layer {layout.layer} expert {expert} " in msg, msg
        finally:
            with open(bank_path, "r+b") as f:
                f.seek(off)
                f.write(byte)
    report(f"corrupt records caught in generation (threads={threads}, {read_mode})", 6)


TRUNCATE_WHILE_LOADED = """
import os, sys, mlx.core as mx
from deltafin_mlx.engine.load import load
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.engine.reader import ReadError
path = sys.argv[1]
m = read_manifest(path)
models = {mode: load(path, cache_slots=4, reader_threads=0, lookahead=False, read_mode=mode,
                     tokenizer=False)[0] for mode in ("direct", "mmap")}
for layer in m.moe_layers:
    os.truncate(m.bank_path(layer), 4096 + 100)
for mode, model in models.items():
    try:
        mx.eval(model(mx.array([[1, 2, 3]])))
        print(mode, "NO ERROR")
    except ReadError as e:
        print(mode, "ReadError", e)
"""


def test_bank_truncated_while_loaded_is_a_read_error_not_a_crash(k3, tmp_path):
    """Loaded first, then every bank is cut short: each read mode reports the bank
    and offset (mmap would otherwise die of SIGBUS: run in a child process)."""
    path = tmp_path / "model"
    shutil.copytree(k3, path)
    p = subprocess.run([sys.executable, "-c", TRUNCATE_WHILE_LOADED, str(path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 2, p.stdout
    for line, mode in zip(lines, ("direct", "mmap")):
        assert line.startswith(f"{mode} ReadError"), line
        assert str(path / "experts") in line and "offset" in line and "truncated" in line, line
    # Refused at load from now on, naming the file.
    with pytest.raises(ModelError, match=r"layer-\d+\.bank.*truncated or modified"):
        load(path, tokenizer=False)


@pytest.fixture(scope="module")
def eio_target(k3):
    """A record every clean run reads (its bank, expert and offset) and the clean
    run's tokens and logits."""
    bank_path, expert = demanded_records(k3)[2]
    layout = read_layout(bank_path)
    model, _ = load(k3, **FAST)
    tokens, logits = greedy(model, PROMPT, 6)
    close(model)
    return dict(path=bank_path, ino=os.stat(bank_path).st_ino,
                offset=layout.record_offset(expert), tokens=tokens, logits=logits)


def inject(monkeypatch, target, kind, times):
    """Make os.preadv of the target record fail `times` times (None: always)."""
    real = os.preadv
    seen = {"faults": 0}

    def preadv(fd, buffers, offset, *a):
        if (offset == target["offset"] and os.fstat(fd).st_ino == target["ino"]
                and (times is None or seen["faults"] < times)):
            seen["faults"] += 1
            if kind == "eio":
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            if kind == "garbage-then-eio":  # the device wrote part of the buffer, then failed
                for b in buffers:
                    np.frombuffer(b, np.uint8)[:] = 0xEE
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            # a short count: half the record arrived, the rest of the buffer is stale
            n = real(fd, buffers, offset, *a)
            skip = n // 2
            for b in buffers:
                view = np.frombuffer(b, np.uint8)
                view[max(0, min(view.size, skip)):] = 0xEE
                skip -= view.size
            return n // 2
        return real(fd, buffers, offset, *a)

    monkeypatch.setattr(os, "preadv", preadv)
    return seen


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("kind", ["eio", "short", "garbage-then-eio"])
def test_transient_read_errors_are_retried_and_tokens_equal_the_clean_run(
        k3, eio_target, monkeypatch, threads, kind):
    seen = inject(monkeypatch, eio_target, kind, times=reader_mod.READ_RETRIES)
    # checks off: the retry itself, not the checksum, must keep partial reads out.
    model, _ = load(k3, **{**FAST, "reader_threads": threads, "lookahead": threads > 0,
                           "verify": False, "record_checks": "off"})
    with no_hang():
        tokens, logits = greedy(model, PROMPT, 6)
    close(model)
    assert seen["faults"] == reader_mod.READ_RETRIES  # the faults did happen
    assert (tokens == eio_target["tokens"]).all()
    assert mx.array_equal(logits, eio_target["logits"]).item()


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("kind", ["eio", "short"])
def test_persistent_read_errors_name_the_bank_and_offset(
        k3, eio_target, monkeypatch, threads, kind):
    seen = inject(monkeypatch, eio_target, kind, times=None)
    model, _ = load(k3, **{**FAST, "reader_threads": threads, "lookahead": threads > 0,
                           "verify": False})
    try:
        with no_hang(), pytest.raises(ReadError) as info:
            greedy(model, PROMPT, 6)
        msg = str(info.value)
        assert eio_target["path"] in msg and f"offset {eio_target['offset']} " in msg, msg
        assert ("Input/output error" if kind == "eio" else "short read") in msg, msg
        assert seen["faults"] >= reader_mod.READ_RETRIES + 1
        # The device recovers: the same loaded model now gives the clean tokens, so
        # nothing of the failed read was kept as if it were the expert.
        monkeypatch.undo()
        with no_hang():
            tokens, logits = greedy(model, PROMPT, 6)
        assert (tokens == eio_target["tokens"]).all()
        assert mx.array_equal(logits, eio_target["logits"]).item()
    finally:
        close(model)


def opened_banks(monkeypatch):
    opened = []
    real = loader_mod.open_bank

    def spy(*a, **k):
        bank = real(*a, **k)
        opened.append(bank)
        return bank

    monkeypatch.setattr(loader_mod, "open_bank", spy)
    return opened


@pytest.fixture
def tmpfs_dir(tmp_path):
    """A tmpfs directory: a fresh mount, else /dev/shm if it is a tmpfs."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode == 0:
        try:
            yield mnt
        finally:
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        return
    shm = Path("/dev/shm")
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(shm)], capture_output=True, text=True)
    if fs.returncode != 0 or fs.stdout.strip() != "tmpfs" or not os.access(shm, os.W_OK):
        pytest.skip("no tmpfs to mount or use")
    d = Path(shutil.mkdtemp(dir=shm, prefix="deltafin-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def assert_direct_load_matches(path, threads, target):
    """The model at `path`, loaded with --read-mode direct, decodes `target`'s
    tokens and logits exactly."""
    model, _ = load(path, **{**FAST, "read_mode": "direct", "reader_threads": threads})
    try:
        tokens, logits = greedy(model, PROMPT, 6)
    finally:
        close(model)
    assert (tokens == target["tokens"]).all()
    assert mx.array_equal(logits, target["logits"]).item()


@pytest.mark.parametrize("threads", [0, 2])
def test_model_on_tmpfs_reads_correctly_whatever_tmpfs_does_with_o_direct(
        k3, tmpfs_dir, eio_target, monkeypatch, threads):
    path = tmpfs_dir / "model"
    shutil.copytree(k3, path)
    opened = opened_banks(monkeypatch)
    assert_direct_load_matches(path, threads, eio_target)
    assert opened


@pytest.mark.parametrize("threads", [0, 2])
def test_filesystem_refusing_o_direct_falls_back_to_buffered_reads(
        k3, eio_target, monkeypatch, threads):
    """Linux >= 6.6 tmpfs accepts O_DIRECT, so the refusal (EINVAL at open, as older
    tmpfs and some FUSE filesystems give) is simulated."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open
    refused = {"n": 0}

    def no_direct_open(path, flags, *a, **k):
        if flags & os.O_DIRECT:
            refused["n"] += 1
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *a, **k)

    dropped = {"n": 0}
    real_fadvise = os.posix_fadvise

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_DONTNEED:
            dropped["n"] += 1
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "open", no_direct_open)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    opened = opened_banks(monkeypatch)
    assert_direct_load_matches(k3, threads, eio_target)
    assert refused["n"] == len(opened) > 0
    assert not any(b.direct for b in opened)
    assert dropped["n"] > 0  # buffered reads drop the pages they read


def test_o_direct_is_used_where_the_filesystem_allows_it(k3, monkeypatch):
    """The control for the fallback test: on a filesystem that takes O_DIRECT the
    banks are read with it (else the fallback test above would prove nothing)."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    probe = next(k3.glob("experts/*.bank"))
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError as e:
        pytest.skip(f"{probe.parent} does not take O_DIRECT ({e.strerror})")
    opened = opened_banks(monkeypatch)
    model, _ = load(k3, **{**FAST, "read_mode": "direct"})
    close(model)
    assert opened and all(b.direct for b in opened)
