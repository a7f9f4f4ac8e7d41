"""Tensor parallelism over mx.distributed: on 2 local ranks (mlx.launch, ring
backend) a Deltafin model gives exactly the tokens and logits of mlx-lm's own
model sharded by its shard() over the same ranks, each rank reading only its
slice of every expert; ranks that disagree or die stop instead of hanging.

The launches are small (2 cores here); each has a timeout. Without mlx.launch,
or where the ring backend cannot start, the launching tests skip with the reason.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from helpers import make_source
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.format.bank import read_layout
from deltafin_mlx.plan.footprint import inventory_from_manifest
from deltafin_mlx.engine.load import load
from deltafin_mlx.testing.decode import load_resident
from deltafin_mlx.format.model_dir import read_config
from deltafin_mlx.format.manifest import ModelError, read_manifest
from deltafin_mlx.plan.memory import plan_memory
from deltafin_mlx.model.shard import check_divisible, expert_layout, sharded_inventory
from deltafin_mlx import runtime
from helpers import BIN

HERE = Path(__file__).parent
WORKER = HERE / "dist_worker.py"
LAUNCH = BIN / "mlx.launch"
STEPS = 8
# Architectures whose mlx-lm model class has shard() in mlx-lm 0.32.2 (Mixtral's has none).
SHARDABLE = ["kimi_k3", "kimi_k2", "qwen3_moe"]
# Widths that split across 2 ranks in whole quantization groups everywhere mlx-lm
# shards (the trunk's sharded-to-all inputs too), and K3 experts big enough that a
# rank's half-record is mostly data, not 4096-byte padding.
SIZES = {
    "kimi_k3": dict(moe_intermediate_size=1024, routed_expert_hidden_size=256, v_head_dim=64,
                    kda_head_dim=64),
    "kimi_k2": {},
    "qwen3_moe": {},
    "mixtral": {},
}
BUDGET = "24MB"  # K3 fixture: one process caches 8 of 48 experts, a rank 22 halves


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def launch():
    if not LAUNCH.exists():
        pytest.skip(f"mlx.launch is not installed next to {sys.executable}")

    def run(args, timeout=240, expect_output=True):
        out = Path(args[1])
        out.mkdir(parents=True, exist_ok=True)
        cmd = [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
               "--starting-port", str(_free_port()), "--python", sys.executable,
               # the worker runs outside pytest: tests/ on its path for helpers.py
               "--env", f"PYTHONPATH={HERE.parent}", "--",
               str(WORKER), *map(str, args)]
        start = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              cwd=HERE.parent)
        ranks = {}
        for r in (0, 1):
            f = out / f"rank-{r}.json"
            if f.exists():
                ranks[r] = json.loads(f.read_text())
        if not ranks and expect_output:
            # A worker that crashed is a failure; a launch that started none, a skip.
            assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
            pytest.skip(f"mlx.launch (ring backend) ran no rank: {proc.stderr[-300:]}")
        return ranks, proc, time.monotonic() - start

    return run


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (source, converted with --ranks 2, converted unsliced)."""
    root = tmp_path_factory.mktemp("distributed")
    cache = {}

    def get(arch):
        if arch not in cache:
            src = make_source(root / f"src-{arch}", arch, **SIZES[arch])
            sliced, whole = root / f"r2-{arch}", root / f"r1-{arch}"
            convert(str(src), sliced, ConvertOptions(progress=False, ranks=2))
            convert(str(src), whole, ConvertOptions(progress=False))
            cache[arch] = (src, sliced, whole)
        return cache[arch]

    return get


def single_process(path, steps=STEPS, **kw):
    from dist_worker import greedy

    model, _ = load(path, tokenizer=False, group=None, **kw)
    tokens, logits = greedy(model, steps)
    stats = runtime(model)
    out = tokens, logits, stats.store.bytes_read, stats.plan.slots
    stats.close()
    return out


# --- the format: one model directory for one machine and for N ---------------


def test_a_rank_slice_is_one_aligned_contiguous_read(models):
    _, sliced, _ = models("kimi_k3")
    m = read_manifest(sliced)
    assert m.slices == 2
    layout = read_layout(m.bank_path(m.moe_layers[0]))
    for rank in (0, 1):
        view = layout.for_rank(rank, 2)
        assert view.record_size * 2 == layout.record_size
        for e in (0, 5):
            assert view.record_offset(e) % 4096 == 0 and view.record_size % 4096 == 0
            assert view.record_offset(e) == layout.record_offset(e) + rank * view.record_size


def read_as_rank(bank_path, rank, ranks, expert, verify=True):
    """What rank `rank` of `ranks` reads of one expert (through the runtime's reader)."""
    from deltafin_mlx.format.dtypes import NUMPY
    from deltafin_mlx.engine.reader import ReadJob, Reader, open_bank

    view = read_layout(bank_path).for_rank(rank, ranks)
    bank = open_bank(bank_path, view)
    targets = {s.name: np.zeros(s.shape, NUMPY[s.dtype]) for s in view.held_sections}
    job = ReadJob(bank, expert, targets, speculative=False)
    Reader(view.record_size, threads=0, checks="every" if verify else "off").submit(job)
    bank.close()
    if job.error is not None:
        raise job.error
    return targets


def test_each_rank_reads_exactly_its_mlx_lm_shard_of_every_expert(models, copy_of):
    from deltafin_mlx.format.bank import slice_axis
    from deltafin_mlx.engine.reader import ReadError

    _, sliced, _ = models("kimi_k3")
    m = read_manifest(sliced)
    path = m.bank_path(m.moe_layers[0])
    whole = read_as_rank(path, 0, 1, 3)
    for rank in (0, 1):
        part = read_as_rank(path, rank, 2, 3)
        for name, full in whole.items():
            # mlx's shard_inplace: mx.split(x, N, axis)[rank]
            assert np.array_equal(part[name], np.split(full, 2, axis=slice_axis(name))[rank])
    # A damaged byte in rank 1's slice: only rank 1's checked read fails, naming the bank.
    copy = copy_of(sliced)
    bank = read_manifest(copy).bank_path(m.moe_layers[0])
    layout = read_layout(bank)
    with open(bank, "r+b") as f:
        f.seek(layout.for_rank(1, 2).record_offset(3) + 10)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    read_as_rank(bank, 0, 2, 3)
    with pytest.raises(ReadError, match="checksum mismatch in layer"):
        read_as_rank(bank, 1, 2, 3)


def test_one_process_reads_the_sliced_directory_bit_identically(models):
    _, sliced, whole = models("kimi_k3")
    k = read_manifest(sliced).experts["experts_per_token"]
    t_sliced, l_sliced, _, _ = single_process(sliced, cache_slots=k)
    t_whole, l_whole, _, _ = single_process(whole, cache_slots=k)
    assert t_sliced == t_whole
    assert mx.array_equal(l_sliced, l_whole).item()
    from dist_worker import greedy

    assert mx.array_equal(greedy(load_resident(sliced), STEPS)[1], l_whole).item()


def test_rank_counts_that_do_not_divide_are_refused_with_the_reason(models):
    _, sliced, _ = models("kimi_k3")
    m = read_manifest(sliced)
    config = read_config(sliced, m)
    sections = expert_layout(m).for_rank(0, 1).held_sections
    with pytest.raises(ModelError, match="3 ranks do not divide the model's 2 attention heads"):
        check_divisible(config, sections, 3, sliced)
    with pytest.raises(ModelError, match="intermediate size 1024 into whole quantization groups"):
        check_divisible({}, sections, 64, sliced)
    with pytest.raises(ValueError, match="2 rank slices, which 3 ranks cannot share"):
        read_layout(m.bank_path(m.moe_layers[0])).for_rank(0, 3)


def test_a_bad_rank_count_at_convert_time_is_one_error(models, tmp_path):
    src, _, _ = models("qwen3_moe")  # experts 128 wide, group 64
    from deltafin_mlx.convert.source import ConvertError

    with pytest.raises(ConvertError, match="does not split into 4 slices of whole"):
        convert(str(src), tmp_path / "out", ConvertOptions(progress=False, ranks=4))


def test_the_plan_per_rank_halves_the_expert_reads_and_cache_entries(models):
    _, sliced, _ = models("kimi_k3")
    m = read_manifest(sliced)
    config = read_config(sliced, m)
    whole = inventory_from_manifest(m, config, mx.float32)
    rank = sharded_inventory(whole, config, 2, 0, expert_layout(m), sliced)
    assert rank.record_size == whole.record_size // 2
    assert rank.slot_bytes == whole.slot_bytes // 2
    assert rank.trunk_bytes < whole.trunk_bytes
    one = plan_memory(whole, BUDGET, stream_trunk=False)
    per_rank = plan_memory(rank, BUDGET, stream_trunk=False)
    assert per_rank.slots >= 2 * one.slots  # N machines give N times the cache


def test_plan_ranks_shows_one_ranks_memory_and_reads(models, capsys):
    from deltafin_mlx.cli.main import main

    _, sliced, _ = models("kimi_k3")
    common = [str(sliced), "--budget", BUDGET, "--disk-gbps", "1", "--compute-gwps", "1",
              "--json"]
    assert main(["plan", *common]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main(["plan", *common, "--ranks", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["ranks"] == 2 and two["whole_trunk_bytes"] == one["trunk_bytes"]
    assert two["expert_record_bytes"] * 2 == one["expert_record_bytes"]
    assert two["trunk_bytes"] < one["trunk_bytes"]
    assert two["expert_cache_slots"] > one["expert_cache_slots"]
    assert (two["projection"]["read_bytes_per_token"]
            < 0.55 * one["projection"]["read_bytes_per_token"])


def test_an_architecture_mlx_lm_cannot_shard_is_refused_in_one_line(models):
    _, sliced, _ = models("mixtral")  # mlx-lm 0.32.2's Mixtral has no shard()
    m = read_manifest(sliced)
    config = read_config(sliced, m)
    whole = inventory_from_manifest(m, config, mx.float32)
    with pytest.raises(ModelError, match="mlx-lm has no tensor-parallel shard"):
        sharded_inventory(whole, config, 2, 0, expert_layout(m), sliced)


# --- two ranks ----------------------------------------------------------------


@pytest.fixture(scope="module")
def two_rank_runs(models, launch, tmp_path_factory):
    """One launch for every shardable fixture (k slots: the experts stream) and an
    unsliced conversion."""
    k = 4  # every fixture's experts per token
    items = [f"{a}={models(a)[1]},{models(a)[0]}" for a in SHARDABLE]
    items.append(f"unsliced={models('qwen3_moe')[2]},{models('qwen3_moe')[0]}")
    ranks, proc, _ = launch(["tokens", tmp_path_factory.mktemp("runs"), STEPS, k, "-", *items],
                            timeout=400)
    assert set(ranks) == {0, 1}, proc.stderr[-2000:]
    for r in ranks.values():
        assert "error" not in r, r["error"]
    return ranks


@pytest.mark.parametrize("arch", SHARDABLE)
def test_two_ranks_give_mlx_lm_sharded_tokens_and_logits(arch, models, two_rank_runs):
    _, sliced, _ = models(arch)
    k = read_manifest(sliced).experts["experts_per_token"]
    single, _, _, _ = single_process(sliced, cache_slots=k)
    for rank in two_rank_runs.values():
        r = rank[arch]
        assert r["tokens"] == r["mlx_lm_tokens"]  # mlx-lm's own sharded model
        assert r["logits_equal"]  # bit for bit
        assert r["misses"] > 0  # the experts really streamed (k slots)
        # Sums of partial results round differently from one process; on these
        # fixtures the greedy tokens are still the same.
        assert r["tokens"] == single


def test_an_unsliced_model_also_shards_reading_whole_records(models, two_rank_runs):
    _, _, whole = models("qwen3_moe")
    for rank in two_rank_runs.values():
        r = rank["unsliced"]
        assert r["tokens"] == r["mlx_lm_tokens"] and r["logits_equal"]
        assert r["record_bytes"] == read_manifest(whole).experts["record_size"]


def test_each_rank_reads_at_most_055x_the_expert_bytes_of_one_process(models, launch, tmp_path):
    src, sliced, _ = models("kimi_k3")
    ranks, proc, _ = launch(["tokens", tmp_path, STEPS, "-", BUDGET, f"k3={sliced},{src}"])
    assert set(ranks) == {0, 1}, proc.stderr[-2000:]
    tokens, _, one_bytes, one_slots = single_process(sliced, memory_budget=BUDGET)
    assert one_bytes > 0
    for rank in ranks.values():
        assert "error" not in rank, rank["error"]
        r = rank["k3"]
        assert r["tokens"] == tokens
        assert r["slots"] > one_slots
        assert r["bytes_read"] <= 0.55 * one_bytes, (r["bytes_read"], one_bytes)


def test_ranks_that_load_different_models_stop_with_one_message(models, launch, tmp_path):
    _, k3, _ = models("kimi_k3")
    _, qwen, _ = models("qwen3_moe")
    ranks, proc, seconds = launch(["load", tmp_path, k3, qwen], timeout=120)
    assert ranks, proc.stderr[-2000:]
    for r in ranks.values():
        assert "loaded a different model" in r.get("error", ""), r


def test_a_rank_that_dies_stops_the_other_without_a_hang(models, launch, tmp_path):
    _, sliced, _ = models("qwen3_moe")
    ranks, proc, seconds = launch(["die", tmp_path, sliced], timeout=120, expect_output=False)
    # The ring backend reports the lost peer to a rank in a collective; mlx.launch
    # ends the ranks still running. Either way nothing waits forever.
    assert not ranks.get(0, {}).get("finished"), ranks
    assert "exited with code 3" in proc.stdout + proc.stderr


def test_deltafin_run_under_mlx_launch_prints_one_answer_with_the_same_tokens(models, launch):
    _, sliced, _ = models("qwen3_moe")
    run = [str(BIN / "deltafin-run"), str(sliced), "hello", "-n", "4", "--json"]
    alone = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr
    cmd = [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
           "--starting-port", str(_free_port()), "--python", sys.executable, "--", *run]
    both = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    answers = [json.loads(line) for line in both.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == 1, both.stdout + both.stderr[-2000:]  # rank 0 only
    assert answers[0]["tokens"] == json.loads(alone.stdout)["tokens"]


def _launched_server_answer(server_argv, tmp_path):
    """Start `server_argv` on 2 local ranks, ask rank 0 for 6 greedy tokens of
    "hello there", stop the ranks; (the answer or None, the ranks' log)."""
    port = _free_port()
    cmd = [str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
           "--starting-port", str(_free_port()), "--python", sys.executable, "--",
           *server_argv, "--host", "127.0.0.1", "--port", str(port)]
    log_path = tmp_path / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    body = json.dumps({"prompt": "hello there", "max_tokens": 6, "temperature": 0}).encode()
    answer, deadline = None, time.monotonic() + 180
    try:
        while answer is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
            except OSError:
                time.sleep(1)
        time.sleep(0.5)  # a log line written after the answer
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    return answer, log_path.read_text()


def test_mlx_lm_server_under_mlx_launch_answers_a_request(models, tmp_path):
    if not LAUNCH.exists():
        pytest.skip(f"mlx.launch is not installed next to {sys.executable}")
    _, sliced, _ = models("qwen3_moe")
    answer, log = _launched_server_answer(
        [str(BIN / "mlx_lm.server"), "--model", str(sliced), "--trust-remote-code"], tmp_path)
    assert answer is not None, log[-2000:]
    assert answer["usage"]["completion_tokens"] == 6
    # The same greedy text as one process running the same directory.
    import mlx_lm

    model, tok = mlx_lm.load(str(sliced), trust_remote_code=True)
    expected = mlx_lm.generate(model, tok, "hello there", max_tokens=6)
    assert answer["choices"][0]["text"] == expected
    runtime(model).close()


def test_deltafin_serve_under_mlx_launch_answers_and_only_rank_0_logs_it(models, tmp_path):
    """`deltafin-run serve` on 2 ranks: rank 0 listens and answers, the ranks decode
    together, and the request's log line is written once (rank 0's)."""
    if not LAUNCH.exists():
        pytest.skip(f"mlx.launch is not installed next to {sys.executable}")
    _, sliced, _ = models("qwen3_moe")
    answer, text = _launched_server_answer(
        [str(BIN / "deltafin-run"), "serve", str(sliced), "--context", "512"], tmp_path)
    assert answer is not None, text[-2000:]
    assert answer["usage"]["completion_tokens"] == 6
    assert text.count("[deltafin] /v1/completions ok") == 1, text[-2000:]
