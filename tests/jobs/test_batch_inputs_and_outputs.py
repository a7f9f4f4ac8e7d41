"""Hostile batch jobs: outputs that are devices or FIFOs, two jobs on one output,
outputs far larger than memory should hold, and lines that fail when read, when
rendered or inside the decode loop. Each is one clear line or one error line in
the output; the job never stops on a bad line and a rerun never loses a valid one.
Also what a user sees: a resume announced, Ctrl-C, OpenAI's keys and Batch input
format, `-o -`."""

import json
import os
import tracemalloc
from types import SimpleNamespace

import pytest

import deltafin_mlx.jobs.batch as batch
from deltafin_mlx.jobs.outcome import Outcome
from deltafin_mlx.jobs.progress import Progress
import deltafin_mlx.jobs.results_file as batch_io
from deltafin_mlx.jobs.results_file import Results
from deltafin_mlx.cli.main import main
from deltafin_mlx.errors import JobError


def write_lines(path, *specs):
    path.write_text("".join((s if isinstance(s, str) else json.dumps(s)) + "\n" for s in specs))
    return path


def results(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def job(converted, tmp_path):
    src = write_lines(tmp_path / "in.jsonl", {"id": "a", "prompt": "Hello"},
                      {"id": "b", "prompt": "Hello again"})
    return SimpleNamespace(model=str(converted("qwen3_moe")), src=src, out=tmp_path / "out.jsonl",
                           args=["-n", "3", "--raw", "--no-progress", "--context", "256"])


def run(job, *extra, out=None):
    return main(["batch", job.model, str(job.src), "-o", str(out or job.out), *job.args, *extra])


# --- the output file ---------------------------------------------------------------


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/full", "/dev/null"])
def test_a_device_as_the_output_is_refused_in_one_line(job, device, capsys):
    assert run(job, out=device) == 1
    assert "must be a regular file (this is a character device)" in one_line(
        capsys.readouterr().err)


def test_a_fifo_as_the_output_or_input_is_refused_without_blocking(job, tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert run(job, out=fifo) == 1
    assert "a FIFO" in one_line(capsys.readouterr().err)
    assert main(["batch", job.model, str(fifo), "-o", str(job.out)]) == 1
    assert "the input must be a regular file" in one_line(capsys.readouterr().err)


def test_a_second_job_on_a_locked_output_is_refused(job, capsys):
    first = Results(job.out)  # a job running on this output holds its lock
    try:
        assert run(job) == 1
        assert "another batch job is writing to this output" in one_line(capsys.readouterr().err)
        assert job.out.read_text() == ""
    finally:
        first.close()
    assert run(job) == 0  # the lock goes with the job
    assert {r["id"] for r in results(job.out)} == {"a", "b"}


def test_resume_state_comes_from_a_streaming_scan_in_bounded_memory(tmp_path):
    out = tmp_path / "out.jsonl"
    line = {"text": "x" * 20_000, "tokens": list(range(200)), "finish_reason": "length"}
    with open(out, "w") as f:
        for i in range(2_000):  # ~ 42 MB of earlier results
            f.write(json.dumps({"id": i, **line}) + "\n")
        f.write('{"id": 2000, "text": "cut sho')  # a kill mid-write
    tracemalloc.start()
    results_file = Results(out)
    keys = results_file.scan()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    results_file.close()
    assert len(keys) == 2_000 and "2000" not in keys
    assert peak < 8 << 20, peak  # one line at a time plus the ids
    assert out.read_bytes().endswith(b'"length"}\n')


def test_an_output_line_longer_than_any_result_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(batch_io, "LINE_MAX_BYTES", 100)
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": 1, "text": "y" * 500}) + "\n")
    with pytest.raises(JobError, match="line 1 is not a batch result"):
        Results(out).scan()


def test_dash_writes_results_to_stdout_without_a_file(job, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["batch", job.model, str(job.src), "-o", "-", *job.args]) == 0
    out = capfd.readouterr().out
    assert {json.loads(x)["id"] for x in out.splitlines()} == {"a", "b"}
    assert not (tmp_path / "-").exists()


# --- bad lines: each one an error line, the job goes on ------------------------------


def bad_lines():
    tool = lambda calls: {"messages": [  # noqa: E731
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "user", "content": "go on"}]}
    return [
        ('{"id": "t5", "messages": [{"role": "user", "content": "hi", "tool_calls": 5}]}',
         "messages[0].tool_calls: must be a list"),
        (json.dumps({"id": "tl", **tool([5])}), "messages[1].tool_calls[0]: must be an object"),
        (json.dumps({"id": "tn", **tool([{"type": "function", "function": {"arguments": "{}"}}])}),
         "function.name: must be a string"),
        ('{"id": "\\ud800", "prompt": "Hello"}', '"id"'),
        ('{"id": "sp", "prompt": "\\udfff"}', "unpaired surrogate"),
        ('[' * 100_000 + ']' * 100_000, "not JSON"),
        (b'{"id": "u8", "prompt": "\xff\xfe"}', "not JSON"),
        (json.dumps({"id": "bt", "prompt": "a", "body": {}}), "body: is not a field"),
    ]


def test_every_failing_line_is_an_error_line_and_reruns_lose_nothing(job, capsys):
    bad = bad_lines()
    with open(job.src, "wb") as f:
        for text, _ in bad:
            f.write((text.encode() if isinstance(text, str) else text) + b"\n")
        f.write(json.dumps({"id": "k", "prompt": "Hello", "top_k": 100, "temp": 0.8,
                            "seed": 3}).encode() + b"\n")
        f.write(json.dumps({"id": "ok", "prompt": "Hello"}).encode() + b"\n")
    assert run(job) == 3  # finished, some lines are error lines
    got = results(job.out)
    errors = {r["line"]: r["error"] for r in got if "error" in r}
    for n, (_, why) in enumerate(bad, 1):
        assert why in errors[n], (n, errors.get(n))
    answered = {r["id"]: r for r in got if "error" not in r}
    assert set(answered) == {"k", "ok"} and len(answered["k"]["tokens"]) == 3
    before = job.out.read_text()
    capsys.readouterr()
    assert run(job) == 0  # a rerun: everything answered, nothing lost or repeated
    assert job.out.read_text() == before
    assert "resuming: 10 of 10 done" in capsys.readouterr().err


def test_a_prompt_too_big_for_the_context_is_refused_before_it_is_tokenized(
        job, monkeypatch):
    """No token is longer than the vocabulary's longest, so more text than the
    context times that cannot fit: such a line is an error line without the
    tokenizer (and its memory) ever seeing its 4 MB, and the job goes on."""
    from deltafin_mlx.tokenizer.text_bound import text_bytes

    huge = "word " * 800_000
    write_lines(job.src, {"id": "huge", "prompt": huge},
                {"id": "huge-chat", "messages": [{"role": "user", "content": huge}]},
                {"id": "ok", "prompt": "Hello"})
    seen = []  # bytes of text that reached the chat template and tokenizer
    from deltafin_mlx.generation import engine

    real = engine.prompt_tokens

    def spy(request, tokenizer, **kw):
        seen.append(text_bytes(request.messages or request.prompt))
        return real(request, tokenizer, **kw)

    monkeypatch.setattr(engine, "prompt_tokens", spy)
    assert main(["batch", job.model, str(job.src), "-o", str(job.out), "-n", "3",
                 "--no-progress", "--context", "256"]) == 3  # some error lines
    got = {r["id"]: r for r in results(job.out)}
    for rid in ("huge", "huge-chat"):
        assert "bytes of text, more than the planned context of 256 tokens" in got[rid]["error"]
    assert "tokens" in got["ok"] and max(seen or [0]) < 1000


def test_a_request_that_fails_inside_the_decode_loop_is_an_error_line_only(
        job, tmp_path, monkeypatch):
    specs = [{"id": i, "prompt": f"Question {i}", "temp": 0.7, "seed": 10 + i} for i in range(5)]
    write_lines(job.src, *specs)
    clean = tmp_path / "clean.jsonl"
    assert run(job, "--batch-size", "4", out=clean) == 0
    from deltafin_mlx.generation.sampling import KeyedSampler

    sample = KeyedSampler.__call__

    def failing(self, logprobs):
        if self.seed == 12:
            raise IndexError("a sampler that fails for this request only")
        return sample(self, logprobs)

    monkeypatch.setattr(KeyedSampler, "__call__", failing)
    assert run(job, "--batch-size", "4") == 3  # one error line
    got = {r["id"]: r for r in results(job.out)}
    assert "failed while decoding (IndexError" in got[2]["error"]
    want = {r["id"]: r["tokens"] for r in results(clean)}
    assert {i: r["tokens"] for i, r in got.items() if i != 2} == {
        i: t for i, t in want.items() if i != 2}


# --- what a user sees -----------------------------------------------------------------


def test_openai_keys_and_the_openai_batch_format_are_accepted(job, tmp_path):
    own = {"prompt": "Hello", "temp": 0.8, "top_p": 0.9, "seed": 5, "max_tokens": 4,
           "stop": ["zzzz"]}
    openai_keys = {"prompt": "Hello", "temperature": 0.8, "top_p": 0.9, "seed": 5,
                   "max_tokens": 4, "stop": "zzzz"}
    batch_line = {"custom_id": "req-1", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "whatever", "prompt": "Hello", "temperature": 0.8,
                           "top_p": 0.9, "seed": 5, "max_completion_tokens": 4,
                           "stop": ["zzzz"]}}
    write_lines(job.src, {"id": "own", **own}, {"id": "oa", **openai_keys}, batch_line,
                {"id": "both", "prompt": "a", "temp": 1, "temperature": 1},
                {"custom_id": "c2", "url": "/v1/embeddings", "body": {"input": "a"}})
    assert run(job) == 3  # two error lines
    got = {r["id"]: r for r in results(job.out)}
    assert got["own"]["tokens"] == got["oa"]["tokens"] == got["req-1"]["tokens"]
    assert len(got["own"]["tokens"]) == 4 and got["req-1"]["custom_id"] == "req-1"
    assert "both 'temperature' and its alias 'temp'" in got["both"]["error"]
    assert '"url" must be one of' in got["c2"]["error"] and got["c2"]["custom_id"] == "c2"


def test_a_resume_is_announced(job, capsys):
    job.out.write_text(json.dumps({"id": "a", "text": "", "tokens": []}) + "\n")
    assert run(job) == 0
    err = capsys.readouterr().err
    assert "[batch] resuming: 1 of 2 done" in err and "1 answered now" in err


def test_ctrl_c_says_how_to_resume_without_a_traceback(job, monkeypatch, capsys):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(batch, "run_job", interrupted)
    assert run(job) == 130
    assert one_line(capsys.readouterr().err) == (
        "deltafin-run: interrupted: rerun the same command to resume")
    monkeypatch.undo()
    assert run(job) == 0  # the lock was released


def test_progress_shows_the_prefill_of_the_prompts_being_read(capsys):
    progress = Progress(total=4, skipped=0, show=True, outcome=Outcome("batch"))
    progress.layer(3, 60)  # the engine, inside the first step, before any prompt reports
    assert "[batch] 0/4 requests (0 errors), prefilling (MoE layer 3/60)" in (
        capsys.readouterr().err)
    progress.last = float("-inf")  # as if half a second had passed (redraws are rate-limited)
    prompt = SimpleNamespace(uid=0, progress=(96, 300))
    progress.step(0, [prompt, SimpleNamespace(uid=1, progress=(0, 200))])
    err = capsys.readouterr().err
    assert "[batch] 0/4 requests (0 errors), prefill 96/500 tokens of 2 prompts" in err
