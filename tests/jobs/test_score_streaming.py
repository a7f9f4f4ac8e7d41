"""A score job's input is read, bounded and prepared a window at a time: texts are
tokenized as they are read, until a window holds WINDOW_PASSES passes of tokens,
and that window is scored (its results written as its passes finish) before the
next line is read. So what a job holds of its input follows the budget (the pass
size), not the corpus: a window's tokens, the ids seen, and one line."""

import json

from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.jobs.batch_lines import iter_requests
from deltafin_mlx.jobs.score import WINDOW_PASSES, ScoreOptions, Sizing, run_job, windows
from deltafin_mlx.model.modules import model_vocab


def test_texts_are_read_a_window_at_a_time(converted):
    model, tok = load(converted("kimi_k3"), "40MB", warm_start=False)
    sizing = Sizing(model)
    bound = WINDOW_PASSES * sizing.capacity(sizing.step)
    read = []

    def lines():
        for i in range(4 * bound // 40 + 3):
            read.append(i)
            yield json.dumps({"id": i, "tokens": list(range(1, 41))})

    seen, held = 0, []
    for items, errors in windows(iter_requests(lines(), spec_of=dict), tok, ScoreOptions(),
                                 sizing, model_vocab(model)):
        assert not errors
        tokens = sum(len(it.tokens) for it in items)
        assert tokens < bound + 40  # a window ends with the text that fills it
        assert len(read) == seen + len(items)  # nothing read past the window
        seen += len(items)
        held.append(len(items))
    assert seen == len(read) and len(held) >= 4
    runtime(model).close()


def test_a_job_of_many_windows_scores_every_line_once(converted, tmp_path):
    model, tok = load(converted("kimi_k3"), "40MB", warm_start=False)
    sizing = Sizing(model)
    n = 2 * WINDOW_PASSES * sizing.capacity(sizing.step) // 20 + 1
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "tokens": list(range(1, 21))}) + "\n"
                           for i in range(n)) + '{"id": "bad", "text": 3}\n')
    s = run_job(model, tok, src, tmp_path / "out.jsonl", ScoreOptions(), show_progress=False)
    assert s["texts"] == n + 1 and s["scored_texts"] == n and s["errors"] == 1, s
    ids = [json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(map(str, ids)) == sorted(map(str, list(range(n)) + ["bad"]))
    again = run_job(model, tok, src, tmp_path / "out.jsonl", ScoreOptions(), show_progress=False)
    assert again["skipped"] == n + 1 and again["scored_texts"] == 0
    runtime(model).close()
