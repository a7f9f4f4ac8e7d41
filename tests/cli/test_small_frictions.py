"""Issue 33's smaller frictions, each where a user meets it: options that would be
ignored are refused in one line, `list` has aligned columns with the quantization,
`rm` says what a Hugging Face folder is, `score` and `batch` read `-` as stdin,
ranges read low to high with singular nouns, the converter's bar ends once, and
the batch and bench summaries say what their figures are."""

import json
import os
import subprocess
from pathlib import Path

from deltafin_mlx.cli.plan import speed_range
from deltafin_mlx.generation.stream import RunStats
from deltafin_mlx.jobs.batch import summary_line as batch_summary
from deltafin_mlx.units import count
from helpers import BIN



def run(*args, stdin=None, timeout=300):
    return subprocess.run([str(BIN / args[0]), *map(str, args[1:])], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(out) -> str:
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    return out.stderr


def test_expert_options_on_an_mxfp4_source_are_refused_in_one_line(sources, tmp_path):
    err = one_line_error(run("deltafin-convert", sources("kimi_k3"), tmp_path / "out",
                             "--expert-bits", "8"))
    assert "--expert-bits/--expert-group-size" in err and "MXFP4" in err
    assert not (tmp_path / "out" / "deltafin.json").exists()


def test_no_think_with_a_thinking_effort_is_refused_in_one_line(converted):
    err = one_line_error(run("deltafin-run", converted("kimi_k3"), "Hi", "--no-think",
                             "--thinking-effort", "high"))
    assert "--thinking-effort" in err and "--no-think" in err


def test_list_has_a_quantization_column_and_aligned_columns(converted, tmp_path):
    import shutil

    for arch in ("kimi_k3", "qwen3_moe"):
        shutil.copytree(converted(arch), tmp_path / "models" / arch)
    out = run("deltafin-run", "list", tmp_path / "models")
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split()[:4] == ["MODEL", "SIZE", "ARCHITECTURE", "QUANTIZATION"]
    assert len(rows) == 2 and "experts MXFP4" in rows[0] and "experts 4-bit/64" in rows[1]
    for column in ("SIZE", "ARCHITECTURE", "QUANTIZATION", "FLOOR"):
        at = header.index(column)
        assert all(row[at - 2: at] == "  " and row[at] != " " for row in rows), out.stdout


def test_list_without_a_folder_shows_the_demo_too(converted, tmp_path):
    import shutil

    shutil.copytree(converted("qwen3_moe"), tmp_path / "here" / "mine")
    shutil.copytree(converted("kimi_k3"), tmp_path / "cache" / "deltafin" / "demo" / "model")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run([str(BIN / "deltafin-run"), "list"], cwd=tmp_path / "here", env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["mine", str(tmp_path / "cache" / "deltafin" / "demo" / "model")]
    given = run("deltafin-run", "list", tmp_path / "here")  # a folder named: that folder only
    assert len(given.stdout.splitlines()) == 2, given.stdout


def test_list_shows_a_model_whose_linked_source_is_gone_as_unusable(sources, tmp_path):
    import shutil

    source = tmp_path / "source"
    shutil.copytree(sources("kimi_k3"), source)
    out = run("deltafin-convert", source, tmp_path / "models" / "linked", "--link-experts")
    assert out.returncode == 0, out.stderr
    assert "unusable" not in run("deltafin-run", "list", tmp_path / "models").stdout
    shutil.rmtree(source)  # as `rm --demo` removes the demo's source
    listed = run("deltafin-run", "list", tmp_path / "models").stdout
    assert "unusable" in listed and "gone" in listed, listed


def test_rm_of_a_hugging_face_folder_says_what_it_is(sources):
    err = one_line_error(run("deltafin-run", "rm", sources("kimi_k3"), "--yes"))
    assert "a Hugging Face checkpoint, not a Deltafin model" in err
    assert "convert it first" not in err
    assert (Path(sources("kimi_k3")) / "config.json").exists()


def test_score_and_batch_read_their_input_from_stdin(converted, tmp_path):
    model = converted("kimi_k3")
    lines = "".join(json.dumps({"id": i, "text": f"Hello number {i}"}) + "\n" for i in range(2))
    out = run("deltafin-run", "score", model, "-", "-o", tmp_path / "scores.jsonl", stdin=lines)
    assert out.returncode == 0, out.stderr
    assert [json.loads(x)["id"] for x in (tmp_path / "scores.jsonl").read_text().splitlines()
            if "id" in json.loads(x)] == [0, 1]
    lines = "".join(json.dumps({"id": i, "prompt": f"Hi {i}"}) + "\n" for i in range(2))
    out = run("deltafin-run", "batch", model, "-", "-o", tmp_path / "answers.jsonl", "-n", "2",
              stdin=lines)
    assert out.returncode == 0, out.stderr
    answers = [json.loads(x) for x in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert sorted(a["id"] for a in answers if "id" in a) == [0, 1]


def test_ranges_read_low_to_high_and_one_is_singular():
    assert speed_range(1 / 78, 1 / 53.3) == "53.3-78 s/token"
    assert (count(1, "sweep"), count(1, "text"), count(3, "text")) == \
        ("1 sweep", "1 text", "3 texts")


def test_a_prefill_stopped_before_any_token_says_what_it_did():
    line = RunStats(prompt_tokens=512, seconds=4.0).line()
    assert line.startswith("no token generated: stopped in the prefill after 512 prompt "
                           "tokens in 4.00 s (128.0 tok/s)")
    assert "first token after" not in line


def test_the_batch_summary_says_which_rate_is_which():
    line = batch_summary({"requests": 2, "answered": 2, "errors": 0, "skipped": 0, "tokens": 8,
                          "seconds": 2.0, "tokens_per_second": 4.0, "batch_size": 2,
                          "expert_bytes_read": 0})
    assert "4.00 tok/s aggregate" in line and "stats.tokens_per_second is its own" in line


def test_the_converters_bar_ends_once(sources, tmp_path):
    out = run("deltafin-convert", sources("kimi_k3"), tmp_path / "out")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("100%") == 1, out.stderr
