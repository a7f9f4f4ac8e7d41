"""`--demo`: the demo model built once, run, chatted with, cached, served and removed."""

import json

import pytest

from deltafin_mlx.cli.main import main
from deltafin_mlx.format.manifest import read_manifest

from helpers import run_command, run_json


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    p = run_command(["--demo", "--demo-dir", d, "-n", "2", "--raw"])
    assert p.returncode == 0, p.stderr
    return d


def test_demo_takes_a_prompt_json_trace_routing_and_max_tokens(demo_dir, tmp_path):
    from mlx_lm.utils import load_config

    from deltafin_mlx.generation.engine import chat_prompt
    from deltafin_mlx.engine.load import load_tokenizer

    trace = tmp_path / "trace.jsonl"
    prompt = "Hello there, demo: a prompt of my own"
    p = run_command(["--demo", prompt, "--demo-dir", demo_dir, "-n", "70", "--json",
             "--trace-routing", trace])
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert len(out["tokens"]) == 70  # -n is honoured, not capped at the demo's 64
    assert "80 of 320 experts fit" in p.stderr
    model = demo_dir / "model"
    tokenizer = load_tokenizer(model, read_manifest(model), load_config(model))
    expected = chat_prompt(tokenizer, [{"role": "user", "content": prompt}])
    assert out["stats"]["prompt_tokens"] == len(expected)  # the prompt given, not the default
    lines = trace.read_text().splitlines()
    assert len(lines) >= len(expected) + 69  # every prompt and generated token


def test_demo_chat_is_a_chat(demo_dir):
    p = run_command(["--demo", "--chat", "--demo-dir", demo_dir, "-n", "3"], stdin="Hi\n/quit\n")
    assert p.returncode == 0, p.stderr
    assert "[deltafin] 3 tokens in" in p.stderr


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from deltafin_mlx.testing.demo import prepare

    root = tmp_path_factory.mktemp("demo")
    return root, prepare(root)


@pytest.mark.usefixtures("no_disk_measurement")
def test_every_subcommand_takes_demo_and_a_cached_demo_says_where_it_is(demo, capsys, tmp_path):
    root, model = demo
    where = ["--demo", "--demo-dir", str(root)]
    plan = run_json(capsys, "plan", *where, "--disk-gbps", "2", "--compute-gwps", "3",
                    "--prefill-gwps", "3")
    assert plan["model"] == str(model) and plan["expert_cache_fraction"] == pytest.approx(0.25, abs=0.01)
    capsys.readouterr()
    assert main(["info", *where]) == 0
    out = capsys.readouterr()
    assert str(model) in out.out and f"converted earlier, is in {model}" in out.err
    assert main(["verify", *where]) == 0
    assert "OK" in capsys.readouterr().out
    bench = run_json(capsys, "bench", *where, "-n", "2", "--repeats", "1")
    assert bench["model"] == str(model) and bench["cache_fraction"] < 0.5
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": 1, "prompt": "Hi", "max_tokens": 2}\n')
    assert main(["batch", *where, str(prompts), "-o", str(tmp_path / "out.jsonl")]) == 0
    assert json.loads((tmp_path / "out.jsonl").read_text())["id"] == 1


@pytest.mark.usefixtures("no_disk_measurement")
def test_rm_demo_cleans_the_demos_cache(tmp_path, capsys):
    from deltafin_mlx.testing.demo import prepare

    root = tmp_path / "demo"
    prepare(root)
    assert main(["rm", "--demo", "--demo-dir", str(root), "--yes"]) == 0
    assert not root.exists() and "freed" in capsys.readouterr().err


@pytest.mark.usefixtures("no_disk_measurement")
def test_serve_with_demo_gets_the_demo_model_and_budget(demo):
    from deltafin_mlx.cli.demo import demo_argv
    from deltafin_mlx.cli.info import info_parser
    from deltafin_mlx.cli.serve import parser as serve_parser

    root, model = demo
    argv = demo_argv(["--demo", "--demo-dir", str(root), "--port", "8081"], serve_parser())
    assert argv[:3] == [str(model), "--port", "8081"] and argv[3] == "--budget"
    assert demo_argv(["--demo", f"--demo-dir={root}"], info_parser()) == [str(model)]
    assert demo_argv(["--demo", "--demo-dir", str(root), "--budget", "1GB"], serve_parser())[1:] == [
        "--budget", "1GB"]
