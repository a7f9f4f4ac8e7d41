"""A job's options are part of its output: recorded beside it (OUT.options.json)
when it starts, checked when it resumes. A rerun of batch or score with options
that change what the results mean is refused in one line naming them, before any
model loads and without touching the output; the same options resume; an output
written before options were recorded resumes unchecked and says so."""

import json
import shutil

import pytest

from deltafin_mlx.cli.main import main

BATCH = ["-n", "3", "--top-logprobs", "2", "--temp", "0"]
SCORE = ["--top-logprobs", "3", "--format", "safetensors"]


@pytest.fixture(scope="module")
def started(converted, tmp_path_factory):
    """A batch and a score job interrupted after their first line, as a rerun finds
    them: one line answered, a second line still to do."""
    root = tmp_path_factory.mktemp("started")
    model = str(converted("kimi_k3"))
    jobs = {}
    for cmd, line, more, opts in (
            ("batch", {"id": 1, "prompt": "the experts"}, {"id": 2, "prompt": "stream"}, BATCH),
            ("score", {"id": 1, "text": "the experts"}, {"id": 2, "text": "stream"}, SCORE)):
        src, out = root / f"{cmd}.in.jsonl", root / f"{cmd}.out.jsonl"
        src.write_text(json.dumps(line) + "\n")
        assert main([cmd, model, str(src), "-o", str(out), "--budget", "200MB", *opts]) == 0
        src.write_text(json.dumps(line) + "\n" + json.dumps(more) + "\n")
        jobs[cmd] = (model, src, out)
    return jobs


def copy_job(started, cmd, tmp_path):
    model, src, out = started[cmd]
    for p in out.parent.glob(f"{out.name}*"):  # the output and its record
        shutil.copy(p, tmp_path / p.name)
    for p in out.parent.glob(f"{out.stem}.*.safetensors"):
        shutil.copy(p, tmp_path / p.name)
    return model, src, tmp_path / out.name


@pytest.mark.parametrize("cmd, changed, named", [
    ("batch", ["-n", "4", "--top-logprobs", "2"], ("-n 3", "-n 4")),
    ("batch", ["-n", "3", "--top-logprobs", "2", "--temp", "0.7"], ("--temp 0.0", "--temp 0.7")),
    ("batch", [*BATCH, "--no-think"], ("no --no-think", "--no-think")),
    ("batch", ["-n", "3", "--top-logprobs", "8"], ("--top-logprobs 2", "--top-logprobs 8")),
    ("score", ["--top-logprobs", "8", "--format", "safetensors"],
     ("--top-logprobs 3", "--top-logprobs 8")),
    ("score", ["--top-logprobs", "3"], ("--format safetensors", "--format jsonl")),
    ("score", [*SCORE, "--no-think"], ("no --no-think", "--no-think")),
    ("batch", [*BATCH, "--activation-dtype", "model"],
     ("no --activation-dtype", "--activation-dtype model")),
    ("score", [*SCORE, "--activation-dtype", "model"],
     ("no --activation-dtype", "--activation-dtype model")),
], ids=["batch -n", "batch --temp", "batch --no-think", "batch --top-logprobs",
        "score --top-logprobs", "score --format", "score --no-think",
        "batch --activation-dtype", "score --activation-dtype"])
def test_resuming_with_other_options_is_refused_naming_them(started, tmp_path, capsys, cmd,
                                                            changed, named):
    model, src, out = copy_job(started, cmd, tmp_path)
    before = out.read_bytes()
    rc = main([cmd, model, str(src), "-o", str(out), "--budget", "200MB", *changed])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    was, now = named
    assert f"{out} was written with {was}; this run asks for {now}" in err[0]
    assert "rerun with the same options" in err[0] and "Traceback" not in err[0]
    assert out.read_bytes() == before


@pytest.mark.parametrize("cmd, opts", [("batch", BATCH), ("score", SCORE)])
def test_the_same_options_resume(started, tmp_path, capsys, cmd, opts):
    model, src, out = copy_job(started, cmd, tmp_path)
    # the same options, in another order, with another budget
    pairs = [opts[i:i + 2] for i in range(0, len(opts), 2)]
    reordered = [x for pair in reversed(pairs) for x in pair]
    assert main([cmd, model, str(src), "-o", str(out), "--budget", "300MB", *reordered]) == 0
    assert sorted(json.loads(l)["id"] for l in out.read_text().splitlines()) == [1, 2]


@pytest.mark.parametrize("cmd, opts, flag, value", [
    ("batch", ["-n", "2"], "-n", 2),
    ("score", ["--top-logprobs", "3", "--format", "safetensors"], "--top-logprobs", 3)])
def test_an_output_without_a_record_resumes_unchecked_and_says_so(started, tmp_path, capsys,
                                                                   cmd, opts, flag, value):
    model, src, out = copy_job(started, cmd, tmp_path)
    record = tmp_path / f"{out.name}.options.json"
    record.unlink()  # as every output written before records were kept
    assert main([cmd, model, str(src), "-o", str(out), "--budget", "200MB", *opts]) == 0
    err = capsys.readouterr().err
    assert err.count(f"{out} records no options (written before they were recorded)") == 1
    assert json.loads(record.read_text())[flag] == value  # what that run asked for
    assert sorted(json.loads(l)["id"] for l in out.read_text().splitlines()) == [1, 2]


def test_stdout_as_the_output_gets_no_record(tmp_path, monkeypatch):
    """`-o -` has no resume, so nothing is recorded for it (no `-.options.json`)."""
    from deltafin_mlx.jobs.job_options import check_options

    monkeypatch.chdir(tmp_path)
    assert check_options("-", {"--top-logprobs": 3}, started=False) is None
    assert list(tmp_path.iterdir()) == []
