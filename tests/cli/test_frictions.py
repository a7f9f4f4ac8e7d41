"""What a new user trips over, each fixed or refused in one clear line (issue 12's
frictions): paths with ~, option parsing, refused option mixes, --version and help,
plan's output and rates, the converter's reruns, progress and hints, info, verify,
a closed pipe, and the README's examples run exactly as written."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import deltafin_mlx
from helpers import make_source
from deltafin_mlx.cli import convert as convert_cli
from deltafin_mlx.format.bank import read_layout
from deltafin_mlx.cli.main import main
from deltafin_mlx.format.manifest import MANIFEST_NAME, read_manifest
from deltafin_mlx import runtime
from helpers import BIN

REPO = Path(__file__).resolve().parents[2]
FAKE_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def run(args, stdin=None, env=None, cwd=None, tool="deltafin-run", timeout=300):
    return subprocess.run([str(BIN / tool), *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env={**os.environ, **(env or {})})


def one_error_line(p_or_err, *words):
    err = (p_or_err if isinstance(p_or_err, str) else p_or_err.stderr).strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert " error: " in err, err
    for w in words:
        assert w in err, err
    return err


def fake_hub_cache(hf_home: Path, repo: str, files_from: Path, only=None):
    """A Hugging Face hub cache holding `repo` as if downloaded earlier: with
    HF_HUB_OFFLINE=1 the hub client resolves it without any network."""
    base = hf_home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / FAKE_COMMIT
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(FAKE_COMMIT)
    for f in files_from.iterdir():
        if only is None or f.name in only:
            shutil.copy(f, snap / f.name)
    return snap


# --- paths with ~ ---------------------------------------------------------------------


def test_load_and_the_cli_expand_a_tilde(converted, tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / "k3").symlink_to(converted("kimi_k3"))
    monkeypatch.setenv("HOME", str(home))
    model, tokenizer = deltafin_mlx.load("~/models/k3", memory_budget="200MB")
    assert len(deltafin_mlx.generate(model, tokenizer, "Hi", max_tokens=3).tokens) == 3
    runtime(model).close()
    # A quoted ~ reaches the CLI unexpanded by the shell.
    p = run(["~/models/k3", "Hi", "-n", "3", "--json", "--budget", "200MB"], env={"HOME": home})
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["tokens"]) == 3
    (home / "src").symlink_to(make_source(tmp_path / "src", "mixtral"))
    assert convert_cli.main(["~/src", "~/mixtral", "--quiet"]) == 0
    assert (home / "mixtral" / MANIFEST_NAME).exists() and not Path("~").exists()


# --- option parsing and refused mixes -------------------------------------------------


def run_json(*args):
    p = run([*args, "--json", "--budget", "200MB"])
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_stop_before_the_prompt_takes_one_value_and_repeats(converted):
    model = converted("kimi_k3")
    text = run_json(model, "Hello", "-n", "24", "--raw")["text"]
    first, second = text[4:6], text[12:14]
    assert first.strip() and second.strip()
    cut = run_json(model, "--stop", second, "--stop", first, "Hello", "-n", "24", "--raw")
    assert cut["text"] == text[: min(text.index(first), text.index(second))]
    assert cut["finish_reason"] == "stop"


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    p = run(["--demo", "--demo-dir", d, "-n", "2", "--raw"])
    assert p.returncode == 0, p.stderr
    return d


def test_demo_takes_a_prompt_json_trace_routing_and_max_tokens(demo_dir, tmp_path):
    from mlx_lm.utils import load_config

    from deltafin_mlx.generation.engine import chat_prompt
    from deltafin_mlx.engine.load import load_tokenizer

    trace = tmp_path / "trace.jsonl"
    prompt = "Hello there, demo: a prompt of my own"
    p = run(["--demo", prompt, "--demo-dir", demo_dir, "-n", "70", "--json",
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
    p = run(["--demo", "--chat", "--demo-dir", demo_dir, "-n", "3"], stdin="Hi\n/quit\n")
    assert p.returncode == 0, p.stderr
    assert "[deltafin] 3 tokens in" in p.stderr


@pytest.mark.parametrize("args,words", [
    (["{model}", "--chat", "--json"], ["--json does not work with --chat"]),
    (["{model}", "--chat", "--trace-routing", "t.jsonl"], ["--trace-routing does not work with --chat"]),
    (["{model}", "--chat", "--raw"], ["--raw does not work with --chat"]),
    (["{model}", "Hello", "--chat"], ["--chat", "drop the prompt"]),
    (["{model}", "Hello", "--raw", "--no-think"], ["--no-think", "--raw"]),
    (["{model}", "Hello", "--demo-dir", "x"], ["--demo-dir only applies with --demo"]),
    (["--demo", "{model}", "Hello"], ["--demo runs its own model"]),
    (["plan", "{model}", "--bits", "8"], ["--bits", "already converted", "config.json"]),
    (["plan", "{model}", "--expert-group-size", "32"], ["--expert-group-size", "already converted"]),
    (["plan", "{model}", "--context", "-5"], ["--context must be at least 1"]),
    (["plan", "{model}", "--context", "0"], ["--context must be at least 1"]),
    (["plan", "{model}", "--context", "9999999"], ["beyond this model's maximum of 1,048,576"]),
])
def test_options_that_would_do_nothing_are_refused_in_one_line(args, words, converted, capsys):
    args = [a.format(model=converted("kimi_k3")) for a in args]
    assert main(args) == 1
    one_error_line(capsys.readouterr().err, *words)


# --- --version and help ---------------------------------------------------------------


@pytest.mark.parametrize("tool", ["deltafin-run", "deltafin-convert"])
def test_version(tool):
    from importlib.metadata import version

    p = run(["--version"], tool=tool)
    assert p.returncode == 0
    assert p.stdout.strip() == f"{tool} {deltafin_mlx.__version__}"
    assert version("deltafin") == deltafin_mlx.__version__


def test_main_help_lists_every_command():
    p = run(["--help"])
    assert p.returncode == 0
    usage = p.stdout.split("\n\n")[0]
    for command in ("MODEL PROMPT", "--chat", "plan", "bench", "batch", "serve", "info", "verify",
                    "--demo"):
        assert command in usage, usage
    commands = p.stdout.split("commands:")[1]
    for command in ("plan", "bench", "batch", "serve", "info", "verify", "--demo"):
        assert re.search(rf"^  {re.escape(command)} ", commands, re.M), commands


def all_parsers():
    from deltafin_mlx.cli.batch import batch_parser
    from deltafin_mlx.cli.bench import bench_parser
    from deltafin_mlx.cli.info import info_parser
    from deltafin_mlx.cli.main import run_parser
    from deltafin_mlx.cli.plan import plan_parser
    from deltafin_mlx.cli.verify import verify_parser

    return [run_parser(), plan_parser(), bench_parser(), batch_parser(), info_parser(),
            verify_parser(), convert_cli.build_parser()]


@pytest.mark.parametrize("parser", all_parsers(), ids=lambda p: p.prog)
def test_every_option_has_help_and_says_its_default(parser):
    for action in parser._actions:
        if action.dest in ("help", "version"):
            continue
        assert action.help, f"{parser.prog}: {action.option_strings or action.dest} has no help"
        if not action.option_strings or action.nargs == 0 or action.required:
            continue  # positionals, required options and on/off flags: no default to say
        shown = " ".join(parser._get_formatter()._format_action(action).split())
        assert "(default: " in shown, shown


# --- plan -----------------------------------------------------------------------------


def plan_json(*args, env=None):
    p = run(["plan", *args, "--json"], env=env)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_plan_floor_parts_add_up_and_every_size_is_in_a_fitting_unit(converted, capsys):
    r = plan_json(converted("kimi_k3"), "--budget", "50MB", "--disk-gbps", "2",
                  "--compute-gwps", "3")
    assert sum(r["floor_parts"].values()) == r["floor_bytes"]
    assert list(r["floor_parts"]) == ["resident trunk", "streamed-layer buffers", "KV/state",
                                      "working buffers", "one token's experts"]
    assert r["floor_parts"]["KV/state"] == r["state_bytes"]
    assert r["floor_parts"]["one token's experts"] == 4 * r["expert_slot_bytes"]
    assert main(["plan", str(converted("kimi_k3")), "--budget", "50MB", "--disk-gbps", "2",
                 "--compute-gwps", "3"]) == 0
    text = capsys.readouterr().out
    assert "0.00 GB" not in text and not re.search(r"\b0\.0+ [KMGT]B\b", text), text
    assert f"{r['experts_total']} experts ({r['moe_layers']} MoE layers x " \
           f"{r['experts_per_layer']}, {r['experts_per_token']} per token), 24.6 KB each" in text
    floor_line = next(l for l in text.splitlines() if l.startswith("floor"))
    for what in r["floor_parts"]:
        assert what in floor_line


def test_k3_floor_parts_add_up_in_the_budget_error(capsys):
    from deltafin_mlx.testing.shared import EXPERT, STATE_4K, k3_config

    K3_CONFIG = k3_config()

    if not K3_CONFIG.exists():
        pytest.skip(f"{K3_CONFIG} not present (set DELTAFIN_K3_CONFIG)")
    r = plan_json(K3_CONFIG, "--dtype", "bfloat16", "--budget", "16GB", "--disk-gbps", "5",
                  "--compute-gwps", "400")
    assert sum(r["floor_parts"].values()) == r["floor_bytes"]
    assert r["floor_parts"]["KV/state"] == STATE_4K  # hand-computed in test_plan.py
    assert r["floor_parts"]["one token's experts"] == 16 * EXPERT
    assert main(["plan", str(K3_CONFIG), "--dtype", "bfloat16", "--budget", "2GB",
                 "--disk-gbps", "5", "--compute-gwps", "400"]) == 1
    err = one_error_line(capsys.readouterr().err, f"({r['floor_bytes']} bytes = ")
    for what in r["floor_parts"]:
        assert what in err


def test_plan_rates_are_measured_once_then_cached(converted, tmp_path, monkeypatch, capsys):
    """The measurements themselves are tested in test_plan.py; here, how often they run."""
    import itertools

    import deltafin_mlx.plan.report as plan

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rates = itertools.count(1)
    measured = []
    monkeypatch.setattr(plan, "measure_disk_gbps",
                        lambda *a, **k: measured.append("disk") or float(next(rates)))
    monkeypatch.setattr(plan, "measure_compute_gwps", lambda *a, batch=1, **k: measured.append(
        "compute" if batch == 1 else "prefill") or float(next(rates)))

    def plan_of(*extra):
        assert main(["plan", str(converted("kimi_k3")), "--budget", "50MB", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    first, second = plan_of(), plan_of()
    assert measured == ["disk", "compute", "prefill"]  # once, by the first run
    assert first["disk_rate_from"].startswith("measured now")
    assert second["disk_rate_from"].startswith("measured 20")  # the date it was measured
    assert "cached in" in second["compute_rate_from"]
    assert "cached in" in second["prefill_rate_from"]
    assert (tmp_path / "cache" / "deltafin" / "rates.json").exists()
    for key in ("disk_gbps", "compute_gweights_per_second", "prefill_gweights_per_second",
                "projection", "prefill_projection"):
        assert first[key] == second[key]
    again = plan_of("--remeasure")
    assert measured == ["disk", "compute", "prefill"] * 2
    assert again["disk_gbps"] != first["disk_gbps"]
    assert plan_of()["disk_gbps"] == again["disk_gbps"]  # the new measurement is kept
    given = plan_of("--disk-gbps", "1.5", "--compute-gwps", "7")
    assert (given["disk_gbps"], given["disk_rate_from"]) == (1.5, "given")
    assert (given["compute_gweights_per_second"], given["compute_rate_from"]) == (7, "given")
    assert len(measured) == 6  # the prefill rate stays cached


def test_plan_takes_a_hub_id_fetching_only_its_config(tmp_path, sources):
    hf = tmp_path / "hf"
    fake_hub_cache(hf, "someone/k3-like", sources("kimi_k3"), only={"config.json"})
    env = {"HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    r = plan_json("someone/k3-like", "--budget", "50MB", "--disk-gbps", "2", "--compute-gwps",
                  "3", env=env)
    local = plan_json(sources("kimi_k3") / "config.json", "--budget", "50MB", "--disk-gbps", "2",
                      "--compute-gwps", "3")
    assert r["model"] == "someone/k3-like" and r["floor_bytes"] == local["floor_bytes"]
    p = run(["plan", "someone/not-cached", "--disk-gbps", "2", "--compute-gwps", "3"], env=env)
    assert p.returncode == 1
    one_error_line(p, "someone/not-cached", "offline", "config.json")


@pytest.mark.parametrize("command", ["plan", "info"])
def test_output_into_a_closed_pipe_ends_quietly(command, converted):
    args = [str(BIN / "deltafin-run"), command, str(converted("kimi_k3"))]
    if command == "plan":
        args += ["--disk-gbps", "2", "--compute-gwps", "3"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # as `| head` does once it has read enough
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141
    assert err == "", err


def test_plan_piped_to_head_prints_no_traceback(converted):
    p = subprocess.run(f"{BIN / 'deltafin-run'} plan {converted('kimi_k3')} --disk-gbps 2 "
                       "--compute-gwps 3 | head -1", shell=True, capture_output=True, text=True)
    assert p.stdout.startswith("model") and p.stderr == ""


def test_k3_tests_follow_the_config_path_in_the_environment(tmp_path):
    elsewhere = tmp_path / "k3" / "config.json"
    p = subprocess.run([sys.executable, "-c", "import test_plan; print(test_plan.K3_CONFIG)"],
                       cwd=REPO / "tests" / "plan", capture_output=True, text=True,
                       env={**os.environ, "DELTAFIN_K3_CONFIG": str(elsewhere)})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(elsewhere)


# --- the converter ---------------------------------------------------------------------


def test_rerunning_a_finished_conversion_has_nothing_to_do(tmp_path, sources, capsys):
    out = tmp_path / "o"
    assert convert_cli.main([str(sources("mixtral")), str(out), "--quiet"]) == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    capsys.readouterr()
    assert convert_cli.main([str(sources("mixtral")), str(out)]) == 0
    captured = capsys.readouterr()
    assert "nothing to do" in captured.err and captured.out == ""
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_resume_says_where_it_picked_up(tmp_path, sources, monkeypatch, capsys):
    from deltafin_mlx.convert.experts import SanitizedExperts as experts

    real = experts.record

    def crash_on_layer_3(self, layer, expert):
        if layer == 3:
            raise KeyboardInterrupt
        return real(self, layer, expert)

    monkeypatch.setattr(experts, "record", crash_on_layer_3)
    out = tmp_path / "o"
    assert convert_cli.main([str(sources("kimi_k3")), str(out), "--quiet"]) == 130
    monkeypatch.setattr(experts, "record", real)
    capsys.readouterr()
    assert convert_cli.main([str(sources("kimi_k3")), str(out)]) == 0
    err = capsys.readouterr().err
    assert "3 of 4 layers already converted, picking up at layer 3" in err


def test_progress_ends_at_100_percent_with_rates_and_notes_go_to_stderr(tmp_path, sources, capsys):
    assert convert_cli.main([str(sources("kimi_k3")), str(tmp_path / "o")]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("converted ") and len(captured.out.splitlines()) == 1
    assert "note: skipping" in captured.err  # K3's vision tensors
    final = captured.err.replace("\r", "\n").strip().splitlines()[-1]
    assert final.startswith("converted: 100%"), final
    assert re.search(r"[0-9.]+[kMG]?B/s", final) and re.search(r"[0-9.]+ layers/s", final), final


def test_a_converted_model_as_source_gets_the_command_to_run_it(converted, tmp_path, capsys):
    assert convert_cli.main([str(converted("mixtral")), str(tmp_path / "o")]) == 1
    one_error_line(capsys.readouterr().err, "already a Deltafin model", "deltafin-run ")


def test_an_unconverted_checkpoint_given_to_deltafin_run_gets_the_convert_command(sources):
    p = run([sources("mixtral"), "Hello"])
    assert p.returncode == 1
    one_error_line(p, "Hugging Face checkpoint", f"deltafin-convert {sources('mixtral')} ")


def test_a_hub_id_given_to_deltafin_run_gets_the_convert_command(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["someone/Some-MoE", "Hello"]) == 1
    one_error_line(capsys.readouterr().err, "deltafin-convert someone/Some-MoE ~/models/Some-MoE")


def test_offline_hub_failure_says_offline(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert convert_cli.main(["someone/some-model", str(tmp_path / "o")]) == 1
    one_error_line(capsys.readouterr().err, "someone/some-model", "offline", "HF_HUB_OFFLINE")


# --- info and verify -------------------------------------------------------------------


def test_info_describes_the_model(converted, capsys):
    model = converted("kimi_k3")
    assert main(["info", str(model), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    m = read_manifest(model)
    assert r["architecture"] == "kimi_k3" and r["layers"] == 4 and r["moe_layers"] == 3
    assert (r["experts_per_layer"], r["experts_per_token"]) == (16, 4)
    assert r["quantization"]["experts"]["mode"] == "mxfp4"
    assert r["bytes"]["total"] == sum(m.files.values())
    assert r["bytes"]["experts"] == sum(s for f, s in m.files.items() if f.endswith(".bank"))
    assert r["source"] == m.source["id"] and r["converted"] == m.source["converted"]
    assert r["converted_by"] == deltafin_mlx.__version__
    assert main(["info", str(model)]) == 0
    text = capsys.readouterr().out
    for word in ("Kimi K3", "4 layers", "16 per MoE layer", "mxfp4", "size on disk",
                 m.source["id"], m.source["converted"]):
        assert word in text, text


def test_info_reads_a_manifest_from_before_it_recorded_the_version(converted, copy_of, capsys):
    model = copy_of(converted("mixtral"))
    manifest = json.loads((model / MANIFEST_NAME).read_text())
    del manifest["source"]["deltafin_version"]
    (model / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert main(["info", str(model)]) == 0
    assert "converted      20" in capsys.readouterr().out


def test_verify_checks_every_record_with_progress(converted):
    from deltafin_mlx.format.verify import verify_model

    calls = []
    report = verify_model(converted("kimi_k3"), progress=lambda d, t: calls.append((d, t)))
    m = read_manifest(converted("kimi_k3"))
    assert report.ok and report.records_checked == 16 * 3
    assert report.bytes_checked == sum(m.files.values())  # every byte of every file
    assert calls[0][0] == 0 and calls[-1] == (report.bytes_checked, report.bytes_checked)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_verify_names_every_damaged_file_and_record(converted, copy_of):
    model = copy_of(converted("kimi_k3"))
    m = read_manifest(model)
    bank = m.bank_path(1)
    layout = read_layout(bank)
    data = bytearray(bank.read_bytes())
    for expert in (5, 11):
        data[layout.record_offset(expert) + 100] ^= 0xFF
    bank.write_bytes(bytes(data))
    other = m.bank_path(2)
    other.write_bytes(other.read_bytes()[:-4096])
    p = run(["verify", model])
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert any("experts/layer-00001.bank: record 5 (layer 1 expert 5)" in l for l in lines)
    assert any("experts/layer-00001.bank: record 11" in l for l in lines)
    assert any("experts/layer-00002.bank" in l and "truncated" in l for l in lines)
    assert lines[-1].endswith(f"3 problem(s) found; {len(m.files)} files, 32 expert records "
                              f"({lines[-1].split('(')[-1]}")
    good = run(["verify", converted("kimi_k3")])
    assert good.returncode == 0 and ": OK: " in good.stdout, good.stderr


# --- the README, verbatim --------------------------------------------------------------


def readme_blocks(lang):
    text = (REPO / "README.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


# Lines the test does not run, and why.
NOT_RUN = {
    "python3 -m venv": "the set-up itself (this test runs inside it)",
    "mlx_lm.server": "a server runs until stopped (tests/test_cli.py serves requests)",
    "deltafin-run serve": "a server runs until stopped (tests/test_server_*.py serve requests)",
    "curl -s localhost:8080": "requests to that server (tests/test_server_endpoints.py sends them)",
    "pip install -q \".[eval]\"": "the test extra already holds lm-eval",
    "deltafin-lm-eval": "its tasks download datasets (tests/jobs/test_lm_eval.py runs a local task)",
}


def test_readme_examples_run_verbatim(tmp_path, sources):
    """Every command of the README, as written, after the set-up with the venv
    active: HOME, the hub cache and the working directory hold tiny generated
    stand-ins for the checkpoints the README names (Kimi K3, an mlx-community
    Qwen3-MoE and DeepSeek-V3's FP8 release on the hub, in offline mode, and a local
    Qwen3-MoE directory)."""
    home, work, hf = tmp_path / "home", tmp_path / "work", tmp_path / "hf"
    home.mkdir(), work.mkdir()
    fake_hub_cache(hf, "moonshotai/Kimi-K3", sources("kimi_k3"))
    from deltafin_mlx.testing.mlx_lm_format import write_mlx_lm_format

    fake_hub_cache(hf, "mlx-community/Qwen3-30B-A3B-4bit",
                   write_mlx_lm_format(sources("qwen3_moe"), tmp_path / "mlx-community", bits=4))
    from deltafin_mlx.testing.original_layouts import write_original

    fake_hub_cache(hf, "deepseek-ai/DeepSeek-V3",
                   write_original(tmp_path / "deepseek-ai", "deepseek_v3_fp8"))
    shutil.copytree(sources("qwen3_moe"), work / "Qwen3-30B-A3B")
    (work / "prompt.txt").write_text("Why is the sky blue?")
    (work / "wiki.test.raw").write_text("The sky is blue because air scatters short waves. " * 40)
    (work / "prompts.jsonl").write_text('{"id": "q1", "prompt": "Why is the sky blue?"}\n'
                                        '{"id": 2, "prompt": "Hi", "max_tokens": 4}\n')
    for name in ("texts.jsonl", "corpus.jsonl"):  # score's inputs
        (work / name).write_text('{"id": "t1", "text": "Every token of this text is scored."}\n'
                                 '{"id": "mc-3", "prompt": "The capital of France is", '
                                 '"completion": " Paris"}\n')
    env = {"HOME": str(home), "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "XDG_CACHE_HOME": "",
           "VIRTUAL_ENV": str(BIN.parent)}
    lines = [l for block in readme_blocks("sh") for l in block.splitlines() if l.strip()]
    ran = 0
    for line in lines:
        if any(line.startswith(k) or k in line for k in NOT_RUN):
            continue
        # stdin at its end: a chat starts and ends at once
        p = subprocess.run(["bash", "-c", line], cwd=work, capture_output=True, text=True,
                           timeout=600, input="", env={**os.environ, **env})
        assert p.returncode == 0 and "Traceback" not in p.stderr, f"{line}\n{p.stderr[-2000:]}"
        ran += 1
    assert ran >= 15
    assert (home / "models" / "k3" / MANIFEST_NAME).exists()
    for block in readme_blocks("python"):
        p = subprocess.run([sys.executable, "-c", block], cwd=work, capture_output=True,
                           text=True, timeout=600, env={**os.environ, **env})
        assert p.returncode == 0, f"{block}\n{p.stderr[-2000:]}"
        assert "tok/s" in p.stdout
