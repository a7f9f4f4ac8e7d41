"""Damaged model files (fuzzed manifests and bank headers, damaged records, banks changed
while loaded) end in a clear error or the clean output; never a crash, a hang, a read
outside the model directory, or silently wrong output.

Figures (fuzz cases run) are printed: run with `-s` to see them."""

import contextlib
import copy
import json
import os
import struct
import sys
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.reader import ReadError, open_bank, read_record
from deltafin_mlx.format.aligned import aligned_empty
from deltafin_mlx.format.bank import BankError, MAGIC, read_layout
from deltafin_mlx.format.dtypes import NUMPY
from deltafin_mlx.format.manifest import MANIFEST_NAME, ModelError, read_manifest
from deltafin_mlx.plan.memory import BudgetError
from deltafin_mlx.testing.decode import greedy

from helpers import FAST, PROMPT, close, demanded_records, first_logits, no_hang, report


CLEAR = (ModelError, BankError, ReadError, BudgetError)


FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck))


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


def report_outcomes(name, outcomes, at_least=0, what="outcomes"):
    """The reliability figure of a fuzzing test: its cases, counted by outcome."""
    report(name, sum(outcomes.values()))
    print(f"[reliability]   {what}: {dict(outcomes)}")
    assert sum(outcomes.values()) >= at_least


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
    report_outcomes("manifest field mutations", outcomes, at_least=150)
    assert outcomes["error"] >= 100


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
    report_outcomes("manifest byte damage", outcomes, at_least=100)


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
    report_outcomes("bank header damage", outcomes)
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
    report_outcomes("record damage (reader)", ran, at_least=150, what="by read path")


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
