"""Every file a job reads by name — perplexity's text, a KL reference, an output's
options record (OUT.options.json) — is a regular file of a bounded size: a FIFO
(which would block the read forever), a device (/dev/zero would never end it) or
a file too large is refused in one line, unread, and an options record must be
a JSON object. Every error line is bounded in size, whatever the file quotes."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from deltafin_mlx.cli.main import main

from helpers import one_line_error


def deltafin_run(*args):
    """The command as a process of its own, with a timeout: a read that blocks fails
    the test instead of hanging the test run."""
    return subprocess.run([sys.executable, "-m", "deltafin_mlx.cli.main", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)  # no writer: a read would block forever
    return path


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("the experts stream from disk while the trunk stays in memory\n" * 20)
    return path


@pytest.mark.parametrize("where", ["text", "reference"])
@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_a_fifo_or_device_as_the_text_or_the_reference_is_refused_without_blocking(
        converted, text, fifo, where, special):
    path = fifo if special == "fifo" else special
    kind = "a FIFO" if special == "fifo" else "a character device"
    args = [path] if where == "text" else [text, "--kl-divergence", path]
    out = deltafin_run("perplexity", converted("qwen3_moe"), *args, "--budget", "200MB")
    what = "text" if where == "text" else "KL reference"
    assert f"{path}: the {what} must be a regular file (this is {kind})" in one_line_error(out)


def test_a_text_too_large_is_refused_unread(converted, tmp_path, capsys):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(65 << 20)  # sparse: nothing to write, nothing read
    assert main(["perplexity", str(converted("qwen3_moe")), str(big), "--budget", "200MB"]) == 1
    assert f"{big}: the text is 68.2 MB, more than the 67.1 MB it may have" in \
        one_error_line(capsys)


@pytest.fixture(scope="module")
def started(converted, tmp_path_factory):
    """A score job's output, one line answered: a rerun reads its options record."""
    root = tmp_path_factory.mktemp("started")
    src, out = root / "in.jsonl", root / "out.jsonl"
    src.write_text(json.dumps({"id": 1, "text": "the experts"}) + "\n")
    assert main(["score", str(converted("qwen3_moe")), str(src), "-o", str(out),
                 "--budget", "200MB"]) == 0
    return converted("qwen3_moe"), src, out


def rerun_with_record(started, tmp_path):
    """The started job copied to `tmp_path`: (the command to resume it, its record's path)."""
    model, src, out = started
    shutil.copy(out, tmp_path / out.name)
    args = ["score", str(model), str(src), "-o", str(tmp_path / out.name), "--budget", "200MB"]
    return args, tmp_path / f"{out.name}.options.json"


@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_an_options_record_that_is_a_fifo_or_device_is_refused_without_blocking(
        started, tmp_path, special):
    args, record = rerun_with_record(started, tmp_path)
    if special == "fifo":
        os.mkfifo(record)
    else:
        record.symlink_to(special)
    kind = "a FIFO" if special == "fifo" else "a character device"
    out = deltafin_run(*args)
    assert f"{record}: the options record must be a regular file (this is {kind})" in \
        one_line_error(out)


@pytest.mark.parametrize("content, says", [
    ("[1, 2]", "(a JSON list, not an object)"),
    ("3", "(a JSON int, not an object)"),
    ('"--top-logprobs"', "(a JSON str, not an object)"),
    ("[" * 100_000 + "]" * 100_000, "(maximum recursion depth exceeded"),
], ids=["a list", "a number", "a string", "nested deep"])
def test_an_options_record_that_is_not_an_object_is_refused_in_one_line(started, tmp_path,
                                                                       capsys, content, says):
    args, record = rerun_with_record(started, tmp_path)
    record.write_text(content)
    assert main(args) == 1
    line = one_error_line(capsys)
    assert f"{record}: not the options this output was written with {says}" in line
    assert "delete it to resume without checking them" in line


def test_an_options_record_too_large_is_refused_unread(started, tmp_path, capsys):
    args, record = rerun_with_record(started, tmp_path)
    record.write_text(json.dumps({"--top-logprobs": "x" * 3_000_000}))
    assert main(args) == 1
    assert f"{record}: the options record is 3.00 MB, more than the 1.05 MB it may have" in \
        one_error_line(capsys)


def test_an_error_line_quoting_a_recorded_value_is_bounded(started, tmp_path, capsys):
    args, record = rerun_with_record(started, tmp_path)
    record.write_text(json.dumps({"--top-logprobs": "x" * 900_000}))  # within the record's bound
    assert main(args) == 1
    line = one_error_line(capsys)
    assert "was written with" in line and "--top-logprobs xxxx" in line
    assert line.endswith("… (cut short)") and len(line.encode()) < 2_200
