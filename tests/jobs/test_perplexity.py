"""`deltafin-run perplexity MODEL FILE`: the text's tokens in windows as
llama-perplexity cuts them (side by side, second half scored; --stride S: a window
every S tokens scoring its last S; --stride C: mlx_lm.perplexity's), each window
scored as the same tokens scored through a JSONL `score` job are (within 1e-4),
packed many per pass, and every pass reads each routed expert at most once."""

import json
import math

import numpy as np
import pytest

from deltafin_mlx.cli.main import main
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.jobs.perplexity import PerplexityOptions, Windows, perplexity

WORDS = ("the experts stream from disk while the trunk stays in memory and every "
         "token routes to a few of them 12 34 def route(x): return x").split()


def corpus(words=260, seed=0):
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, size=13)) for _ in range(words // 13)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "corpus.txt"
    path.write_text(corpus())
    return path


def run_json(capsys, *argv):
    assert main([str(a) for a in argv]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


@pytest.mark.parametrize("stride, first", [(None, 24), (16, 32), (48, 1)],
                         ids=["llama (second half)", "stride 16", "stride = context (mlx-lm)"])
def test_perplexity_equals_the_same_windows_scored_through_jsonl(converted, text_file, tmp_path,
                                                                capsys, stride, first):
    model_dir = converted("qwen3_moe")
    extra = [] if stride is None else ["--stride", stride]
    s, err = run_json(capsys, "perplexity", model_dir, text_file, "-c", 48, *extra, "--json",
                      "--budget", "200MB")
    _, tok = load(model_dir, "200MB", warm_start=False)
    tokens = tok.encode(text_file.read_text())
    step = stride or 48
    starts = list(range(0, len(tokens) - 48 + 1, step))
    assert s["windows"] == len(starts) > 3 and s["first_scored"] == first
    assert s["context"] == 48 and s["stride"] == stride
    assert s["scored_tokens"] == len(starts) * (48 - first)
    assert s["tokens"] == starts[-1] + 48 and s["text_tokens"] == len(tokens)
    windows = tmp_path / "windows.jsonl"
    windows.write_text("".join(json.dumps({"id": i, "tokens": tokens[a : a + 48]}) + "\n"
                               for i, a in enumerate(starts)))
    assert main(["score", str(model_dir), str(windows), "-o", str(tmp_path / "w.out.jsonl"),
                 "--budget", "200MB"]) == 0
    capsys.readouterr()
    lines = [json.loads(l) for l in (tmp_path / "w.out.jsonl").read_text().splitlines()]
    nll = np.array([-v for l in sorted(lines, key=lambda l: l["id"])
                    for v in l["token_logprobs"][first:]], np.float64)
    assert nll.size == s["scored_tokens"]
    assert abs(s["mean_nll"] - nll.mean()) < 1e-4
    assert abs(s["perplexity"] - math.exp(nll.mean())) < 1e-4 * s["perplexity"]
    se = math.exp(nll.mean()) * nll.std(ddof=1) / math.sqrt(nll.size)
    assert abs(s["perplexity_se"] - se) < 1e-4 * s["perplexity"]
    last = err.strip().splitlines()[-1]
    rule = "side by side, second half scored" if stride is None else f"stride {stride}"
    assert (f"{len(starts)} windows of 48 tokens ({rule}; scored from position {first}), "
            f"{s['tokens']} of the text's {len(tokens)} tokens, {s['scored_tokens']} scored: "
            f"perplexity {s['perplexity']:.4f} ± {s['perplexity_se']:.4f}") in last


def test_each_pass_reads_each_routed_expert_at_most_once(converted, text_file):
    """Streaming (a cache of a few experts), the windows are packed into passes
    of several windows, and no pass reads more than the experts its tokens route
    to, each once."""
    model, tok = load(converted("kimi_k3"), "40MB", cache_slots=6, warm_start=False)
    s = perplexity(model, tok, text_file.read_text(),
                   PerplexityOptions(Windows(32), max_pass_tokens=96))
    assert s["windows"] >= 6 and s["sweeps"] == math.ceil(s["windows"] / 3)
    for read, union in s["passes"]:
        assert 0 < read <= union
    runtime(model).close()


def test_a_text_shorter_than_a_window_or_not_text_is_refused(converted, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("the experts\n")
    assert main(["perplexity", str(converted("qwen3_moe")), str(short), "--budget",
                 "200MB"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "fewer than one window of 512 (-c)" in err[0]
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x00\xff\xfe" * 10)
    assert main(["perplexity", str(converted("qwen3_moe")), str(binary)]) == 1
    assert "not UTF-8 text" in capsys.readouterr().err
    assert main(["perplexity", str(converted("qwen3_moe")), str(short), "-c", "8",
                 "--stride", "9"]) == 1
    assert "--stride must be between 1 and the context, 8" in capsys.readouterr().err


def test_the_plan_reserves_the_context_the_windows_need(converted, tmp_path, capsys,
                                                        monkeypatch):
    """512-token windows (the default -c) are planned with 512 tokens of context, not
    a run's default 4,096 (which raises the floor the budget must clear)."""
    import deltafin_mlx.cli.perplexity as cli_perplexity

    planned, load_model = [], cli_perplexity.load_model

    def load_and_note(*args, **kwargs):
        model, tokenizer = load_model(*args, **kwargs)
        planned.append(runtime(model).plan.context)
        return model, tokenizer

    monkeypatch.setattr(cli_perplexity, "load_model", load_and_note)
    text = tmp_path / "long.txt"
    text.write_text(corpus(words=1400))
    summary, _ = run_json(capsys, "perplexity", converted("qwen3_moe"), text, "--json",
                          "--chunks", "1")
    assert summary["context"] == 512 and planned == [512]
    run_json(capsys, "perplexity", converted("qwen3_moe"), text, "--json", "-c", "64",
             "--chunks", "1")
    assert planned[1] == 64
