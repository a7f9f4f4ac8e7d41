"""Round three of what a new user trips over (issue 24), each fixed or refused in
one clear line: one-shot runs apply --system and --thinking-effort and refuse what
would do nothing, one -n convention, bench's --context, --demo with every
subcommand."""

import json
import re

import pytest

from deltafin_mlx.cli.main import main, run_parser
from deltafin_mlx.cli.run import request_of
from deltafin_mlx.engine.load import open_tokenizer
from deltafin_mlx.format.model_dir import open_model_dir
from deltafin_mlx.generation.engine import chat_prompt, prompt_tokens
from test_frictions import one_error_line


def run_json(capsys, *args):
    capsys.readouterr()
    assert main([*map(str, args), "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


@pytest.fixture(autouse=True)
def no_disk_measurement(monkeypatch):
    """bench's projection needs a disk rate: a fixed one here, not a scratch file's."""
    import deltafin_mlx.plan.report as plan_cli

    monkeypatch.setattr(plan_cli, "measure_disk_gbps", lambda *a, **k: 2.0)


def exit_status(args):
    try:
        return main(args)
    except SystemExit as e:
        return e.code


# --- one-shot runs: --system and --thinking-effort apply, --session is refused --------


def test_one_shot_puts_the_system_message_and_thinking_effort_into_the_prompt(converted, capsys):
    model = converted("kimi_k3")
    tok = open_tokenizer(open_model_dir(model))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    plain = run_json(capsys, model, "Hi", "-n", "1", "--budget", "200MB")
    system = run_json(capsys, model, "Hi", "-n", "1", "--budget", "200MB", "--system", "Be brief.")
    assert system["stats"]["prompt_tokens"] == len(chat_prompt(tok, msgs))
    assert system["stats"]["prompt_tokens"] > plain["stats"]["prompt_tokens"]
    args = run_parser().parse_args(["m", "Hi", "--system", "Be brief.", "--thinking-effort", "low"])
    low = prompt_tokens(request_of(args, "Hi"), tok)
    assert low == chat_prompt(tok, msgs, thinking_effort="low") != chat_prompt(tok, msgs)


@pytest.mark.parametrize("args,words", [
    (["{model}", "Hi", "--session", "s"], ["--session only applies with --chat"]),
    (["{model}", "Hi", "--raw", "--system", "x"], ["--system", "--raw"]),
    (["{model}", "Hi", "--raw", "--thinking-effort", "low"], ["--thinking-effort", "--raw"]),
    (["{model}", "Hi", "-n", "0"], ["-n/--max-tokens", "must be in 1.."]),
    (["{model}", "Hi", "-n", "-1"], ["-n/--max-tokens", "must be in 1.."]),
    (["{model}", "--chat", "-n", "0"], ["-n/--max-tokens", "must be in 1.."]),
    (["bench", "{model}", "-n", "0"], ["-n/--max-tokens", "must be in 1.."]),
    (["batch", "{model}", "in.jsonl", "-o", "out.jsonl", "-n", "0"], ["-n/--max-tokens", "must be in 1.."]),
    (["bench", "{model}", "--context", "256", "--prompt-tokens", "250", "-n", "8"],
     ["--context 256 does not hold"]),
])
def test_options_without_effect_or_out_of_range_are_refused_in_one_line(args, words, converted,
                                                                          capsys):
    args = [a.format(model=converted("kimi_k3")) for a in args]
    assert exit_status(args) in (1, 2)  # 2: argparse's usage errors
    one_error_line(capsys.readouterr().err, *words)


# --- bench plans the context a run would ----------------------------------------------


def test_bench_reserves_what_its_runs_need_or_the_context_given(converted, capsys):
    model = converted("kimi_k3")
    base = ["bench", model, "-n", "2", "--prompt-tokens", "4", "--repeats", "1", "--budget", "200MB"]
    assert run_json(capsys, *base)["context"] == 256  # 4 + 2 tokens, rounded up as a run does
    assert run_json(capsys, *base, "--context", "1000")["context"] == 1000


# --- --demo with every subcommand --------------------------------------------------------


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from deltafin_mlx.testing.demo import prepare

    root = tmp_path_factory.mktemp("demo")
    return root, prepare(root)


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


# --- sampling and output parity ------------------------------------------------------


PENALTIES = ["--repetition-penalty", "1.8", "--presence-penalty", "0.5", "--penalty-context", "8"]


def mlx_lm_tokens(reference, prompt, steps, **sampling):
    """mlx-lm itself, the model fully in memory, with mlx-lm's own processors."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(**sampling)
    out = []
    for token, _ in generate_step(mx.array(prompt), reference, max_tokens=steps,
                                  logits_processors=processors):
        out.append(int(token))
    return out


def test_penalties_in_run_chat_and_batch_give_mlx_lm_s_tokens(converted, references, capsys,
                                                                tmp_path):
    from mlx_lm.models.cache import load_prompt_cache

    from deltafin_mlx.cli.chat import cmd_chat

    model = converted("kimi_k3")
    tok = open_tokenizer(open_model_dir(model))
    prompt = chat_prompt(tok, [{"role": "user", "content": "Hello there"}])
    expected = mlx_lm_tokens(references("kimi_k3"), prompt, 12, repetition_penalty=1.8,
                             repetition_context_size=8, presence_penalty=0.5,
                             presence_context_size=8)
    plain = run_json(capsys, model, "Hello there", "-n", "12", "--budget", "200MB")["tokens"]
    assert expected != plain  # the penalties change the reply
    run = run_json(capsys, model, "Hello there", "-n", "12", "--budget", "200MB", *PENALTIES)
    assert run["tokens"] == expected

    session = tmp_path / "chat"
    args = run_parser().parse_args([str(model), "--chat", "-n", "12", "--budget", "200MB",
                                    "--session", str(session), *PENALTIES])
    import io, sys
    stdin, sys.stdin = sys.stdin, io.StringIO("Hello there\n")
    try:
        assert cmd_chat(args) == 0
    finally:
        sys.stdin = stdin
    tokens = json.loads(load_prompt_cache(str(session) + ".safetensors", return_metadata=True)[1]
                        ["tokens"])
    assert tokens == prompt + expected

    jobs = tmp_path / "in.jsonl"
    jobs.write_text('{"id": 1, "prompt": "Hello there"}\n')
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(model), str(jobs), "-o", str(out), "-n", "12", "--budget", "200MB",
                 *PENALTIES]) == 0
    assert json.loads(out.read_text())["tokens"] == expected


def test_one_shot_output_hides_markup_and_the_counters_show_peak_memory(converted, capsys):
    model = converted("kimi_k3")
    capsys.readouterr()
    assert main([str(model), "Hello there", "-n", "40", "--budget", "200MB"]) == 0
    out = capsys.readouterr()
    assert "<|" not in out.out and "[thinking]" in out.out  # thinking apart, markup never
    assert re.search(r"peak memory [\d.]+ [KMG]B MLX, [\d.]+ [KMG]B RSS$", out.err.strip())
    stats = run_json(capsys, model, "Hi", "-n", "2", "--budget", "200MB")["stats"]
    assert stats["peak_rss_bytes"] > 0 and stats["peak_mlx_bytes"] > 0


# --- housekeeping: list, rm, the demo's cache ---------------------------------------


def test_list_shows_every_model_under_a_directory_with_size_architecture_and_floor(
        converted, tmp_path, capsys):
    import shutil

    for arch in ("kimi_k3", "qwen3_moe"):
        shutil.copytree(converted(arch), tmp_path / "models" / arch)
    (tmp_path / "models" / "notes").mkdir()
    rows = [json.loads(line) for line in run_json_lines(capsys, "list", tmp_path / "models")]
    assert [r["architecture"] for r in rows] == ["kimi_k3", "qwen3_moe"]
    plan = run_json(capsys, "plan", tmp_path / "models" / "kimi_k3", "--disk-gbps", "2",
                    "--compute-gwps", "3", "--prefill-gwps", "3")
    assert rows[0]["floor_bytes"] == plan["floor_bytes"]
    assert rows[0]["bytes"] > sum(open_model_dir(tmp_path / "models" / "kimi_k3").manifest
                                  .files.values()) * 0.99
    capsys.readouterr()
    assert main(["list", str(tmp_path / "models")]) == 0
    out = capsys.readouterr().out
    assert "Kimi K3 (kimi_k3)" in out and "FLOOR" in out and len(out.splitlines()) == 3  # a header


def run_json_lines(capsys, *args):
    capsys.readouterr()
    assert main([*map(str, args), "--json"]) == 0
    return capsys.readouterr().out.splitlines()


def test_rm_removes_only_a_converted_model_and_asks_first(converted, copy_of, tmp_path, capsys,
                                                            monkeypatch):
    import io

    model = copy_of(converted("kimi_k3"))
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # not a terminal: no one to ask
    assert main(["rm", str(model)]) == 1
    one_error_line(capsys.readouterr().err, "without confirmation", "--yes")
    (model / "notes.txt").write_text("mine")
    assert main(["rm", str(model), "--yes"]) == 1
    one_error_line(capsys.readouterr().err, "did not write", "notes.txt", "not removed")
    assert model.exists()
    (model / "notes.txt").unlink()
    (tmp_path / "link").symlink_to(model)
    assert main(["rm", str(tmp_path / "link"), "--yes"]) == 1
    one_error_line(capsys.readouterr().err, "symlink")
    assert main(["rm", str(tmp_path), "--yes"]) == 1
    one_error_line(capsys.readouterr().err, "not a Deltafin model")
    assert main(["rm", str(model), "--yes"]) == 0
    assert not model.exists() and "freed" in capsys.readouterr().err


def test_rm_demo_cleans_the_demos_cache(tmp_path, capsys):
    from deltafin_mlx.testing.demo import prepare

    root = tmp_path / "demo"
    prepare(root)
    assert main(["rm", "--demo", "--demo-dir", str(root), "--yes"]) == 0
    assert not root.exists() and "freed" in capsys.readouterr().err


def test_the_new_commands_options_have_help_and_defaults():
    from deltafin_mlx.cli.list_models import list_parser
    from deltafin_mlx.cli.remove import rm_parser
    from test_frictions import test_every_option_has_help_and_says_its_default as check

    for parser in (list_parser(), rm_parser()):
        check(parser)


# --- plan's projection against bench's measurement ------------------------------------


def test_bench_reports_the_projection_against_its_measurement_and_calibrates_plan(
        converted, capsys):
    model = converted("kimi_k3")
    bench = run_json(capsys, "bench", model, "-n", "16", "--repeats", "1", "--budget", "30MB")
    measured = bench["tokens_per_second_median"]
    assert bench["projected_over_measured"] == pytest.approx(
        bench["projected_tokens_per_second"] / measured)
    plan = run_json(capsys, "plan", model, "--budget", "30MB", "--context", str(bench["context"]))
    assert "calibrated by deltafin-run bench" in plan["layer_rate_from"]
    assert plan["layer_seconds"] == pytest.approx(bench["calibrated_layer_seconds"])
    # Calibrated, plan's projection is the measured speed (less its waits for reads).
    assert 0.6 < plan["projection"]["real_routing_tokens_per_second"] / measured < 2.5
    capsys.readouterr()
    assert main(["bench", str(model), "-n", "4", "--repeats", "1", "--budget", "30MB"]) == 0
    assert re.search(r"plan's projection: [\d.]+ tok/s .* measured [\d.]+: projected/measured "
                     r"[\d.]+", capsys.readouterr().out)


def test_plan_shows_seconds_per_token_below_one_token_a_second(converted, capsys):
    capsys.readouterr()
    assert main(["plan", str(converted("kimi_k3")), "--budget", "30MB", "--disk-gbps", "1",
                 "--compute-gwps", "0.0001", "--prefill-gwps", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"projection .*: [\d.]+-[\d.]+ s/token", out), out


def test_serve_with_demo_gets_the_demo_model_and_budget(demo):
    from deltafin_mlx.cli.demo import demo_argv

    root, model = demo
    argv = demo_argv("serve", ["--demo", "--demo-dir", str(root), "--port", "8081"])
    assert argv[:3] == [str(model), "--port", "8081"] and argv[3] == "--budget"
    assert demo_argv("info", ["--demo", f"--demo-dir={root}"]) == [str(model)]
    assert demo_argv("serve", ["--demo", "--demo-dir", str(root), "--budget", "1GB"])[1:] == [
        "--budget", "1GB"]


@pytest.mark.parametrize("extra", [["--system", "x"], ["--thinking-effort", "low"], ["--no-think"]])
@pytest.mark.parametrize("mode", [["Hi"], ["--chat"]])
def test_template_options_are_refused_for_a_model_without_a_chat_template(
        converted, copy_of, capsys, extra, mode):
    from test_hostile import reseal

    model = copy_of(converted("qwen3_moe"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    reseal(model, "tokenizer_config.json")
    assert main([str(model), *mode, "-n", "2", "--budget", "200MB", *extra]) == 1
    one_error_line(capsys.readouterr().err, extra[0], "chat template", "has none")
    if mode == ["Hi"]:
        assert main([str(model), "Hi", "-n", "2", "--budget", "200MB"]) == 0  # it runs without
