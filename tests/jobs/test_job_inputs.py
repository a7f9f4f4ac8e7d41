"""Jobs read their input from stdin; a line too long for the model, or a stdin the
temporary folder cannot hold, is one clear line."""

import json
import resource
import subprocess
import tempfile

import pytest

from helpers import BIN, only_stderr_line, run_measured, run_tool


def test_score_and_batch_read_their_input_from_stdin(converted, tmp_path):
    model = converted("kimi_k3")
    lines = "".join(json.dumps({"id": i, "text": f"Hello number {i}"}) + "\n" for i in range(2))
    out = run_tool("deltafin-run", "score", model, "-", "-o", tmp_path / "scores.jsonl", stdin=lines)
    assert out.returncode == 0, out.stderr
    assert [json.loads(x)["id"] for x in (tmp_path / "scores.jsonl").read_text().splitlines()
            if "id" in json.loads(x)] == [0, 1]
    lines = "".join(json.dumps({"id": i, "prompt": f"Hi {i}"}) + "\n" for i in range(2))
    out = run_tool("deltafin-run", "batch", model, "-", "-o", tmp_path / "answers.jsonl", "-n", "2",
              stdin=lines)
    assert out.returncode == 0, out.stderr
    answers = [json.loads(x) for x in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert sorted(a["id"] for a in answers if "id" in a) == [0, 1]


def test_a_score_line_longer_than_the_models_context_holds_is_an_error_line_never_held(
        converted, tmp_path):
    """The mixtral fixture's context holds about 1.4 MB of JSON text; a 5 MB line is
    answered by an error line, and the job's memory never holds it."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 1, "text": "hello world " * 420_000}) + "\n"
                   + json.dumps({"id": 2, "text": "hello"}) + "\n")
    code, err, peak, _ = run_measured(["score", converted("mixtral"), src, "-o",
                                       tmp_path / "out.jsonl", "--no-progress"])
    assert code == 3, err
    results = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert results[0] == {"id": None, "line": 1, "error": "line 1: longer than a request may be"}
    assert results[1]["id"] == 2 and results[1]["scored_tokens"] > 0
    assert peak < 200 << 20, f"{peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("command", ["score", "batch"])
def test_a_stdin_the_temporary_folder_cannot_hold_is_one_line_naming_it(converted, tmp_path,
                                                                      command):
    def small_files():  # as a full temporary folder would (the output's disk has room)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))

    p = subprocess.run([str(BIN / "deltafin-run"), command, converted("kimi_k3"), "-", "-o",
                        tmp_path / "out.jsonl"], input=bytes(16 << 20), capture_output=True,
                       timeout=300, preexec_fn=small_files)
    assert p.returncode == 1
    line = only_stderr_line(p.stderr.decode())
    assert f"stdin: cannot keep a copy of the input in {tempfile.gettempdir()}" in line
    assert "disk full" not in line
