"""The lm-evaluation-harness model "deltafin": lm-eval's own command line (with the
model registered: `deltafin-lm-eval`, here `python -m deltafin_mlx.cli.evaluate`) runs tasks defined by local YAML files over local JSON data, no
download: a multiple-choice task's log-likelihoods equal `deltafin_mlx.score`'s for
the same strings, a rolling log-likelihood task's equal the sum over lm-eval's
rolling windows, and a generation task's answers are batch's. A model_args value or
a request the model cannot run is a DeltafinError, which the command reports in one
line with exit status 1. `import deltafin_mlx` never imports lm-eval."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import deltafin_mlx
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime

ROOT = Path(__file__).resolve().parents[2]
MC = [{"question": "The experts stream from", "choices": [" disk", " memory", " route"],
       "answer": 0},
      {"question": "def route(x): return", "choices": [" x", " 12"], "answer": 0}]
DOCS = [{"text": "the experts stream from disk while the trunk stays in memory " * 6},
        {"text": "every token routes to a few of them"}]
TASKS = {
    "deltafin_local_mc": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
""",
    "deltafin_local_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
""",
    "deltafin_local_gen": """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[answer]}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 5
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


def write_tasks(root: Path):
    data = {"deltafin_local_mc": MC, "deltafin_local_rolling": DOCS, "deltafin_local_gen": MC}
    for name, body in TASKS.items():
        rows = root / f"{name}.jsonl"
        rows.write_text("".join(json.dumps(r) + "\n" for r in data[name]))
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {rows}\ntest_split: test\n{body}")


def samples(out: Path, task: str):
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(l) for l in path.read_text().splitlines()]


def arguments(sample):
    return [[a[k] for k in sorted(a)] for _, a in sorted(sample["arguments"].items())]


@pytest.fixture(scope="module")
def evaluated(converted, tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    write_tasks(root)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(root / "hf"), "PYTHONPATH": str(ROOT)}
    model = converted("qwen3_moe")
    r = subprocess.run([sys.executable, "-m", "deltafin_mlx.cli.evaluate",
                        "--model", "deltafin", "--model_args", f"model={model},budget=200MB,"
                        "max_length=16", "--tasks", ",".join(TASKS), "--include_path",
                        str(root), "--log_samples", "--output_path", str(root / "out")],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return model, root / "out", r.stdout


def test_loglikelihoods_equal_deltafin_score_for_the_same_strings(evaluated):
    model_dir, out, stdout = evaluated
    assert "deltafin_local_mc" in stdout and "acc" in stdout
    got = {}
    for s in samples(out, "deltafin_local_mc"):
        for (context, continuation), resp in zip(arguments(s), s["resps"]):
            got[(context, continuation)] = resp[0]
    assert len(got) == 5
    model, tok = load(model_dir, "200MB", warm_start=False)
    want = deltafin_mlx.score(model, tok, [{"prompt": c, "completion": k} for c, k in got])
    for (key, (logprob, greedy)), w in zip(got.items(), want):
        assert abs(float(logprob) - w["logprob"]) < 1e-4, key
        assert str(greedy) == str(w["greedy"])  # the samples file holds them as text
    runtime(model).close()


def test_rolling_loglikelihoods_are_every_token_once_in_windows(evaluated):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    model_dir, out, _ = evaluated
    model, tok = load(model_dir, "200MB", warm_start=False)
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    for s in samples(out, "deltafin_local_rolling"):
        (text,) = arguments(s)[0]
        tokens = tok.encode(text, add_special_tokens=False)
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            tokens, prefix, max_seq_len=16, context_len=1)]
        assert len(windows) > 1 or len(tokens) <= 16
        lines = [{"prompt_tokens": c, "tokens": [*c, *k]} for c, k in windows]
        want = 0.0
        for line, r in zip(lines, deltafin_mlx.score(
                model, tok, [{"tokens": l["tokens"]} for l in lines])):
            want += sum(v for v in r["token_logprobs"][len(line["prompt_tokens"]):])
        assert abs(float(s["resps"][0][0]) - want) < 1e-3
    runtime(model).close()


def test_generation_is_batchs_greedy_answer(evaluated):
    model_dir, out, _ = evaluated
    model, tok = load(model_dir, "200MB", warm_start=False)
    for s in samples(out, "deltafin_local_gen"):
        ((context, kwargs),) = arguments(s)
        (want,) = deltafin_mlx.batch_generate(model, tok, [{"prompt": context, "max_tokens": 5,
                                                            "stop": ["\n"]}], raw=True)
        assert s["resps"][0][0] == want["text"]
    runtime(model).close()


def test_import_deltafin_mlx_never_imports_lm_eval():
    r = subprocess.run([sys.executable, "-c", "import sys, deltafin_mlx; deltafin_mlx.score; "
                        "import deltafin_mlx.jobs.score, deltafin_mlx.cli.main; "
                        "print('lm_eval' in sys.modules)"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr



# What the "deltafin" model refuses, and what its error says: model_args first, then
# requests of a generation task (lm-eval's (context, generation_kwargs) arguments).
BAD_MODEL_ARGS = [
    ("budget=200MB", "model=DIR is missing"),
    ("model={root},budget=200MB", "not a Deltafin model"),
    ("model={root}/none,budget=200MB", "no such model directory"),
    ("model={model},budget=-5", "memory budget must be a positive"),
    ("model={model},budget=lots", "bad memory size 'lots'"),
    ("model={model},budget=200MB,context=0", "--context must be at least 1 token"),
    ("model={model},budget=200MB,max_gen_toks=ten", "max_gen_toks: must be an integer"),
    ("model={model},budget=200MB,max_length=0", "max_length: must be in 1.."),
    ("model={model},budget=200MB,window=8",
     "unknown window (known: model (or pretrained), budget, context, max_length, "
     "max_gen_toks, activation_dtype)"),
    ("model={model},pretrained={root},budget=200MB", "model and pretrained name two models"),
    ("model={model},budget=200MB,activation_dtype=bf16", "activation_dtype must be one of "
     "auto, model, float32, bfloat16, float16"),
]
LONG = "the experts stream from disk " * 20
BAD_REQUESTS = [
    ("The", {"until": [""]}, "stop[0]: must not be empty"),
    ("The", {"until": [f"s{i}" for i in range(40)]}, "stop: has 40 entries, more than 16"),
    ("The", {"until": ["\n"], "temperature": 500, "do_sample": True},
     "temperature: must be in [0, 100]"),
    ("The", {"until": ["\n"], "max_gen_toks": 0}, "max_tokens: must be in 1.."),
    (LONG, {"until": ["\n"]}, "beyond the planned context"),
]


@pytest.mark.parametrize("args, says", BAD_MODEL_ARGS, ids=[a for a, _ in BAD_MODEL_ARGS])
def test_every_bad_model_arg_is_a_deltafin_error(args, says, converted, tmp_path):
    from deltafin_mlx.errors import DeltafinError
    from deltafin_mlx.jobs.lm_eval_model import DeltafinLM

    with pytest.raises(DeltafinError, match=re.escape(says)):
        DeltafinLM.create_from_arg_string(
            args.format(model=converted("qwen3_moe"), root=tmp_path))


def test_pretrained_is_taken_for_model_as_lm_evals_hf_and_vllm_take_it(converted):
    from deltafin_mlx.jobs.lm_eval_model import DeltafinLM

    model = converted("qwen3_moe")
    lm = DeltafinLM.create_from_arg_string(f"pretrained={model},budget=200MB,context=64")
    try:
        assert lm.path == str(model) and lm.context == 64
    finally:
        runtime(lm.model).close()


def test_the_readme_says_how_rolling_windows_differ_from_mlx_lm_evaluate():
    """lm-eval's EOT-prefixed windows against mlx_lm.evaluate's all-but-the-first, and
    its chat template on by default: said where the lm-eval model is described,
    with the reason Deltafin declares no lm_eval entry point."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### lm-evaluation-harness", 1)[1].split("\n### ", 1)[0]
    for says in ("pretrained", "EOT", "every token but the first", "`mlx_lm.evaluate`",
                 "chat template by default", "no plugin discovery", "local-completions"):
        assert says in section, says


def test_no_lm_eval_entry_point_is_declared_as_lm_eval_reads_none():
    """lm-eval 0.4's registry finds models in its own MODEL_MAPPING and in modules
    already imported; nothing in it reads entry points, so one declared would be
    found by nothing (the README says so)."""
    import lm_eval

    sources = Path(lm_eval.__file__).parent.rglob("*.py")
    assert not any("entry_points(" in f.read_text(errors="replace") for f in sources)
    assert "[project.entry-points" not in (ROOT / "pyproject.toml").read_text()


@pytest.fixture(scope="module")
def small_context_lm(converted):
    from deltafin_mlx.jobs.lm_eval_model import DeltafinLM

    lm = DeltafinLM.create_from_arg_string(
        f"model={converted('qwen3_moe')},budget=200MB,context=64")
    yield lm
    runtime(lm.model).close()


@pytest.mark.parametrize("context, kwargs, says", BAD_REQUESTS,
                         ids=[says.split(":")[0] for _, _, says in BAD_REQUESTS])
def test_every_generation_request_that_cannot_run_is_a_deltafin_error(
        context, kwargs, says, small_context_lm):
    from lm_eval.api.instance import Instance

    from deltafin_mlx.errors import DeltafinError

    request = Instance("generate_until", {}, (context, kwargs), 0)
    with pytest.raises(DeltafinError, match="a request cannot run: .*" + re.escape(says)):
        small_context_lm.generate_until([request])


@pytest.mark.parametrize("model_args, task, says", [
    ("model={root}", "deltafin_local_mc", "not a Deltafin model"),
    ("model={model},budget=200MB,context=4", "deltafin_local_gen",
     "a request cannot run: line 1: the prompt is"),
], ids=["a model arg", "a request"])
def test_deltafin_lm_eval_reports_an_error_in_one_line(model_args, task, says, converted,
                                                       tmp_path, capsys, monkeypatch):
    """The command's own main, in this process."""
    from deltafin_mlx.cli.evaluate import main

    write_tasks(tmp_path)
    # lm-eval's log handler keeps the stderr of the test that first ran it: its INFO off
    for name, value in (("LMEVAL_LOG_LEVEL", "ERROR"), ("HF_HUB_OFFLINE", "1"),
                        ("HF_DATASETS_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    code = main(["--model", "deltafin", "--model_args",
                 model_args.format(model=converted("qwen3_moe"), root=tmp_path),
                 "--tasks", task, "--include_path", str(tmp_path)])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("deltafin-lm-eval: error: ")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert says in errors[0], errors[0]
