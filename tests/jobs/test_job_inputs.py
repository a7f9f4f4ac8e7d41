"""Jobs read their input from stdin."""

import json

from helpers import run_tool


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
