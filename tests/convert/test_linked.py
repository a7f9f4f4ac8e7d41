"""Linked experts (`deltafin-convert --link-experts`, format version 3): the experts
are read where they lie in the source's safetensors files, from a local directory or
the hub cache, with the same tokens as the packed conversion at a streaming budget;
a source changed, truncated, deleted or pointing outside its root is refused in one
line, and `verify` checks every linked record's CRC."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import deltafin_mlx
from helpers import make_source
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx import runtime
from deltafin_mlx.errors import ConvertError, ModelError
from deltafin_mlx.format.manifest import MANIFEST_NAME, read_manifest
from deltafin_mlx.format.verify import verify_model
from deltafin_mlx.testing.fake_hub import FakeHub
from helpers import BIN

BUDGET = "40MB"  # holds a fraction of the fixture's experts: they stream


def greedy(path, n=10):
    model, tok = deltafin_mlx.load(str(path), memory_budget=BUDGET, cache_slots=12)
    try:
        r = deltafin_mlx.generate(model, tok, "Tell me about the sea", max_tokens=n)
        rt = runtime(model)
        assert rt.plan.slots < rt.cache.num_experts * len(rt.cache.layers)  # streaming
        assert r.stats.misses > 0
        return r.tokens
    finally:
        runtime(model).close()


@pytest.fixture(scope="module")
def linked_source(tmp_path_factory):
    """A K3-layout source of its own (tests below damage it) and its linked conversion."""
    root = tmp_path_factory.mktemp("linked")
    src = make_source(root / "src", "kimi_k3")
    out = root / "out"
    convert(str(src), out, ConvertOptions(progress=False, link_experts=True))
    return src, out


@pytest.fixture
def fresh_linked(tmp_path):
    src = make_source(tmp_path / "src", "kimi_k3")
    out = tmp_path / "out"
    convert(str(src), out, ConvertOptions(progress=False, link_experts=True))
    return src, out


def test_linked_experts_give_the_packed_conversions_tokens_and_out_holds_no_expert(
        linked_source, converted):
    src, out = linked_source
    packed = read_manifest(converted("kimi_k3"))
    linked = read_manifest(out)
    banks = sum(size for rel, size in packed.files.items() if rel.endswith(".bank"))
    tables = sum(size for rel, size in linked.files.items() if rel.endswith(".links"))
    # OUT is the packed output minus its banks, plus link tables a fraction of their size.
    assert sum(linked.files.values()) == sum(packed.files.values()) - banks + tables
    assert not any(rel.endswith(".bank") for rel in linked.files)
    assert tables * 20 < banks
    assert linked.linked["root"] == os.path.realpath(src)
    assert greedy(out) == greedy(converted("kimi_k3"))
    assert verify_model(out).ok and verify_model(out).records_checked == (
        linked.experts["num_experts"] * len(linked.moe_layers))
    info = subprocess.run([str(BIN / "deltafin-run"), "info", str(out), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert json.loads(info.stdout)["linked_source_root"] == os.path.realpath(src)


def test_linking_experts_that_must_be_requantized_is_refused_in_one_line(sources, tmp_path):
    with pytest.raises(ConvertError, match="only experts carried over byte for byte"):
        convert(str(sources("qwen3_moe")), tmp_path / "o",
                ConvertOptions(progress=False, link_experts=True))
    assert not (tmp_path / "o").exists()


def test_linked_experts_from_the_hub_cache_link_into_its_blobs(sources, converted, tmp_path):
    with FakeHub() as hub:
        hub.add("someone/k3", sources("kimi_k3"))
        p = subprocess.run([str(BIN / "deltafin-convert"), "someone/k3", str(tmp_path / "out"),
                            "--link-experts", "--quiet"], capture_output=True, text=True,
                           env={**os.environ, **hub.env(tmp_path / "hf")}, timeout=300)
    assert p.returncode == 0, p.stderr
    m = read_manifest(tmp_path / "out")
    cache = tmp_path / "hf" / "hub" / "models--someone--k3"
    assert m.linked["root"] == os.path.realpath(cache)
    assert all(rel.startswith("blobs/") for rel in m.linked["files"])
    assert greedy(tmp_path / "out") == greedy(converted("kimi_k3"))


def _a_linked_file(out):
    m = read_manifest(out)
    rel = sorted(m.linked["files"])[0]
    return Path(m.linked["root"]) / rel


def _refused(out, *words):
    with pytest.raises(ModelError) as e:
        deltafin_mlx.load(str(out), memory_budget=BUDGET)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
    p = subprocess.run([str(BIN / "deltafin-run"), str(out), "Hi", "-n", "2", "--budget",
                        BUDGET], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    return msg


def test_a_linked_source_edited_afterwards_is_refused_or_found_by_verify(fresh_linked):
    src, out = fresh_linked
    shard = _a_linked_file(out)
    st = os.stat(shard)
    with open(shard, "r+b") as f:  # one byte of tensor data, in place
        f.seek(st.st_size - 100)
        b = f.read(1)
        f.seek(st.st_size - 100)
        f.write(bytes([b[0] ^ 0xFF]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as before
    report = verify_model(out)
    assert not report.ok and any("changed since the conversion" in p for p in report.problems)
    p = subprocess.run([str(BIN / "deltafin-run"), "verify", str(out)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 1 and "CRC-32 mismatch" in p.stderr
    os.utime(shard)  # now its mtime says so too: refused at load
    _refused(out, str(shard.name), "changed since the conversion")


def test_a_linked_source_truncated_or_deleted_is_refused_in_one_line(fresh_linked):
    src, out = fresh_linked
    shard = _a_linked_file(out)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 4096)
    _refused(out, shard.name, "truncated")
    shard.unlink()
    _refused(out, shard.name, "gone")
    shutil.rmtree(src)
    _refused(out, "gone")


def test_a_linked_file_resolving_outside_the_source_root_is_refused(fresh_linked, tmp_path):
    src, out = fresh_linked
    shard = _a_linked_file(out)
    moved = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, moved)
    os.symlink(moved, shard)  # same bytes, same fingerprint, but outside the root
    _refused(out, "outside the linked source root")


def test_a_manifest_naming_a_linked_file_outside_the_root_is_refused(fresh_linked):
    src, out = fresh_linked
    mpath = out / MANIFEST_NAME
    d = json.loads(mpath.read_text())
    files = d["experts"]["linked"]["files"]
    rel = sorted(files)[0]
    files["../" + rel] = files.pop(rel)
    mpath.write_text(json.dumps(d))
    _refused(out, "leaves the source root")


def scatter_experts(shard: Path):
    """Rewrite a safetensors shard with its tensors in reverse name order, so an
    expert's sections are no longer next to each other in the order read."""
    import struct

    raw = shard.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + hlen])
    base = 8 + hlen
    names = sorted((n for n in header if n != "__metadata__"), reverse=True)
    blobs, out, offset = [], {}, 0
    for i, n in enumerate(names):
        a, b = header[n]["data_offsets"]
        blobs.append(raw[base + a:base + b])
        out[n] = {**header[n], "data_offsets": [offset, offset + b - a]}
        offset += b - a
        if i % 2 == 0:  # a gap: the next tensor does not start where this one ends
            blobs.append(b"\0" * 100)
            offset += 100
    head = json.dumps(out).encode()
    shard.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def test_experts_whose_sections_are_apart_are_read_one_section_at_a_time(tmp_path,
                                                                          converted):
    src = make_source(tmp_path / "src", "kimi_k3")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    shard = src / index["language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"]
    scatter_experts(shard)
    out = tmp_path / "out"
    convert(str(src), out, ConvertOptions(progress=False, link_experts=True))
    from deltafin_mlx.format.links import read_links

    m = read_manifest(out)
    layout = read_links(m.links_path(1), m.experts, 1, m.linked["files"])
    assert all(len(layout.runs(e)) > 1 for e in range(layout.num_experts))
    assert greedy(out) == greedy(converted("kimi_k3"))
    assert verify_model(out).ok
