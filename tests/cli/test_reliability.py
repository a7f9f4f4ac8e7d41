"""Reliability: damaged model files, killed and disk-full conversions, failing reads
and odd memory budgets end in a clear error or a correct result; never a crash (any
other exception type), a hang, a read outside the model directory, or silently
wrong output.

Figures (fuzz cases run, kill points survived) are printed: run with `-s` to see them.
"""

import contextlib
import copy
import errno
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltafin_mlx.convert.convert as conv
import deltafin_mlx.engine.load as loader_mod
import deltafin_mlx.engine.reader as reader_mod
from deltafin_mlx.cli import convert as cli
from deltafin_mlx.format.bank import MAGIC, BankError, BankWriter, read_layout
from deltafin_mlx.format.dtypes import NUMPY
from deltafin_mlx.engine.load import load
from deltafin_mlx.format.manifest import MANIFEST_NAME, PARTIAL_NAME, Manifest, ModelError, read_manifest
from deltafin_mlx.plan.memory import BudgetError
from deltafin_mlx.engine.reader import ReadError, open_bank, read_record
from deltafin_mlx.format.aligned import aligned_empty
from deltafin_mlx.testing.decode import greedy
from helpers import fill, small_filesystem

from deltafin_mlx import runtime

CLEAR = (ModelError, BankError, ReadError, BudgetError)
PROMPT = mx.array([[1, 5, 9, 200, 17, 33]])
# Few slots, reads in the caller, no speculation: every run reads the same records.
FAST = dict(cache_slots=4, reader_threads=0, lookahead=False, verify=True,
            activation_dtype=mx.float32, memory_budget="2GB", tokenizer=False)
FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck))
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


# Every file opened (by Python code) outside the model while a check runs: hostile
# paths in a manifest must never make the runtime open files elsewhere.
_WATCH = {"on": False, "roots": (), "seen": []}


def _audit(event, args):
    if event == "open" and _WATCH["on"]:
        path = args[0]
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if isinstance(path, str):
            full = os.path.abspath(path)
            if any(full == r or full.startswith(r + os.sep) for r in _WATCH["roots"]):
                _WATCH["seen"].append(full)


sys.addaudithook(_audit)


@contextlib.contextmanager
def forbid_opens(*roots):
    _WATCH.update(on=True, roots=tuple(os.path.abspath(r) for r in roots), seen=[])
    try:
        yield
    finally:
        _WATCH["on"] = False
    assert not _WATCH["seen"], f"opened outside the model: {_WATCH['seen'][:3]}"


def first_logits(model):
    y = model(PROMPT)
    mx.eval(y)
    return y


def close(model):
    runtime(model).close()


def same_files(a: Path, b: Path):
    """Every file the manifest of `b` lists is byte-identical in `a`."""
    ma, mb = read_manifest(a), read_manifest(b)
    assert ma.files == mb.files
    for rel in mb.files:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


@pytest.fixture(scope="module")
def k3(converted):
    return converted("kimi_k3")


@pytest.fixture(scope="module")
def clean(k3):
    model, _ = load(k3, **FAST)
    out = first_logits(model)
    close(model)
    return out


@pytest.fixture(scope="module")
def work(k3, tmp_path_factory):
    """A copy of the model to damage (restored after each case) next to a decoy
    directory holding valid copies of its files, which hostile paths point at."""
    root = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(k3, root / "model")
    shutil.copytree(k3 / "experts", root / "decoy")
    shutil.copytree(k3 / "trunk", root / "decoy", dirs_exist_ok=True)
    return root / "model"


def check_outcome(path, clean_logits, forbidden=()):
    """Loading and running `path` gives a clear error naming a file of the model,
    or exactly the clean output. Returns "error" or "same"."""
    with no_hang(), forbid_opens(*forbidden):
        try:
            model, _ = load(path, **FAST)
        except CLEAR as e:
            assert str(path) in str(e), f"error does not name the file: {e}"
            return "error"
        try:
            try:
                y = first_logits(model)
            except CLEAR as e:
                assert str(path) in str(e), f"error does not name the file: {e}"
                return "error"
        finally:
            close(model)
    assert mx.array_equal(y, clean_logits).item(), "loaded a damaged model and got other logits"
    return "same"


# --- 1. fuzzing the manifest, the bank headers and the records ----------------------

HOSTILE_VALUES = [
    None, True, False, 0, -1, 1, 3, 4095, 4097, 2**31, 2**64, -2**63, 10**30, 0.5, 1e308,
    float("inf"), float("-inf"), float("nan"), "", "x", "16", "../../etc/passwd",
    "/etc/passwd", "../decoy/layer-00001.bank", "experts/../../decoy/layer-00002.bank",
    "../decoy/globals.safetensors", "trunk/globals.safetensors", "experts/layer-00002.bank",
    "a\x00b", "\udc80", [], [1, 2], [-4096], {}, {"a": 1},
]
HOSTILE_KEYS = ["../../etc/passwd", "/etc/passwd", "../decoy/layer-00001.bank", "99", "-1",
                "0", "2", "x", ""]


def json_paths(obj, prefix=()):
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += json_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += json_paths(v, prefix + (i,))
    return out


def values():
    return st.one_of(
        st.sampled_from(HOSTILE_VALUES),
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.text(max_size=12),
        st.lists(st.integers(-5, 1 << 20), max_size=3),
    )


def mutations(doc):
    """(op, path, value) triples over a JSON document: set, delete or rename,
    with paths drawn evenly over its top-level fields (not just the many tensors)."""
    groups = {}
    for p in json_paths(doc):
        groups.setdefault(str(p[0]), []).append(p)
    path = st.sampled_from(sorted(groups)).flatmap(lambda g: st.sampled_from(groups[g]))
    return st.tuples(st.sampled_from(["set", "set", "set", "delete", "rename"]), path,
                     st.one_of(values(), st.sampled_from(HOSTILE_KEYS)))


def mutate(doc, ops):
    doc = copy.deepcopy(doc)
    for op, path, value in ops:
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            key = path[-1]
            parent[key]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed it
        if op == "set":
            parent[key] = value
        elif op == "delete":
            del parent[key]
        elif isinstance(parent, dict):
            parent[str(value)] = parent.pop(key)
        else:
            parent.append(parent.pop(key))
    return doc


def test_fuzzed_manifest_fields_give_a_clear_error_or_the_same_output(work, clean):
    mpath = work / MANIFEST_NAME
    original = mpath.read_bytes()
    doc = json.loads(original)
    outcomes = Counter()

    @settings(max_examples=200, **FUZZ)
    @given(st.lists(mutations(doc), min_size=1, max_size=3))
    def case(ops):
        try:
            mpath.write_text(json.dumps(mutate(doc, ops)))
            outcomes[check_outcome(work, clean,
                                   forbidden=[work.parent / "decoy", "/etc/passwd"])] += 1
        finally:
            mpath.write_bytes(original)

    case()
    report("manifest field mutations", sum(outcomes.values()))
    print(f"[reliability]   outcomes: {dict(outcomes)}")
    assert outcomes["error"] >= 100 and sum(outcomes.values()) >= 150


def test_hostile_paths_in_the_manifest_are_refused_by_name(work):
    mpath = work / MANIFEST_NAME
    original = mpath.read_bytes()
    doc = json.loads(original)
    layer = next(iter(doc["experts"]["layers"]))
    decoy_bank = f"../decoy/layer-{int(layer):05d}.bank"
    cases = []
    for hostile in ("../../etc/passwd", "/etc/passwd", decoy_bank):
        d = copy.deepcopy(doc)
        d["files"][hostile] = 1
        cases.append(d)
        d = copy.deepcopy(doc)
        d["experts"]["layers"][layer]["bank"] = hostile
        cases.append(d)
        d = copy.deepcopy(doc)
        d["trunk_files"]["globals"] = hostile
        cases.append(d)
    # Even listed with its true size, a bank outside the model is refused.
    d = copy.deepcopy(doc)
    bank = d["experts"]["layers"][layer]["bank"]
    d["experts"]["layers"][layer]["bank"] = decoy_bank
    d["files"][decoy_bank] = d["files"].pop(bank)
    cases.append(d)
    try:
        for d in cases:
            mpath.write_text(json.dumps(d))
            with forbid_opens(work.parent / "decoy", "/etc/passwd"):
                with pytest.raises(ModelError, match="leaves the model|not in the manifest's file"):
                    load(work, **FAST)
    finally:
        mpath.write_bytes(original)


def test_random_byte_damage_to_the_manifest(work, clean):
    mpath = work / MANIFEST_NAME
    original = mpath.read_bytes()
    n = len(original)
    outcomes = Counter()
    damage = st.one_of(
        st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, n - 1),
                                                      st.integers(1, 255)), min_size=1, max_size=4)),
        st.tuples(st.just("truncate"), st.integers(0, n - 1)),
        st.tuples(st.just("insert"), st.tuples(st.integers(0, n), st.binary(min_size=1, max_size=8))),
    )

    @settings(max_examples=150, **FUZZ)
    @given(damage)
    def case(d):
        kind, arg = d
        data = bytearray(original)
        if kind == "flip":
            for pos, x in arg:
                data[pos] ^= x
        elif kind == "truncate":
            del data[arg:]
        else:
            data[arg[0]:arg[0]] = arg[1]
        try:
            mpath.write_bytes(bytes(data))
            outcomes[check_outcome(work, clean)] += 1
        finally:
            mpath.write_bytes(original)

    case()
    report("manifest byte damage", sum(outcomes.values()))
    print(f"[reliability]   outcomes: {dict(outcomes)}")
    assert sum(outcomes.values()) >= 100


def bank_parts(path):
    data = path.read_bytes()
    (jlen,) = struct.unpack("<I", data[8:12])
    return data, jlen


def read_every_record(path, layout, original):
    """Read each record of a bank with verify on: returns the experts whose read
    failed its checksum; every other record must hold exactly the original bytes."""
    bank = open_bank(path, layout, "direct")
    failed = set()
    try:
        staging = aligned_empty(layout.record_size)
        for e in range(layout.num_experts):
            targets = {s.name: np.zeros(s.shape, NUMPY[s.dtype]) for s in layout.sections}
            try:
                read_record(bank, e, targets, staging, verify=True)
            except ReadError as err:
                assert f"layer {layout.layer} expert {e}" in str(err) and str(path) in str(err)
                failed.add(e)
                continue
            rec = np.frombuffer(original, np.uint8, layout.record_size, layout.record_offset(e))
            for name, want in layout.split_record(rec).items():
                assert targets[name].tobytes() == want.tobytes(), (e, name)
    finally:
        bank.close()
    return failed


def test_fuzzed_bank_headers_give_a_clear_error_or_correct_reads(work, clean):
    m = read_manifest(work)
    layers = m.moe_layers
    originals = {layer: m.bank_path(layer).read_bytes() for layer in layers}
    clean_layout = read_layout(m.bank_path(layers[0]))
    hsize = clean_layout.header_size
    _, jlen = bank_parts(m.bank_path(layers[0]))
    header_doc = json.loads(originals[layers[0]][12 : 12 + jlen])
    outcomes = Counter()

    damage = st.one_of(
        st.tuples(st.just("flip"), st.lists(st.tuples(
            st.one_of(st.integers(0, 12 + jlen - 1), st.integers(0, hsize - 1)),
            st.integers(1, 255)), min_size=1, max_size=4)),
        st.tuples(st.just("json"), st.lists(mutations(header_doc), min_size=1, max_size=2)),
        st.tuples(st.just("truncate"), st.integers(0, len(originals[layers[0]]) - 1)),
        st.tuples(st.just("grow"), st.integers(1, 8192)),
    )

    @settings(max_examples=150, **FUZZ)
    @given(st.sampled_from(layers), damage)
    def case(layer, d):
        path = m.bank_path(layer)
        original = originals[layer]
        data = bytearray(original)
        kind, arg = d
        if kind == "flip":
            for pos, x in arg:
                data[pos] ^= x
        elif kind == "json":
            meta = json.loads(original[12 : 12 + jlen])
            meta = mutate(meta, arg)
            raw = json.dumps(meta, sort_keys=True).encode()
            sums = original[(12 + jlen + 3) // 4 * 4 :][: 4 * clean_layout.num_experts]
            head = MAGIC + struct.pack("<I", len(raw)) + raw
            head += b"\0" * (-len(head) % 4) + sums
            head += b"\0" * (-len(head) % 4096)
            data = bytearray(head) + data[hsize:]
        elif kind == "truncate":
            del data[arg:]
        else:
            data += os.urandom(arg)
        try:
            path.write_bytes(bytes(data))
            # Which experts' checksum entries the damage changed.
            changed = set()
            if kind == "flip":
                table = (12 + jlen + 3) // 4 * 4
                for pos, _ in arg:
                    if table <= pos < table + 4 * clean_layout.num_experts:
                        changed.add((pos - table) // 4)
            with no_hang():
                try:
                    model, _ = load(work, **FAST)
                except CLEAR as e:
                    assert str(path) in str(e), e
                    outcomes["error at load"] += 1
                    return
                try:
                    layout = read_layout(path)
                    assert read_every_record(path, layout, original) == changed
                    try:
                        y = first_logits(model)
                    except ReadError as e:
                        assert str(path) in str(e) and any(
                            f"expert {x} " in str(e) for x in changed), e
                        outcomes["checksum entry caught by verify"] += 1
                        return
                    assert mx.array_equal(y, clean).item(), "damaged header, other logits"
                    outcomes["harmless (padding or unused entry)"] += 1
                finally:
                    close(model)
        finally:
            path.write_bytes(original)

    case()
    report("bank header damage", sum(outcomes.values()))
    print(f"[reliability]   outcomes: {dict(outcomes)}")
    assert outcomes["error at load"] >= 75


def test_fuzzed_records_are_caught_by_verify_naming_layer_and_expert(work):
    m = read_manifest(work)
    layouts = {layer: read_layout(m.bank_path(layer)) for layer in m.moe_layers}
    rs = m.experts["record_size"]
    ne = m.experts["num_experts"]
    ran = Counter()

    damage = st.one_of(
        st.lists(st.tuples(st.integers(0, rs - 1), st.integers(1, 255)), min_size=1, max_size=6),
        st.tuples(st.integers(0, rs - 64), st.binary(min_size=1, max_size=64)),
    )

    @settings(max_examples=200, **FUZZ)
    @given(st.sampled_from(m.moe_layers), st.integers(0, ne - 1), damage,
           st.sampled_from(["direct", "mmap", "staging"]))
    def case(layer, expert, d, mode):
        layout = layouts[layer]
        path = m.bank_path(layer)
        off = layout.record_offset(expert)
        with open(path, "rb") as f:
            f.seek(off)
            original = f.read(rs)
        rec = bytearray(original)
        if isinstance(d, list):
            for pos, x in d:
                rec[pos] ^= x
        else:
            rec[d[0] : d[0] + len(d[1])] = d[1]
        if rec == original:
            return  # the burst wrote the bytes that were there
        try:
            with open(path, "r+b") as f:
                f.seek(off)
                f.write(rec)
            bank = open_bank(path, layout, "mmap" if mode == "mmap" else "direct")
            try:
                if mode == "staging":  # targets a single preadv cannot fill
                    targets = {s.name: np.zeros(s.shape, NUMPY[s.dtype])
                               for s in layout.sections}
                else:
                    targets = {s.name: aligned_empty(s.nbytes).view(NUMPY[s.dtype])
                               .reshape(s.shape) for s in layout.sections}
                with pytest.raises(ReadError) as info:
                    read_record(bank, expert, targets, aligned_empty(rs), verify=True)
                msg = str(info.value)
                assert f"checksum mismatch in layer {layer} expert {expert} " in msg, msg
                assert str(path) in msg
                ran[mode] += 1
            finally:
                bank.close()
        finally:
            with open(path, "r+b") as f:
                f.seek(off)
                f.write(original)

    case()
    report("record damage (reader)", sum(ran.values()))
    print(f"[reliability]   by read path: {dict(ran)}")
    assert sum(ran.values()) >= 150


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


def test_bank_modified_while_loaded_is_caught_by_verify(work):
    records = demanded_records(work)
    bank_path, expert = records[0]
    layout = read_layout(bank_path)
    original = Path(bank_path).read_bytes()
    for read_mode in ("direct", "mmap"):
        model, _ = load(work, **{**FAST, "read_mode": read_mode})
        try:
            with open(bank_path, "r+b") as f:  # same size: only checksums can tell
                f.seek(layout.record_offset(expert) + 17)
                f.write(b"\x5a\xa5")
            with pytest.raises(ReadError, match=rf"checksum mismatch in layer {layout.layer} "
                                                rf"expert {expert} "):
                greedy(model, PROMPT, 2)
        finally:
            close(model)
            Path(bank_path).write_bytes(original)


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


# --- 2. SIGKILL at random points of a conversion ------------------------------------

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
                        (conv, "_write_atomic_json"), (mx, "save_safetensors"),
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


# --- 3. disk full during a conversion -----------------------------------------------


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
    "partial state": (conv, "_write_atomic_json", 3),
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


# --- 4. read errors (EIO, short reads) injected into expert reads --------------------


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


# --- 5. budgets and filesystems without O_DIRECT ------------------------------------


def test_budget_far_below_the_floor_states_the_floor(k3, clean):
    model, _ = load(k3, **{**FAST, "memory_budget": "4GB", "cache_slots": None})
    floor = runtime(model).plan.floor
    close(model)
    for budget in (1, 4096, floor // 100, floor - 1):
        with pytest.raises(BudgetError, match=rf"below this model's floor of [0-9.]+ [KMGT]?B "
                                              rf"\({floor} bytes"):
            load(k3, **{**FAST, "memory_budget": budget, "cache_slots": None})
    # At the floor exactly it runs, with the least cache, and gives the same logits.
    model, _ = load(k3, **{**FAST, "memory_budget": floor, "cache_slots": None})
    try:
        assert runtime(model).plan.cache_bytes <= floor
        assert mx.array_equal(first_logits(model), clean).item()
    finally:
        close(model)


def test_budget_larger_than_the_machine_loads_and_is_capped_by_the_model(k3, clean):
    """Decision: a budget beyond physical memory is accepted (no error, no warning):
    the plan never holds more than every expert once, so memory use is bounded by
    the model, not by the budget."""
    from deltafin_mlx.plan.memory import physical_memory

    huge = max(physical_memory(), 1 << 30) * 1000
    for budget in (huge, f"{huge // 10**12 + 1}TB"):
        model, _ = load(k3, **{**FAST, "memory_budget": budget, "cache_slots": None})
        try:
            plan = runtime(model).plan
            all_experts = plan.num_experts * plan.moe_layers * plan.slot_bytes
            assert plan.cache_bytes <= all_experts
            assert mx.array_equal(first_logits(model), clean).item()
        finally:
            close(model)


@pytest.mark.parametrize("budget", [float("inf"), float("nan"), float("-inf"), "1e30"])
def test_non_finite_budget_is_a_budget_error(k3, budget):
    with pytest.raises(BudgetError, match="memory"):
        load(k3, **{**FAST, "memory_budget": budget})


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


@pytest.mark.parametrize("threads", [0, 2])
def test_model_on_tmpfs_reads_correctly_whatever_tmpfs_does_with_o_direct(
        k3, tmpfs_dir, eio_target, monkeypatch, threads):
    path = tmpfs_dir / "model"
    shutil.copytree(k3, path)
    opened = opened_banks(monkeypatch)
    model, _ = load(path, **{**FAST, "read_mode": "direct", "reader_threads": threads})
    try:
        tokens, logits = greedy(model, PROMPT, 6)
    finally:
        close(model)
    assert opened
    assert (tokens == eio_target["tokens"]).all()
    assert mx.array_equal(logits, eio_target["logits"]).item()


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
    model, _ = load(k3, **{**FAST, "read_mode": "direct", "reader_threads": threads})
    try:
        tokens, logits = greedy(model, PROMPT, 6)
    finally:
        close(model)
    assert refused["n"] == len(opened) > 0
    assert not any(b.direct for b in opened)
    assert dropped["n"] > 0  # buffered reads drop the pages they read
    assert (tokens == eio_target["tokens"]).all()
    assert mx.array_equal(logits, eio_target["logits"]).item()


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
