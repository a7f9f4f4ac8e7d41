"""`deltafin-run perplexity MODEL FILE`: the text's tokens in windows as
llama-perplexity cuts them (side by side, second half scored; --stride S: a window
every S tokens scoring its last S; --stride C: mlx_lm.perplexity's), each window
scored as the same tokens scored through a JSONL `score` job are (within 1e-4),
packed many per pass, and every pass reads each routed expert at most once. With
-o OUT each window's scores are kept as its pass finishes: a Ctrl-C prints the
estimate so far and the same command resumes, to the value of a run never
interrupted."""

import json
import math
import signal
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from deltafin_mlx.cli.main import main
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.jobs.perplexity import PerplexityOptions, perplexity
from deltafin_mlx.jobs.text_windows import Windows

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


# The command in a process of its own, held after its first pass until a signal
# comes (so the test's SIGINT lands between passes however fast they are).
HELD_AFTER_FIRST_PASS = """
import signal, sys
import deltafin_mlx.jobs.perplexity as job
from deltafin_mlx.cli.main import main

real = job.iter_passes

def held(*args, **kwargs):
    for scored in real(*args, **kwargs):
        yield scored
        signal.pause()

job.iter_passes = held
sys.argv = ["deltafin-run", *sys.argv[1:]]
sys.exit(main())
"""


def test_ctrl_c_keeps_the_windows_scored_and_a_rerun_resumes_to_the_same_value(
        converted, text_file, tmp_path, capsys):
    """SIGINT after the first window's progress line: the command prints the
    estimate so far and exits 130, OUT keeps that window (the reference is not
    written yet); the same command again scores only the other windows and ends
    with the perplexity and the reference of a run never interrupted, exactly."""
    model_dir = converted("qwen3_moe")
    out, ref = tmp_path / "windows.jsonl", tmp_path / "base.kld.safetensors"
    argv = ["perplexity", str(model_dir), str(text_file), "-c", "48", "--pass-tokens", "48",
            "--budget", "200MB", "-o", str(out), "--kl-divergence-base", str(ref)]
    proc = subprocess.Popen([sys.executable, "-c", HELD_AFTER_FIRST_PASS, *argv],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith("[perplexity] 1/"):
            break
    assert seen and seen[-1].startswith("[perplexity] 1/"), seen
    assert ", perplexity " in seen[-1]  # the running value
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, rest
    lines = [line for line in rest.splitlines() if line.strip()]
    assert "Traceback" not in rest
    estimate = [line for line in lines if "interrupted after" in line]
    assert len(estimate) == 1 and "interrupted after 1 of them: perplexity " in estimate[0]
    assert "so far" in estimate[0]
    assert lines[-2] == (f"[deltafin] {out} keeps the windows scored: rerun the same command "
                         "to resume")
    assert lines[-1] == "deltafin-run: interrupted"
    assert len(out.read_text().splitlines()) == 1 and not ref.exists()

    s, _ = run_json(capsys, *argv, "--json", "--no-progress")
    assert s["windows_resumed"] == 1 and s["sweeps"] == s["windows"] - 1 > 2
    assert s["windows_done"] == s["windows"] and not s["interrupted"]
    once_out, once_ref = tmp_path / "once.jsonl", tmp_path / "once.kld.safetensors"
    once, _ = run_json(capsys, *argv[:-4], "-o", once_out, "--kl-divergence-base", once_ref,
                       "--json", "--no-progress")
    assert once["windows_resumed"] == 0 and once["sweeps"] == once["windows"]
    assert s["perplexity"] == once["perplexity"] and s["mean_nll"] == once["mean_nll"]
    assert s["perplexity_se"] == once["perplexity_se"]
    a, b = load_file(str(ref)), load_file(str(once_ref))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert out.read_text() == once_out.read_text()  # the same windows, in order


def test_a_finished_output_resumes_with_nothing_to_score_and_other_options_are_refused(
        converted, text_file, tmp_path, capsys):
    model_dir = converted("qwen3_moe")
    out = tmp_path / "windows.jsonl"
    argv = ["perplexity", model_dir, text_file, "-c", 48, "--budget", "200MB", "-o", out,
            "--json", "--no-progress"]
    first, _ = run_json(capsys, *argv)
    again, _ = run_json(capsys, *argv)
    assert again["windows_resumed"] == again["windows"] and again["sweeps"] == 0
    assert again["perplexity"] == first["perplexity"]
    assert main([str(a) for a in argv[:3]] + ["-c", "32", "--budget", "200MB", "-o",
                                               str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{out} was written with -c 48; this run asks for -c 32" in err[0]
    assert main([str(a) for a in argv] + ["--activation-dtype", "model"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and (f"{out} was written with no --activation-dtype; this run asks "
                              "for --activation-dtype model") in err[0]
    assert main([str(a) for a in argv[:3]] + ["-c", "48", "-o", str(text_file)]) == 1
    assert "this is the input file" in capsys.readouterr().err
    ref = tmp_path / "new.kld.safetensors"
    assert main([str(a) for a in argv[:3]] + ["-o", str(ref), "--kl-divergence-base",
                                               str(ref)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "deltafin-run: error: -o and --kl-divergence-base name one file: the windows' scores "
        "and the reference go to two"]


def test_stdout_as_the_output_is_refused_in_one_line(converted, text_file, tmp_path, capsys,
                                                     monkeypatch):
    """-o keeps the windows for a rerun to resume from, which stdout cannot: `-o -`
    is refused before the model loads, and leaves no `-.options.json` behind."""
    monkeypatch.chdir(tmp_path)
    assert main(["perplexity", str(converted("qwen3_moe")), str(text_file), "-c", "48",
                 "--budget", "200MB", "-o", "-"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("deltafin-run: error: -o -: the windows' scores go to a file")
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_is_not_windows_gets_no_options_record(converted, text_file, tmp_path,
                                                           capsys):
    """An existing file of other lines given as -o is refused before anything is
    written beside it: the options are recorded only once its lines read as windows."""
    notes = tmp_path / "notes.md"
    notes.write_text("# notes\nnot a window\n")
    assert main(["perplexity", str(converted("qwen3_moe")), str(text_file), "-c", "48",
                 "--budget", "200MB", "-o", str(notes), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert f"{notes}: line 1 is not a batch result" in err[-1]
    assert notes.read_text() == "# notes\nnot a window\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md"]


def test_an_output_whose_window_lines_would_be_too_long_is_refused_before_scoring(
        converted, text_file, tmp_path, capsys, monkeypatch):
    """-o keeps each window's top K in one JSONL line: a K that would make a line
    longer than a line may be is refused in one line before any pass runs."""
    import deltafin_mlx.jobs.perplexity as job
    from deltafin_mlx.units import human_bytes

    passes = []
    monkeypatch.setattr(job, "LINE_MAX_BYTES", 1 << 18)  # 24 x 512 pairs: up to ~0.5 MB
    real = job.iter_passes

    def counted(*args, **kwargs):
        passes.append(args)
        yield from real(*args, **kwargs)

    monkeypatch.setattr(job, "iter_passes", counted)
    argv = ["perplexity", str(converted("qwen3_moe")), str(text_file), "-c", "48",
            "--budget", "200MB", "-o", str(tmp_path / "w.jsonl"), "--kl-divergence-base",
            str(tmp_path / "ref.safetensors")]
    assert main(argv + ["--kl-top-k", "1000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("with --kl-top-k 512: a window's line would hold 24 x 512 ids and "
                            f"log-probabilities, more than the {human_bytes(1 << 18)} a line "
                            "may have; give a smaller --kl-top-k or -c, or leave -o out")
    assert passes == [] and not (tmp_path / "w.jsonl").exists()
    monkeypatch.setattr(job, "LINE_MAX_BYTES", 1 << 26)
    assert main(argv + ["--kl-top-k", "1000", "--chunks", "1"]) == 0
    assert len(passes) == 1


def test_ctrl_c_without_an_output_prints_the_estimate_and_says_nothing_was_kept(
        converted, text_file, capsys, monkeypatch):
    import deltafin_mlx.jobs.perplexity as job

    real = job.iter_passes

    def interrupted_after_the_first_pass(*args, **kwargs):
        passes = real(*args, **kwargs)
        yield next(passes)
        raise KeyboardInterrupt

    monkeypatch.setattr(job, "iter_passes", interrupted_after_the_first_pass)
    assert main(["perplexity", str(converted("qwen3_moe")), str(text_file), "-c", "48",
                 "--pass-tokens", "96", "--budget", "200MB", "--json", "--no-progress"]) == 130
    out, err = capsys.readouterr()
    s = json.loads(out)
    assert s["interrupted"] and s["windows_done"] == 2 < s["windows"]
    assert s["scored_tokens"] == 48 and s["perplexity"] > 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert (f"interrupted after 2 of them: perplexity {s['perplexity']:.4f} ± "
            f"{s['perplexity_se']:.4f}") in lines[-3]
    assert lines[-2] == ("[deltafin] nothing kept: with -o OUT each window's scores are kept "
                         "and a rerun resumes")
    assert lines[-1] == "deltafin-run: interrupted"


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
