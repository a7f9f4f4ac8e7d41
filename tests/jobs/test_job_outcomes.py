"""How a batch or score job ends: a job whose every line fails exits 1 with a hint
about the input (a plain text file given to `score` points at `perplexity`); a
job with some error lines says how many on its last line and exits 3; the summary
of a job that scored no token reports no perplexity."""

import json

from deltafin_mlx.cli.main import main
from deltafin_mlx.jobs.batch import summary_line as batch_summary


def last_line(capsys):
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_score_of_a_plain_text_file_fails_and_points_at_perplexity(converted, tmp_path,
                                                                    capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The experts stream from disk.\nThe trunk stays in memory.\n"
                      "Every token routes to a few experts.\n")
    rc = main(["score", str(converted("qwen3_moe")), str(corpus), "-o",
               str(tmp_path / "y.jsonl"), "--json", "--budget", "200MB"])
    out, err = capsys.readouterr()
    assert rc == 1
    summary = json.loads(out)
    assert summary["errors"] == 3 and summary["scored_tokens"] == 0
    assert summary["perplexity"] is None and summary["mean_nll"] is None
    assert "no perplexity" in err and "perplexity 1.000" not in err
    last = err.strip().splitlines()[-1]
    assert "every line is not JSON: score takes JSONL" in last
    assert "deltafin-run perplexity MODEL FILE" in last


def test_batch_whose_every_line_fails_exits_1(converted, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Why is the sky blue?\nWrite a haiku.\n")
    rc = main(["batch", str(converted("qwen3_moe")), str(prompts), "-o",
               str(tmp_path / "a.jsonl"), "-n", "2", "--raw"])
    assert rc == 1
    assert "every line is not JSON: batch takes JSONL" in last_line(capsys)
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text('{"id": 1, "question": "a"}\n')
    rc = main(["batch", str(converted("qwen3_moe")), str(unknown), "-o",
               str(tmp_path / "b.jsonl"), "-n", "2", "--raw"])
    assert rc == 1
    last = last_line(capsys)
    assert "every line failed (1 error lines in" in last and "question: is not a field" in last


def test_jobs_with_some_error_lines_exit_3_and_say_how_many(converted, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "the experts"}\nnot json\n'
                   '{"id": 3, "prompt": "stream from disk"}\n')
    out = tmp_path / "out.jsonl"
    rc = main(["batch", str(converted("qwen3_moe")), str(src), "-o", str(out), "-n", "2",
               "--raw"])
    assert rc == 3
    assert last_line(capsys).endswith(f"1 of 3 lines failed (error lines in {out}); "
                                      "exit status 3")
    # the rerun has nothing left to answer: the error line answers its line
    assert main(["batch", str(converted("qwen3_moe")), str(src), "-o", str(out), "-n", "2",
                 "--raw"]) == 0
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"id": 1, "text": "the experts stream"}\n{"id": 2, "txt": "x"}\n')
    rc = main(["score", str(converted("qwen3_moe")), str(texts), "-o",
               str(tmp_path / "s.jsonl"), "--budget", "200MB"])
    assert rc == 3
    assert "1 of 2 lines failed" in last_line(capsys)


def test_the_batch_summary_says_which_rate_is_which():
    line = batch_summary({"requests": 2, "answered": 2, "errors": 0, "skipped": 0, "tokens": 8,
                          "seconds": 2.0, "tokens_per_second": 4.0, "batch_size": 2,
                          "expert_bytes_read": 0})
    assert "4.00 tok/s aggregate" in line and "stats.tokens_per_second is its own" in line
