"""The streaming runtime gives exactly the tokens and logits of mlx-lm running the
same quantized model fully in memory, at every cache size and setting, within its
memory budget; damaged banks are caught, never silently used."""

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from helpers import make_source
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.format.bank import read_layout
from deltafin_mlx.engine.cache import ExpertCache
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.streaming_moe import IORates
from deltafin_mlx.format.manifest import ModelError, read_manifest
from deltafin_mlx.plan.memory import BudgetError
from deltafin_mlx.engine.reader import ReadError
from deltafin_mlx.testing.decode import greedy
from deltafin_mlx.testing.synthetic import ARCHITECTURES
from deltafin_mlx import runtime


def prompt_of(length, batch=1, seed=0):
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(1, 380, size=(batch, length)).astype(np.int32))  # < every vocab


@pytest.fixture(scope="module")
def expected(references):
    cache = {}

    def get(arch, batch, length, steps=32):
        key = (arch, batch, length, steps)
        if key not in cache:
            cache[key] = greedy(references(arch), prompt_of(length, batch), steps)
        return cache[key]

    return get


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_32_tokens_equal_mlx_lm_when_most_accesses_miss(arch, converted, expected):
    k = read_manifest(converted(arch)).experts["experts_per_token"]
    model, _ = load(converted(arch), cache_slots=k, tokenizer=False)
    tokens, logits = greedy(model, prompt_of(12), 32)
    ref_tokens, ref_logits = expected(arch, 1, 12)
    stats = runtime(model).stats
    assert stats.misses >= stats.hits  # at least half of the accesses missed
    assert (tokens == ref_tokens).all()
    assert mx.array_equal(logits, ref_logits).item()  # bit-identical, not just close
    runtime(model).close()


@pytest.mark.parametrize("arch", ["kimi_k3", "qwen3_moe"])
def test_batch_2_with_an_80_token_prompt_equals_mlx_lm(arch, converted, expected):
    # 2 x 84 tokens x k experts: mlx-lm sorts the indices, and more distinct experts
    # are needed at once than the cache holds (Deltafin runs them in groups).
    k = read_manifest(converted(arch)).experts["experts_per_token"]
    model, _ = load(converted(arch), cache_slots=k + 1, tokenizer=False)
    tokens, logits = greedy(model, prompt_of(84, batch=2), 32)
    ref_tokens, ref_logits = expected(arch, 2, 84)
    assert (tokens == ref_tokens).all()
    assert mx.array_equal(logits, ref_logits).item()
    runtime(model).close()


SETTINGS = [  # the fixture has 3 MoE layers x 16 experts, 4 per token
    dict(cache_slots=4, reader_threads=0, lookahead=False, verify=False, pipeline=False),
    dict(cache_slots=6, reader_threads=1, lookahead=True, verify=True),
    dict(cache_slots=12, reader_threads=2, lookahead=True, verify=False, pipeline=False),
    dict(cache_slots=12, reader_threads=2, lookahead=True, verify=False, pipeline=True),
    dict(cache_slots=20, reader_threads=2, lookahead=False, verify=True, read_mode="mmap"),
    dict(cache_slots=30, reader_threads=1, lookahead=True, verify=False, read_mode="mmap"),
    dict(cache_slots=None, reader_threads=1, lookahead=True, verify=True),
]


def test_logits_are_bit_identical_across_deltafin_settings(converted, expected, monkeypatch):
    # Guesses always queued where lookahead is on (a tiny model's calls hardly stall,
    # so the gate would close): reads ahead change timing only.
    monkeypatch.setattr(IORates, "guesses_pay", lambda self, right=None: True)
    path = converted("kimi_k3")
    ref_tokens, ref_logits = expected("kimi_k3", 1, 12, 16)
    for settings in SETTINGS:
        model, _ = load(path, tokenizer=False, **settings)
        tokens, logits = greedy(model, prompt_of(12), 16)
        assert (tokens == ref_tokens).all(), settings
        assert mx.array_equal(logits, ref_logits).item(), settings
        if settings["lookahead"] and settings["cache_slots"] in (12, 30):
            assert runtime(model).stats.speculative_issued > 0
        runtime(model).close()


def test_a_slot_in_use_is_never_overwritten(converted, monkeypatch):
    """After every layer's reads, each resident expert is in its slot with its bank
    bytes, even with as few slots as one token needs and reads ahead running."""
    path = converted("kimi_k3")
    m = read_manifest(path)
    records = {}
    for layer in m.moe_layers:
        layout = read_layout(m.bank_path(layer))
        records[layer] = (layout, np.fromfile(m.bank_path(layer), dtype=np.uint8))
    checked = {"n": 0}
    real_wait = ExpertCache.wait

    def checking_wait(self, jobs):
        real_wait(self, jobs)
        for (layer, e), slot in self.resident().items():
            if self.key(layer, e) in self.pending:
                continue
            layout, data = records[layer]
            rec = data[layout.record_offset(e):][: layout.record_size]
            for name, want in layout.split_record(rec).items():
                got = self.views[name][slot]
                if want.dtype == np.uint16 and got.dtype == np.float32:  # bf16 held as f32
                    want = (want.astype(np.uint32) << 16).view(np.float32)
                assert got.tobytes() == want.tobytes(), (layer, e, name)
            checked["n"] += 1

    monkeypatch.setattr(ExpertCache, "wait", checking_wait)
    k = m.experts["experts_per_token"]
    for slots in (k, 3 * k):
        model, _ = load(path, cache_slots=slots, reader_threads=2, lookahead=True,
                        tokenizer=False)
        greedy(model, prompt_of(20, batch=2), 8)
        runtime(model).close()
    assert checked["n"] > 100


def test_stats_count_hits_misses_speculation_bytes_and_stalls(converted, monkeypatch):
    monkeypatch.setattr(IORates, "guesses_pay", lambda self, right=None: True)
    model, _ = load(converted("kimi_k3"), cache_slots=20, tokenizer=False)
    greedy(model, prompt_of(8), 16)
    s = runtime(model).stats
    store = runtime(model).store
    assert s.hits > 0 and s.misses > 0
    assert s.speculative_issued > 0 and 0 <= s.speculative_used <= s.speculative_issued
    # a guess cancelled before a thread took it is never read (how many are depends on
    # the reader's timing: slower reads, as on a loaded machine, cancel more)
    assert store.bytes_read == (s.misses + s.speculative_issued - s.speculative_cancelled) * (
        read_manifest(converted("kimi_k3")).experts["record_size"])
    assert s.stall_seconds > 0
    runtime(model).close()


# --- budget -------------------------------------------------------------------


def test_budget_below_the_floor_is_refused_stating_the_floor(converted):
    with pytest.raises(BudgetError, match=r"below this model's floor of [0-9.]+ [KMGT]?B \(\d+ bytes"):
        load(converted("kimi_k3"), memory_budget="1MB", tokenizer=False)


@pytest.mark.parametrize("bad", ["lots", "-3GB", "0", "8 parsecs", ""])
def test_bad_budget_strings_are_refused(converted, bad):
    with pytest.raises(BudgetError, match="memory"):
        load(converted("kimi_k3"), memory_budget=bad, tokenizer=False)


def test_peak_memory_stays_within_budget_when_experts_are_4x_the_budget(tmp_path):
    src = make_source(tmp_path / "src", "kimi_k3", num_layers=5, num_experts=64,
                      routed_expert_hidden_size=1024, moe_intermediate_size=1024)
    out = tmp_path / "out"
    convert(str(src), out, ConvertOptions(progress=False))
    m = read_manifest(out)
    banks = sum(size for rel, size in m.files.items() if rel.endswith(".bank"))
    budget = banks // 4
    code = (
        "import resource, mlx.core as mx, numpy as np\n"
        "from deltafin_mlx import load, runtime\n"
        "from mlx_lm.models.cache import make_prompt_cache\n"
        "mx.eval(mx.zeros(8) + 1)\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "base = rss()\n"
        f"model, _ = load({str(out)!r}, memory_budget={budget}, tokenizer=False)\n"
        "plan = runtime(model).plan\n"
        "cache = make_prompt_cache(model)\n"
        "y = mx.array([[1, 2, 3, 4]])\n"
        "peak = 0\n"
        "for _ in range(24):\n"
        "    y = mx.argmax(model(y, cache=cache)[:, -1:], axis=-1)\n"
        "    mx.eval(y)\n"
        "    peak = max(peak, rss())\n"
        "s = runtime(model).stats\n"
        "print(base, peak, plan.cache_fraction, s.misses, s.hits)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    base, peak, fraction, misses, hits = p.stdout.split()
    used = int(peak) - int(base)
    margin = 48 << 20  # MLX's allocator keeps freed buffers for reuse
    assert float(fraction) < 0.5 and int(misses) > 0
    assert used <= budget + margin, (used, budget)


def test_mlx_keeps_freed_buffers_only_within_the_working_buffers(converted):
    """Unbounded, MLX's cache of freed buffers grows with every new shape (a
    server's batches of 1 to 14 prompts of any length: about 7.8 MB here, over the
    plan); a load bounds it to the plan's share of the working buffers."""
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(converted("kimi_k3"), memory_budget="40MB", tokenizer=False)
    plan = runtime(model).plan
    try:
        assert 0 < plan.buffer_cache_bytes < plan.working_bytes
        for batch in range(1, 15):
            for length in (3, 17, 40):
                cache = make_prompt_cache(model)
                mx.eval(model(mx.ones((batch, length), dtype=mx.int32), cache=cache))
        assert mx.get_cache_memory() <= plan.buffer_cache_bytes
    finally:
        runtime(model).close()


# --- damaged banks --------------------------------------------------------------


def test_verify_names_layer_and_expert_of_a_corrupt_record(converted, copy_of):
    path = copy_of(converted("kimi_k3"))
    m = read_manifest(path)
    layer = m.moe_layers[0]
    layout = read_layout(m.bank_path(layer))
    with open(m.bank_path(layer), "r+b") as f:
        for e in range(layout.num_experts):  # every record: whichever is read first
            f.seek(layout.record_offset(e) + 100)
            f.write(b"\xff\x00\xff")
    model, _ = load(path, cache_slots=4, verify=True, tokenizer=False)
    with pytest.raises(ReadError, match=rf"checksum mismatch in layer {layer} expert \d+"):
        greedy(model, prompt_of(4), 2)
    runtime(model).close()


@pytest.mark.parametrize("damage", ["truncate", "grow", "delete", "header"])
def test_damaged_bank_files_are_refused_at_load(converted, copy_of, damage):
    path = copy_of(converted("mixtral"))
    m = read_manifest(path)
    bank = m.bank_path(m.moe_layers[-1])
    if damage == "truncate":
        with open(bank, "r+b") as f:
            f.truncate(bank.stat().st_size - 4096)
    elif damage == "grow":
        with open(bank, "ab") as f:
            f.write(b"\0" * 4096)
    elif damage == "delete":
        bank.unlink()
    else:
        with open(bank, "r+b") as f:
            f.write(b"NOTABANK")
    with pytest.raises(ModelError, match=bank.name):
        load(path, tokenizer=False)


def test_unknown_format_version_is_refused(converted, copy_of):
    import json

    path = copy_of(converted("mixtral"))
    d = json.loads((path / "deltafin.json").read_text())
    d["format_version"] = 99
    (path / "deltafin.json").write_text(json.dumps(d))
    with pytest.raises(ModelError, match="format version 99 is not supported"):
        load(path, tokenizer=False)


def test_config_edited_after_conversion_is_refused(converted, copy_of):
    path = copy_of(converted("mixtral"))
    cfg = (path / "config.json").read_text()
    assert '"num_experts_per_tok": 4' in cfg
    (path / "config.json").write_text(cfg.replace('"num_experts_per_tok": 4', '"num_experts_per_tok": 8'))
    with pytest.raises(ModelError, match="config.json: modified since conversion"):
        load(path, tokenizer=False)
    (path / "config.json").write_text("x" + cfg[1:])
    with pytest.raises(ModelError, match="config.json"):
        load(path, tokenizer=False)


def test_a_read_refused_with_einval_falls_back_to_buffered_reads(converted, expected, monkeypatch):
    import errno
    import os as real_os

    import deltafin_mlx.engine.reader as reader

    real = real_os.preadv

    def refuse_direct(fd, buffers, offset):
        if real_os.get_blocking(fd) and fcntl_flags(fd) & getattr(real_os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    def fcntl_flags(fd):
        import fcntl

        return fcntl.fcntl(fd, fcntl.F_GETFL)

    monkeypatch.setattr(reader.os, "preadv", refuse_direct)
    model, _ = load(converted("kimi_k3"), cache_slots=6, tokenizer=False)
    tokens, logits = greedy(model, prompt_of(12), 8)
    ref_tokens, ref_logits = expected("kimi_k3", 1, 12, 8)
    assert (tokens == ref_tokens).all() and mx.array_equal(logits, ref_logits).item()
    assert not any(b.direct for b in runtime(model).store.cache.banks.values())
    runtime(model).close()
