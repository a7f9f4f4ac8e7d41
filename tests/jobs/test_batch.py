"""Batch jobs: prompts decoded together give each prompt's own greedy answer, a
killed job resumes without losing or repeating an id, and bad lines become error
lines instead of stopping the job.

On MLX's CPU backend a batch's logits are bit-identical to each prompt run alone
when the lone run fills its cache the way mlx-lm's BatchGenerator does (all but the
last prompt token in one pass, then the last one as the first decode step). A lone
run that passes the whole prompt at once gives the same logits for Qwen3-MoE and
Mixtral, but Kimi K3's KDA layers round the chunked prefill differently (a few
1e-6): tokens are equal on these fixtures, logits within 1e-4."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from deltafin_mlx.generation.render import render
from deltafin_mlx import batch_generate
from deltafin_mlx.jobs.results_file import Results
from deltafin_mlx.jobs.batch_lines import read_requests
from deltafin_mlx.errors import JobError
from deltafin_mlx.cli.main import main
from deltafin_mlx.generation.engine import generate
from deltafin_mlx.engine.load import load
from deltafin_mlx.testing.decode import load_resident
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.plan.memory import plan_memory, choose_sequences
from deltafin_mlx.plan.footprint import inventory_from_manifest
from deltafin_mlx import runtime


def token_prompts(n, seed=0, lengths=(3, 17, 6, 29, 1, 11, 8, 23, 4, 14)):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 380, size=lengths[i % len(lengths)]).tolist() for i in range(n)]


def alone(model, prompt, steps, eos, split_prefill):
    """One prompt by itself, greedy: tokens (EOS excluded) and each token's logprob."""
    cache = make_prompt_cache(model)
    if split_prefill and len(prompt) > 1:
        model(mx.array([prompt[:-1]]), cache=cache)
        logits = model(mx.array([prompt[-1:]]), cache=cache)[:, -1]
    else:
        logits = model(mx.array([prompt]), cache=cache)[:, -1]
    tokens, lps = [], []
    for _ in range(steps):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = mx.argmax(lp, axis=-1).item()
        if y in eos:
            break
        tokens.append(y)
        lps.append(lp[0, y].item())
        logits = model(mx.array([[y]]), cache=cache)[:, -1]
    return tokens, lps


@pytest.fixture(scope="module")
def streamed(converted):
    """Deltafin models with a cache of 1.5 tokens' experts: most reads miss, and a
    batch step needs far more distinct experts than fit (read in groups)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            k = read_manifest(converted(arch)).experts["experts_per_token"]
            cache[arch] = load(converted(arch), cache_slots=k + k // 2)
        return cache[arch]

    yield get
    for model, _ in cache.values():
        runtime(model).close()


@pytest.mark.parametrize("arch", ["kimi_k3", "qwen3_moe"])
def test_greedy_batch_equals_each_prompt_run_alone(arch, converted, streamed):
    model, tok = streamed(arch)
    eos = set(tok.eos_token_ids)
    prompts = token_prompts(10)
    steps = [12, 20, 5, 16, 9, 20, 14, 3, 18, 11]
    reqs = [{"id": f"r{i}", "prompt": tok.decode(p), "max_tokens": s}
            for i, (p, s) in enumerate(zip(prompts, steps))]
    # batch 4 < 10 requests: sequences join and leave the batch as others finish
    results = batch_generate(model, tok, reqs, raw=True, batch_size=4, logprobs=True)
    assert runtime(model).stats.misses > 0
    resident = load_resident(converted(arch))
    for req, res, n in zip(reqs, results, steps):
        prompt = tok.encode(req["prompt"])
        assert res["id"] == req["id"] and res["stats"]["prompt_tokens"] == len(prompt)
        assert res["finish_reason"] in ("length", "stop")
        # bit-identical to the prompt alone, filled in as BatchGenerator fills it
        tokens, lps = alone(resident, prompt, n, eos, split_prefill=True)
        assert res["tokens"] == tokens and res["logprobs"] == lps, req["id"]
        # the same tokens as `deltafin-run` on the prompt alone (one-pass prefill)
        single = generate(model, tok, prompt, n)
        assert res["tokens"] == [t for t in single.tokens if t not in eos], req["id"]
        assert res["text"] == render(tok, single.tokens, thinking=False)[0]  # markup hidden
        one_pass = alone(resident, prompt, n, eos, split_prefill=False)[1]
        if arch == "kimi_k3":
            assert np.allclose(res["logprobs"], one_pass, atol=1e-4)
        else:
            assert res["logprobs"] == one_pass
    # mlx-lm's own batch on the resident model is the oracle for the whole schedule
    oracle = batch_generate(resident, tok, reqs, raw=True, batch_size=4, logprobs=True)
    assert [(r["tokens"], r["logprobs"]) for r in oracle] == [
        (r["tokens"], r["logprobs"]) for r in results]


def test_experts_are_read_once_per_step_for_the_whole_batch(converted):
    """Decoding 8 sequences together reads fewer expert bytes per token than one
    at a time (each step reads the union of the sequences' experts once)."""
    k = read_manifest(converted("qwen3_moe")).experts["experts_per_token"]
    model, tok = load(converted("qwen3_moe"), cache_slots=k, lookahead=False)
    reqs = [{"id": i, "prompt": tok.decode(p), "max_tokens": 12}
            for i, p in enumerate(token_prompts(8, seed=3))]
    per_token = {}
    for b in (1, 8):
        before = runtime(model).store.bytes_read
        res = batch_generate(model, tok, reqs, raw=True, batch_size=b)
        tokens = sum(r["stats"]["generation_tokens"] for r in res)
        per_token[b] = (runtime(model).store.bytes_read - before) / tokens
        assert abs(sum(r["stats"]["expert_bytes_read"] for r in res)
                   - (runtime(model).store.bytes_read - before)) <= len(res)
    assert per_token[8] < 0.7 * per_token[1]
    runtime(model).close()


def test_seeded_sampling_is_the_lone_runs_and_independent_of_the_batch(converted, streamed):
    model, tok = streamed("qwen3_moe")
    prompts = [tok.decode(p) for p in token_prompts(5, seed=1)]
    reqs = [{"id": i, "prompt": p, "max_tokens": 10, "temp": 0.9, "top_p": 0.95, "seed": 40 + i}
            for i, p in enumerate(prompts)]
    together = batch_generate(model, tok, reqs, raw=True, batch_size=5)
    apart = batch_generate(model, tok, reqs[2:3], raw=True, batch_size=1)
    assert together[2]["tokens"] == apart[0]["tokens"] and together[2]["seed"] == 42
    lone = generate(model, tok, tok.encode(prompts[2]), 10, temp=0.9, top_p=0.95, seed=42)
    assert together[2]["tokens"] == lone.tokens[: len(together[2]["tokens"])]
    assert len({tuple(r["tokens"]) for r in together}) > 1


def test_stop_strings_cut_the_text_as_a_lone_run_does(streamed):
    model, tok = streamed("qwen3_moe")
    prompt = tok.decode(token_prompts(1, seed=5)[0])
    full = batch_generate(model, tok, [prompt], raw=True, max_tokens=16)[0]
    stop = full["text"][len(full["text"]) // 2:][:3]
    assert stop.strip()
    res = batch_generate(model, tok, [{"prompt": prompt, "stop": [stop]}, prompt], raw=True,
                         max_tokens=16, batch_size=2)
    lone = generate(model, tok, tok.encode(prompt), 16, stop=[stop])
    assert res[0]["finish_reason"] == "stop" and res[0]["text"] == lone.text
    assert res[0]["text"] == full["text"][: full["text"].index(stop)]
    assert res[1]["text"] == full["text"]  # the other sequence is unaffected


def test_chat_messages_use_the_models_prompt_format(streamed):
    from deltafin_mlx.generation.engine import chat_prompt

    model, tok = streamed("kimi_k3")
    msgs = [{"role": "user", "content": "Hello"}]
    res = batch_generate(model, tok, [{"messages": msgs}, {"prompt": "Hello"}], max_tokens=3,
                         thinking=False)
    want = len(chat_prompt(tok, msgs, thinking=False))
    assert [r["stats"]["prompt_tokens"] for r in res] == [want, want]
    assert res[0]["tokens"] == res[1]["tokens"]


def test_bad_requests_become_error_lines_and_the_job_goes_on(converted, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        json.dumps({"id": "ok1", "prompt": "Hello"}),
        "{not json",
        json.dumps({"prompt": "no id"}),
        json.dumps({"id": "long", "prompt": "Hello", "max_tokens": 100000}),  # cut to fit
        json.dumps({"id": "typo", "prompt": "Hello", "max_token": 3}),
        json.dumps({"id": "both", "prompt": "a", "messages": []}),
        json.dumps({"id": "temp", "prompt": "a", "temp": -1}),
        json.dumps({"id": 7, "prompt": "Hello again"}),
        "",
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    rc = main(["batch", str(converted("qwen3_moe")), str(src), "-o", str(out), "-n", "4",
               "--raw", "--context", "512"])
    assert rc == 3  # finished, some lines are error lines
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    by_line = {r.get("line"): r for r in lines if "error" in r}
    assert set(by_line) == {2, 3, 5, 6, 7}
    assert "not JSON" in by_line[2]["error"] and "id" in by_line[3]["error"]
    assert "max_token" in by_line[5]["error"]
    assert "exactly one" in by_line[6]["error"] and "temp" in by_line[7]["error"]
    done = [r for r in lines if "error" not in r]
    assert sorted(map(str, (r["id"] for r in done))) == ["7", "long", "ok1"]
    assert all(len(r["tokens"]) == 4 and r["finish_reason"] == "length" for r in done
               if r["id"] != "long")
    assert sum(len(r["tokens"]) + r["stats"]["prompt_tokens"] for r in done
               if r["id"] == "long") <= 512
    assert "8 answered now (5 errors)" in capsys.readouterr().err


def test_duplicate_ids_refuse_the_job_before_it_starts(converted, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "a"}\n{"id": "1", "prompt": "b"}\n{"id": 1, "prompt": "c"}\n')
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(converted("qwen3_moe")), str(src), "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "id 1 appears on lines 1 and 3" in err[0]
    assert not out.exists()
    with pytest.raises(JobError):
        read_requests(['{"id": "x", "prompt": "a"}', '{"id": "x", "messages": []}'])


def test_a_partial_last_line_is_truncated_and_redone(converted, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out.jsonl"
    args = ["batch", str(converted("qwen3_moe")), str(src), "-o", str(out), "-n", "3", "--raw"]
    assert main(args) == 0
    lines = out.read_text().splitlines(keepends=True)
    # as a kill mid-write would leave it: two results and a third cut short
    out.write_text(lines[0] + lines[1] + lines[2][:-9])
    results = Results(out)
    assert results.scan() == {json.dumps(json.loads(lines[0])["id"]),
                              json.dumps(json.loads(lines[1])["id"])}
    results.close()
    assert out.read_text() == lines[0] + lines[1]
    assert main(args) == 0
    answer = lambda line: (line.endswith("\n"),  # noqa: E731
                           [json.loads(line)[k] for k in ("id", "text", "tokens")])
    assert sorted(map(answer, out.read_text().splitlines(keepends=True))) == sorted(
        map(answer, lines))
    out.write_text(lines[0] + "garbage\n")
    assert main(args) == 1  # a complete line that is not a result: never appended to


def test_plan_counts_every_sequences_state(converted):
    m = read_manifest(converted("kimi_k3"))
    from mlx_lm.utils import load_config

    inv = inventory_from_manifest(m, load_config(converted("kimi_k3")), mx.float32)
    one = plan_memory(inv, 1 << 30, context=256)
    four = plan_memory(inv, 1 << 30, context=256, sequences=4)
    per = one.sequence_recurrent_bytes + one.sequence_kv_bytes
    assert one.sequence_recurrent_bytes > 0 and one.sequence_kv_bytes > 0  # KDA and MLA
    assert four.state_bytes == 4 * per and four.floor == one.floor + 3 * per
    assert four.slots < one.slots or one.slots == one.num_experts * one.moe_layers
    # auto: extra state stays within half of what is above the floor
    budget = one.floor + 10 * per
    b = choose_sequences(inv, budget, context=256)
    assert b == 6 and plan_memory(inv, budget, context=256, sequences="auto").sequences == 6
    # ... and no more than there are requests to answer
    assert plan_memory(inv, budget, context=256, sequences="auto", max_sequences=3).sequences == 3


def test_auto_batch_size_reserves_state_only_for_the_requests_left(converted, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}", "max_tokens": 2}) + "\n"
                           for i in range(3)))
    out.write_text(json.dumps({"id": 0, "text": "", "tokens": 0}) + "\n")  # one answered
    cmd = [sys.executable, "-m", "deltafin_mlx.cli.main", "batch", str(converted("qwen3_moe")),
           str(src), "-o", str(out), "--raw", "--no-progress", "--budget", "4GB"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "2 answered now" in r.stderr and "batch 2;" in r.stderr


def read_results(path):
    """Complete lines of a job's output; every one must be a whole result."""
    data = path.read_bytes() if path.exists() else b""
    complete = data[: data.rfind(b"\n") + 1]
    return [json.loads(x) for x in complete.splitlines()]


def test_a_job_killed_at_random_points_answers_every_id_once(converted, tmp_path):
    model = converted("qwen3_moe")
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"id": f"q{i}", "prompt": f"Question {i}: " + "why " * (i % 5),
                         "max_tokens": 6 + (i * 7) % 17}) for i in range(18)]
    lines.insert(5, "{broken")
    src.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "deltafin_mlx.cli.main", "batch", str(model), str(src), "--raw",
           "--batch-size", "4", "--no-progress"]
    clean = tmp_path / "clean.jsonl"
    # exit status 3: finished, the broken line an error line
    assert subprocess.run(cmd + ["-o", str(clean)], capture_output=True, timeout=300).returncode == 3

    out = tmp_path / "killed.jsonl"
    rng = random.Random(14)
    kills = 0
    for target in (1, 5, 9, 13):
        proc = subprocess.Popen(cmd + ["-o", str(out)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while len(read_results(out)) < target and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.4))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait(timeout=60)
        read_results(out)  # every complete line parses
    assert kills >= 2
    assert subprocess.run(cmd + ["-o", str(out)], capture_output=True,
                          timeout=300).returncode in (0, 3)  # 3 if the broken line was left

    got, want = read_results(out), read_results(clean)
    key = lambda r: (r["id"], r.get("line"))  # noqa: E731
    assert len(got) == len({key(r) for r in got}) == 19  # every id exactly once
    assert {key(r): (r.get("text"), r.get("tokens"), r.get("error")) for r in got} == {
        key(r): (r.get("text"), r.get("tokens"), r.get("error")) for r in want}
    assert out.read_bytes().endswith(b"\n")


def test_plan_shows_the_state_of_each_sequence(converted, capsys):
    args = ["plan", str(converted("kimi_k3")), "--budget", "1GB", "--context", "256",
            "--disk-gbps", "1", "--compute-gwps", "1"]
    assert main(args + ["--sequences", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    per = r["sequence_recurrent_bytes"] + r["sequence_kv_bytes"]
    assert r["sequences"] == 3 and r["state_bytes"] == 3 * per
    # auto: as many as the state memory allows, past mlx-lm's default batch of 32
    assert r["auto_sequences"] > 32
    assert main(args + ["--sequences", "auto"]) == 0
    assert f"for {r['auto_sequences']} sequences; per sequence" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(args + ["--sequences", "0"])
    assert e.value.code == 2 and "--sequences" in capsys.readouterr().err


def test_progress_shows_requests_tokens_per_second_and_eta(streamed, tmp_path, capsys):
    from deltafin_mlx.jobs.batch import BatchOptions, open_job, run_job, summary_line

    model, tok = streamed("qwen3_moe")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in range(5)))
    job = open_job(src, out)
    s = run_job(model, tok, job, BatchOptions(max_tokens=4, raw=True, batch_size=2),
                show_progress=True)
    job.close()
    err = capsys.readouterr().err
    assert "[batch] 1/5 requests" in err and "[batch] 5/5 requests (0 errors)" in err
    assert "tok/s, ETA 0:00:" in err
    assert s["answered"] == 5 and s["tokens"] == 20 and s["skipped"] == 0
    assert "5 requests: 5 answered now (0 errors), 0 already answered; 20 tokens" in summary_line(s)
