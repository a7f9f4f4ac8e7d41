"""Helpers the tests share, imported by name (`from helpers import make_source`):
pytest puts tests/ on the import path (pyproject.toml), and tests/model/dist_worker.py,
which mlx.launch starts outside pytest, gets it through PYTHONPATH. Fixtures live in
conftest.py; what a test or a worker calls directly lives here."""

import contextlib
import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map_with_path
from mlx_lm.utils import load_model, quantize_model

import deltafin_mlx.cli.main as cli
import deltafin_mlx.engine.reader as reader_mod
from deltafin_mlx import runtime
from deltafin_mlx.cli.main import main
from deltafin_mlx.engine.load import load
from deltafin_mlx.format.integrity import file_checksum, format_checksum
from deltafin_mlx.format.manifest import MANIFEST_NAME
from deltafin_mlx.testing.decode import greedy
from deltafin_mlx.testing.synthetic import make_checkpoint

# The installed commands (deltafin-run, deltafin-convert) beside the running python.
BIN = Path(sys.executable).parent

# Affine fixtures use widths that every group size divides, so mlx-lm quantizes
# exactly the modules Deltafin does.
FIXTURE_OVERRIDES = {
    "kimi_k3": {},
    "kimi_k2": {"moe_intermediate_size": 128},
    "qwen3_moe": {"moe_intermediate_size": 128},
    "mixtral": {"moe_intermediate_size": 128},
}


def zoo_conversions(root: Path):
    """get(model_type, bits) -> (source, conversion) of a zoo type at `bits` (None:
    its float source), each written once under `root`."""
    from deltafin_mlx.convert.convert import ConvertOptions, convert
    from deltafin_mlx.testing import zoo

    cache = {}

    def get(model_type, bits):
        if (model_type, bits) not in cache:
            name = f"{model_type}-{bits or 'float'}"
            src = zoo.write(root / "src" / name, model_type, bits)
            convert(str(src), root / "out" / name, ConvertOptions(progress=False))
            cache[model_type, bits] = (src, root / "out" / name)
        return cache[model_type, bits]

    return get


def make_source(path, arch, **overrides):
    return make_checkpoint(path, arch, seed=0, **{**FIXTURE_OVERRIDES[arch], **overrides})


def reference_model(src, trunk_bits=4, group_size=64, expert_bits=4, expert_group_size=64):
    """What `mlx_lm.convert -q` makes of `src`, loaded fully in memory at float32:
    load lazily, cast to the config dtype, quantize with the model's own predicate
    (and the expert settings for switch_mlp; expert_bits "float": left in float),
    exactly as mlx_lm.convert does."""
    model, config = load_model(Path(src), lazy=True)
    dtype = config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    cast = getattr(model, "cast_predicate", lambda _: True)
    dt = getattr(mx, dtype)
    model.update(
        tree_map_with_path(
            lambda k, v: v.astype(dt) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    own = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if "switch_mlp" in path:
            return expert_bits != "float" and {"group_size": expert_group_size,
                                               "bits": expert_bits, "mode": "affine"}
        if trunk_bits is None:
            return False
        return own(path, module) if own else True

    model, _ = quantize_model(
        model, config, group_size, trunk_bits or 4, quant_predicate=predicate
    )
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


@contextmanager
def small_filesystem(tmp_path: Path, size: str):
    """A tmpfs of `size` ("4m") of the test's own at tmp_path/fs, for disk-full cases
    (the test is skipped where mounting is not permitted)."""
    import pytest

    mnt = tmp_path / "fs"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(p.stderr or p.stdout).strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(fs: Path) -> Path:
    """Take every free byte of the filesystem `fs`; returns the filler file (delete
    it to free them)."""
    filler = fs / "filler"
    with open(filler, "ab", buffering=0) as f:
        for size in (1 << 20, 1 << 16, 4096, 1):
            block = b"\xee" * size
            while True:
                try:
                    if f.write(block) != size:
                        break
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    return filler


REPO = Path(__file__).resolve().parents[1]


FAKE_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def run_command(args, stdin=None, env=None, cwd=None, tool="deltafin-run", timeout=300):
    return subprocess.run([str(BIN / tool), *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})


# Runs a command as its own child and prints that child's peak RSS (KiB) and exit
# status. Linux carries the RSS high-water mark of the process that calls exec into
# the new program's, so a command started straight from a test process (an xdist
# worker holds hundreds of MB of fixtures) would report the test's peak; forked from
# this small launcher instead, its peak is its own.
_PEAK_LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
print(usage.ru_maxrss, os.waitstatus_to_exitcode(status))
"""


def run_measured(args, tool="deltafin-run", timeout=120):
    """A command's exit status, stderr, peak RSS in bytes (its own, from wait4 in
    `_PEAK_LAUNCHER`) and seconds; killed after `timeout` seconds (its status then
    says so)."""
    import tempfile
    import time

    with tempfile.TemporaryFile() as err:
        start = time.monotonic()
        p = subprocess.Popen([sys.executable, "-c", _PEAK_LAUNCHER, str(BIN / tool),
                              *map(str, args)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
            return -signal.SIGKILL, "", 0, time.monotonic() - start
        seconds = time.monotonic() - start
        err.seek(0)
        peak_kib, code = map(int, out.split())
        return code, err.read().decode(errors="replace"), peak_kib * 1024, seconds


def one_error_line(p_or_err, *words):
    err = (p_or_err if isinstance(p_or_err, str) else p_or_err.stderr).strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert " error: " in err, err
    for w in words:
        assert w in err, err
    return err


def fake_hub_cache(hf_home: Path, repo: str, files_from: Path, only=None):
    """A Hugging Face hub cache holding `repo` as if downloaded earlier: with
    HF_HUB_OFFLINE=1 the hub client resolves it without any network."""
    base = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / FAKE_COMMIT
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(FAKE_COMMIT)
    for f in files_from.iterdir():
        if only is None or f.name in only:
            shutil.copy(f, snap / f.name)
    return snap


def run_json(capsys, *args):
    capsys.readouterr()
    assert main([*map(str, args), "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


LOAD = dict(tokenizer=False, cache_slots=4, reader_threads=0, lookahead=False)


def reseal(path: Path, *rels):
    """Record the current size and checksum of `rels` in the manifest (and the
    config hash for config.json): what someone editing a file on purpose does."""
    d = json.loads((path / MANIFEST_NAME).read_text())
    for rel in rels:
        d["files"][rel] = (path / rel).stat().st_size
        d["checksums"][rel] = format_checksum(file_checksum(path / rel))
        if rel == "config.json":
            d["source"]["config_sha256"] = hashlib.sha256((path / rel).read_bytes()).hexdigest()
    (path / MANIFEST_NAME).write_text(json.dumps(d))


def run_cli(*args, env=None, timeout=120):
    p = subprocess.run([str(BIN / "deltafin-run"), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    return p.returncode, p.stderr


def only_stderr_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def overwrite_bytes(p: Path, offset: int, data: bytes):
    with open(p, "r+b") as f:
        f.seek(offset)
        f.write(data)


def run_main(capsys, *args):
    """deltafin-run in this process: (exit status, its one stderr line)."""
    code = cli.main(list(map(str, args)))
    return code, only_stderr_line(capsys.readouterr().err)


PROMPT = mx.array([[1, 5, 9, 200, 17, 33]])


# Few slots, reads in the caller, no speculation: every run reads the same records.
FAST = dict(cache_slots=4, reader_threads=0, lookahead=False, verify=True,
            activation_dtype=mx.float32, memory_budget="2GB", tokenizer=False)


FIGURES = Counter()


def report(name, n):
    FIGURES[name] += n
    print(f"\n[reliability] {name}: {n}")


@contextlib.contextmanager
def no_hang(seconds=30):
    """Fail (instead of hanging the suite) if the block runs longer than `seconds`."""

    def expired(*_):
        raise TimeoutError(f"no result after {seconds} s (hang?)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def first_logits(model):
    y = model(PROMPT)
    mx.eval(y)
    return y


def close(model):
    runtime(model).close()


def demanded_records(path, **settings_):
    """(bank path, expert) of every record a clean greedy run reads, in order."""
    seen = []
    real = reader_mod.read_record

    def spy(bank, expert, *a, **k):
        seen.append((bank.path, expert))
        return real(bank, expert, *a, **k)

    reader_mod.read_record = spy
    try:
        model, _ = load(path, **{**FAST, **settings_})
        greedy(model, PROMPT, 4)
        close(model)
    finally:
        reader_mod.read_record = real
    return seen


def run_tool(*args, stdin=None, timeout=300):
    return subprocess.run([str(BIN / args[0]), *map(str, args[1:])], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def run_convert_patched(patch: str, src, out, *flags):
    """deltafin-convert SRC OUT FLAGS in a fresh interpreter, after `patch` (Python
    source run with os, signal, sys and the command's module as `c` imported)."""
    program = ("import os, signal, sys\nimport deltafin_mlx.cli.convert as c\n" + patch
               + f"sys.argv = ['deltafin-convert', sys.argv[1], sys.argv[2], *{list(flags)!r}]\n"
               "sys.exit(c.main())\n")
    return subprocess.run([sys.executable, "-c", program, str(src), str(out)],
                          capture_output=True, text=True, timeout=300)


def one_line_error(out) -> str:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    return out.stderr
