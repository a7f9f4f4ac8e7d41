"""Teacher-forced scoring: every log-probability equals mlx-lm's own model fully in
memory (float32, within 1e-4) and the first of the top K is its argmax, for every
fixture architecture at a streaming and a full budget; a pass reads each routed
expert at most once (within 10% of the union of its routing); many short texts take
one sweep; a killed job resumes without duplicates or lost lines; the safetensors
output reads back with plain numpy."""

import json
import os
import signal
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest

import deltafin_mlx
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.jobs.score import ScoreOptions, run_job
from deltafin_mlx.jobs.score_packing import pack

ARCHS = ["kimi_k3", "kimi_k2", "qwen3_moe", "mixtral"]
WORDS = ("the experts stream from disk while the trunk stays in memory and every "
         "token routes to a few of them 12 34 def route(x): return x").split()


def texts(n, words=12, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(words + rng.integers(-3, 4)))) for _ in range(n)]


def reference_logprobs(reference, tokens):
    logits = reference(mx.array([tokens]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("slots", [3, None], ids=["streaming", "full"])
def test_logprobs_equal_mlx_lm_in_memory(converted, references, arch, slots):
    """Each scored token's log-probability and the top K at each position match
    mlx-lm's model run on that text alone, fully in memory; top-1 is the argmax."""
    model, tok = load(converted(arch), "200MB", cache_slots=slots, warm_start=False)
    if slots is not None:
        slots = runtime(model).plan.slots
        assert slots < runtime(model).plan.num_experts * runtime(model).plan.moe_layers
    inputs = texts(5) + [{"id": "pc", "prompt": "the experts", "completion": " stream from disk"}]
    results = deltafin_mlx.score(model, tok, inputs, top_logprobs=4)
    ref = references(arch)
    for r in results:
        assert "error" not in r, r
        lp = reference_logprobs(ref, r["tokens"])
        assert r["token_logprobs"][0] is None and r["top_logprobs"][0] is None
        assert r["top_ids"][0] is None and r["tail_logprob"][0] is None
        scored = 0
        for p in range(1, len(r["tokens"])):
            got = r["token_logprobs"][p]
            if got is None:
                continue
            scored += 1
            want = lp[p - 1]
            assert abs(got - want[r["tokens"][p]]) < 1e-4
            top = list(zip(r["top_ids"][p], r["top_logprobs"][p]))
            assert top[0][0] == int(np.argmax(want))
            assert [round(v, 4) for _, v in top] == [round(float(want[i]), 4) for i, _ in top]
            assert all(abs(v - want[i]) < 1e-4 for i, v in top)
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert scored == r["scored_tokens"] > 0
        assert abs(r["logprob"] - sum(v for v in r["token_logprobs"] if v is not None)) < 1e-3
    pc = results[-1]
    n_prompt = len(tok.encode("the experts"))
    assert all(v is None for v in pc["token_logprobs"][:n_prompt])
    assert all(v is not None for v in pc["token_logprobs"][n_prompt:])
    runtime(model).close()


def write_lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_lines(path):
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]


def test_sixteen_short_texts_take_one_sweep_at_40MB(converted, tmp_path):
    """16 texts of about 60 tokens on the K3 layout at a 40 MB budget, streaming
    (the cache holds a few experts): one pass, which reads every expert it routes
    to at most once, within 10% of the union of its routing."""
    model, tok = load(converted("kimi_k3"), "40MB", cache_slots=6, warm_start=False)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": i, "text": t} for i, t in enumerate(texts(16, words=30, seed=1))]
    write_lines(inp, rows)
    lengths = [len(tok.encode(r["text"])) for r in rows]
    assert 50 <= np.mean(lengths) <= 70, lengths
    s = run_job(model, tok, inp, out, ScoreOptions(), show_progress=False)
    assert s["sweeps"] == 1 and s["scored_texts"] == 16
    assert 0 < s["expert_bytes_read"] <= 1.10 * s["union_bytes"]
    assert sorted(r["id"] for r in read_lines(out)) == list(range(16))
    runtime(model).close()


def test_each_pass_reads_at_most_the_union_of_its_routing(converted, tmp_path):
    """Pass by pass (small passes forced), the expert bytes read stay within 1.10x
    of what reading each (layer, expert) the pass's real tokens route to once
    would read; pads read nothing."""
    from deltafin_mlx.jobs.score_lines import prepare
    from deltafin_mlx.jobs.score import iter_passes
    from deltafin_mlx.jobs.batch_lines import read_requests

    model, tok = load(converted("qwen3_moe"), "200MB", cache_slots=8, warm_start=False)
    reqs = read_requests((json.dumps({"id": i, "text": t}) for i, t in enumerate(texts(12, 20))),
                         spec_of=dict)
    items = [prepare(r, tok) for r in reqs]
    passes = list(iter_passes(model, items, ScoreOptions(max_pass_tokens=64)))
    assert len(passes) > 2
    assert sum(stats.real_tokens for _, stats in passes) == sum(len(it.tokens) for it in items)
    for _, stats in passes:
        assert stats.real_tokens <= stats.tokens
        assert 0 < stats.expert_bytes_read <= 1.10 * stats.union_bytes
    runtime(model).close()


def test_packing_takes_longest_first_and_fills_passes():
    """Passes hold rows x their longest text within the capacity; every text is in
    exactly one pass; a text beyond the capacity is a pass of its own."""
    lengths = [5, 9, 3, 9, 40, 7, 2]
    passes = pack(lengths, lambda longest: 20)
    assert sorted(i for p in passes for i in p) == list(range(len(lengths)))
    assert passes[0] == [4]
    for p in passes:
        assert len(p) == 1 or len(p) * max(lengths[i] for i in p) <= 20


def score_cli(*args):
    return subprocess.run([sys.executable, "-m", "deltafin_mlx.cli.main", "score", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_cli_bad_lines_become_error_lines_and_duplicates_are_refused(converted, tmp_path):
    """A line that is not JSON, has unknown keys or nothing to score becomes an error
    line and the rest are scored; --json prints the summary; duplicate ids stop the
    job before anything is written."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"id": 1, "text": "the experts stream"}\nnot json\n'
                   '{"id": 2, "txt": "x"}\n{"id": 3, "messages": [{"role": "user", '
                   '"content": "hi"}, {"role": "assistant", "content": "the experts"}]}\n')
    r = score_cli(converted("kimi_k3"), inp, "-o", out, "--budget", "200MB", "--json",
                  "--top-logprobs", "3")
    assert r.returncode == 3, r.stderr  # finished, some lines are error lines
    summary = json.loads(r.stdout)
    assert summary["texts"] == 4 and summary["errors"] == 2 and summary["scored_texts"] == 2
    assert summary["perplexity"] > 1 and summary["sweeps"] == 1
    lines = {json.dumps(l["id"]): l for l in read_lines(out)}
    assert "error" in lines["2"] and "error" in lines["null"]
    assert lines["1"]["scored_tokens"] == len(lines["1"]["tokens"]) - 1
    chat = lines["3"]
    assert 0 < chat["scored_tokens"] < len(chat["tokens"]) - 1
    assert len(chat["top_logprobs"][-1]) == 3
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n')
    r = score_cli(converted("kimi_k3"), dup, "-o", tmp_path / "d.jsonl", "--budget", "200MB")
    assert r.returncode == 1 and "appears on lines 1 and 2" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "d.jsonl").exists()


@pytest.mark.parametrize("fmt", ["jsonl", "safetensors"])
def test_killed_job_resumes_without_duplicates_or_lost_lines(converted, tmp_path, fmt):
    """A score job killed with SIGKILL mid-run, then rerun, answers every id exactly
    once, with the values an uninterrupted run gives."""
    N = 60  # passes of 2-3 texts: the kill lands with most of the job left
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"id": i, "text": t} for i, t in enumerate(texts(N, 14, seed=3))])
    cmd = [sys.executable, "-m", "deltafin_mlx.cli.main", "score", str(converted("mixtral")),
           str(inp), "-o", str(out), "--budget", "200MB", "--pass-tokens", "40",
           "--format", fmt, "--top-logprobs", "2", "--no-warm-start"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and (not out.exists() or len(read_lines(out)) < 5):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = len(read_lines(out))
    assert 0 < first < N, "the kill should land mid-job"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = read_lines(out)
    assert sorted(l["id"] for l in lines) == list(range(N))
    whole = tmp_path / "whole.jsonl"
    r = subprocess.run(cmd[:7] + [str(whole)] + cmd[8:], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    want = {l["id"]: l["logprob"] for l in read_lines(whole)}
    assert all(abs(l["logprob"] - want[l["id"]]) < 1e-3 for l in lines)


def test_safetensors_output_reads_back_with_plain_numpy(converted, tmp_path):
    """--format safetensors: the index maps each id to a shard and rows; the shard
    loads with the safetensors package's numpy loader (no Deltafin), and its rows
    hold the JSONL output's tokens, float16 log-probs (NaN where not scored),
    top-K ids and log-probs and the same tail masses; index lines name IN's line."""
    from safetensors.numpy import load_file

    model, tok = load(converted("qwen3_moe"), "200MB", warm_start=False)
    inp = tmp_path / "in.jsonl"
    write_lines(inp, [{"id": f"t{i}", "text": t} for i, t in enumerate(texts(6, seed=4))])
    run_job(model, tok, inp, tmp_path / "a.jsonl", ScoreOptions(top_logprobs=3),
            show_progress=False)
    run_job(model, tok, inp, tmp_path / "idx.jsonl",
            ScoreOptions(top_logprobs=3, format="safetensors", max_pass_tokens=40),
            show_progress=False)
    runtime(model).close()
    want = {l["id"]: l for l in read_lines(tmp_path / "a.jsonl")}
    index = read_lines(tmp_path / "idx.jsonl")
    assert sorted(l["id"] for l in index) == sorted(want) and len({l["shard"] for l in index}) > 1
    for line in index:
        shard = load_file(str(tmp_path / line["shard"]))
        rows = slice(line["offset"], line["offset"] + line["length"])
        w = want[line["id"]]
        assert shard["tokens"].dtype == np.int32 and shard["token_logprobs"].dtype == np.float16
        assert shard["tokens"][rows].tolist() == w["tokens"]
        lp = shard["token_logprobs"][rows]
        assert np.isnan(lp[0]) and line["scored_tokens"] == w["scored_tokens"]
        assert np.allclose(lp[1:], [v for v in w["token_logprobs"][1:]], atol=1e-2)
        assert shard["top_ids"][rows][1:].tolist() == w["top_ids"][1:]
        assert shard["top_logprobs"].dtype == np.float16
        tail = shard["tail_logprob"][rows]
        assert tail.dtype == np.float32 and np.isnan(tail[0])
        assert tail[1:].tolist() == w["tail_logprob"][1:]  # the same float32 values
        assert line["line"] == w["line"] == int(line["id"][1:]) + 1
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("arch", ["kimi_k3", "qwen3_moe"])
def test_batch_top_logprobs_equal_score_for_the_same_tokens(converted, arch):
    """batch --top-logprobs K gives, at each generated position, the top K that
    scoring the prompt plus the generated tokens gives there (within 1e-4, same
    ids), and the chosen token's log-probability equals score's."""
    from deltafin_mlx.jobs.score_lines import ScoreItem
    from deltafin_mlx.jobs.score import iter_passes

    model, tok = load(converted(arch), "200MB", cache_slots=6, warm_start=False)
    prompts = ["the experts stream from", "every token routes"]
    got = deltafin_mlx.batch_generate(model, tok, prompts, max_tokens=6, raw=True,
                                      top_logprobs=3, logprobs=True)
    items = []
    for i, (p, g) in enumerate(zip(prompts, got)):
        prompt = tok.encode(p)
        tokens = prompt + g["tokens"]
        scored = np.arange(len(tokens)) >= len(prompt)
        items.append(ScoreItem(i, tokens, scored))
    scores = {s.item.id: s for results, _ in
              iter_passes(model, items, ScoreOptions(top_logprobs=3)) for s in results}
    for i, g in enumerate(got):
        s, start = scores[i], len(tok.encode(prompts[i]))
        assert len(g["top_logprobs"]) == len(g["tokens"]) > 0
        for j, top in enumerate(g["top_logprobs"]):
            p = start + j
            assert [t for t, _ in top] == s.top_ids[p].tolist()
            assert np.allclose([v for _, v in top], s.top_logprobs[p], atol=1e-4)
            assert abs(g["logprobs"][j] - s.token_logprobs[p]) < 1e-4
    runtime(model).close()


def test_run_json_top_logprobs(converted):
    """`run --json --top-logprobs K`: one list of K [id, logprob] pairs per generated
    token, best first, the first being the greedy token; without --json it is refused."""
    cmd = [sys.executable, "-m", "deltafin_mlx.cli.main", str(converted("mixtral")),
           "the experts", "-n", "4", "--raw", "--budget", "200MB", "--top-logprobs", "2"]
    r = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["top_logprobs"]) == len(out["tokens"]) > 0
    for tok, top in zip(out["tokens"], out["top_logprobs"]):
        assert len(top) == 2 and top[0][0] == tok and top[0][1] >= top[1][1]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--top-logprobs needs --json" in r.stderr


def test_plan_shows_scoring_passes_and_their_projected_rate(converted, capsys):
    """`plan` reports tokens per scoring pass (at least a prefill pass's: a scoring
    pass keeps no KV cache) and the projected scoring rate, also in --json."""
    from deltafin_mlx.cli.main import main

    args = ["plan", str(converted("kimi_k3")), "--budget", "40MB", "--disk-gbps", "2",
            "--compute-gwps", "50", "--prefill-gwps", "100"]
    assert main(args + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["scoring_pass_tokens"] >= r["prefill_pass_tokens"]
    assert r["scoring_projection"]["tokens_per_second"] > 0
    assert main(args) == 0
    assert "scoring        passes of up to" in capsys.readouterr().out


@pytest.mark.parametrize("arch", ["kimi_k3", "qwen3_moe"])
def test_texts_longer_than_an_attention_group_are_exact_too(converted, references, arch):
    """At 40 MB an attention call holds fewer tokens than these texts: they are
    attended in the plan's chunks over a cache kept for the pass, and still match
    mlx-lm within 1e-4; a K beyond the vocabulary gives the whole vocabulary."""
    from deltafin_mlx.jobs.score import Sizing

    model, tok = load(converted(arch), "40MB", cache_slots=6, warm_start=False)
    inputs = texts(2, words=150, seed=5)
    longest = max(len(tok.encode(t)) for t in inputs)
    assert longest > Sizing(model).attention(longest)
    results = deltafin_mlx.score(model, tok, inputs, top_logprobs=100000)
    ref = references(arch)
    for r in results:
        lp = reference_logprobs(ref, r["tokens"])
        for p in range(1, len(r["tokens"])):
            assert abs(r["token_logprobs"][p] - lp[p - 1][r["tokens"][p]]) < 1e-4
        assert len(r["top_logprobs"][1]) == lp.shape[-1]
    runtime(model).close()


def test_fifo_or_directory_input_and_output_are_one_line_errors(converted, tmp_path):
    """IN or OUT a FIFO (which would block) or a directory: one error line, exit 1,
    no traceback, nothing written."""
    good = tmp_path / "in.jsonl"
    good.write_text('{"id": 1, "text": "the experts"}\n')
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for args in ([fifo, "-o", tmp_path / "o.jsonl"], [good, "-o", fifo], [good, "-o", tmp_path]):
        r = score_cli(converted("qwen3_moe"), *args, "--budget", "200MB")
        assert r.returncode == 1 and "must be a regular file" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.jsonl").exists()


def test_progress_line_counts_texts_and_rate(converted, tmp_path, capsys):
    """On a terminal the job shows texts done of all, errors, tokens/s and an ETA."""
    model, tok = load(converted("qwen3_moe"), "200MB", warm_start=False)
    inp = tmp_path / "in.jsonl"
    write_lines(inp, [{"id": i, "text": t} for i, t in enumerate(texts(3))] + [{"id": 9}])
    run_job(model, tok, inp, tmp_path / "o.jsonl", ScoreOptions(max_pass_tokens=20),
            show_progress=True)
    err = capsys.readouterr().err
    assert "[score] 4/4 texts (1 errors)" in err and "tok/s, ETA" in err
    runtime(model).close()


def test_score_runs_on_a_model_deltafin_did_not_load(converted, references):
    """deltafin_mlx.score also scores mlx-lm's own model in memory (no plan: fixed
    pass sizes), with the values Deltafin's streaming model gives."""
    model, tok = load(converted("mixtral"), "200MB", cache_slots=4, warm_start=False)
    inputs = texts(3, seed=7)
    ours = deltafin_mlx.score(model, tok, inputs, top_logprobs=2)
    theirs = deltafin_mlx.score(references("mixtral"), tok, inputs, top_logprobs=2)
    for a, b in zip(ours, theirs):
        assert a["tokens"] == b["tokens"] and a["greedy"] == b["greedy"]
        assert abs(a["logprob"] - b["logprob"]) < 1e-3
        assert a["top_ids"] == b["top_ids"]
    runtime(model).close()


def test_score_job_runs_on_a_model_deltafin_did_not_load(converted, references, tmp_path):
    """run_job (`deltafin-run score`'s library) on mlx-lm's own model: its line bound
    comes from the model's limits without a plan, and every text is scored."""
    model, tok = load(converted("mixtral"), "200MB", cache_slots=4, warm_start=False)
    runtime(model).close()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [{"id": i, "text": t} for i, t in enumerate(texts(3, seed=7))])
    summary = run_job(references("mixtral"), tok, inp, out, ScoreOptions(), show_progress=False)
    assert summary["scored_texts"] == 3 and summary["errors"] == 0
    assert sorted(r["id"] for r in read_lines(out)) == [0, 1, 2]
