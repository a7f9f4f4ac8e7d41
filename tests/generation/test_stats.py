"""The stats report the prompt's prefill and the decode apart (time to first
token, prefill tok/s, decode tok/s), in the stats line, --json and bench; a
one-shot run stopped with Ctrl-C still reports what it did."""

import json
import signal
import subprocess
import sys
import time

from deltafin_mlx.generation.stream import RunStats


def run(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "deltafin_mlx.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_decode_rate_excludes_the_prefill():
    # 4 tokens in 4.79 s of which 4.73 s to the first token: decode ran at 50 tok/s.
    s = RunStats(prompt_tokens=300, tokens=4, seconds=4.79, first_token_seconds=4.73)
    assert round(s.decode_tokens_per_second) == 50
    assert round(s.prefill_tokens_per_second, 1) == round(300 / 4.73, 1)
    assert "first token after 4.73 s" in s.line() and "decode 50.00 tok/s" in s.line()


def test_json_and_stats_line_report_prefill_and_decode_apart(converted):
    model = str(converted("kimi_k3"))
    p = run([model, "Hello there", "-n", "6", "--budget", "200MB", "--json"])
    assert p.returncode == 0, p.stderr
    stats = json.loads(p.stdout)["stats"]
    assert stats["prompt_tokens"] > 1 and stats["tokens"] == 6
    assert 0 < stats["first_token_seconds"] < stats["seconds"]
    assert stats["prefill_tokens_per_second"] > 0 and stats["decode_tokens_per_second"] > 0
    p = run([model, "Hello there", "-n", "6", "--budget", "200MB"])
    for words in ("prompt", "first token after", "prefill", "decode", "hits", "misses"):
        assert words in p.stderr


def test_bench_reports_prefill_and_decode(converted):
    p = run(["bench", str(converted("qwen3_moe")), "-n", "4", "--prompt-tokens", "40",
             "--repeats", "2", "--json"])
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["prefill_tokens_per_second_median"] > 0 and r["tokens_per_second_median"] > 0
    assert all(run["prompt_tokens"] == 40 and run["tokens"] == 5 for run in r["runs"])


def test_ctrl_c_in_a_one_shot_run_still_prints_the_stats(converted):
    p = subprocess.Popen([sys.executable, "-u", "-m", "deltafin_mlx.cli.main",
                          str(converted("kimi_k3")), "Hello", "-n", "100000", "--budget",
                          "200MB"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.2)
    first = p.stdout.read(1)  # generation has started
    assert first
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130
    assert "first token after" in err and "Traceback" not in err
    tokens = int(err.split("tokens in")[0].split(";")[-1].split()[-1])
    assert 0 < tokens < 100000


def test_a_context_beyond_the_model_is_refused_in_one_line(converted):
    p = run([str(converted("kimi_k3")), "Hello", "--context", str(2 ** 21), "--budget",
             "200MB"])
    assert p.returncode == 1
    assert p.stderr.count("\n") == 1 and "beyond this model's maximum of 1,048,576" in p.stderr


def test_a_prompt_beyond_the_context_is_refused_naming_both_numbers(converted):
    p = run([str(converted("kimi_k3")), "The quick brown fox. " * 40, "--context", "64",
             "--budget", "200MB"])
    assert p.returncode == 1 and p.stderr.count("\n") == 1
    assert "planned context of 64 tokens" in p.stderr and "the prompt is" in p.stderr
