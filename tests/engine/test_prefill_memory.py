"""Long prompts are prefilled in passes the memory plan sizes (each pass goes through
a layer whole, its attention in the plan's chunks), so a prompt's activations stay
within the budget: measured as peak RSS over the interpreter's baseline, in a fresh
process. (The peak is VmHWM: after exec, Linux's ru_maxrss
still counts the RSS of the process that spawned it, here pytest's.)"""

import json
import subprocess

import pytest

from bench.lib import worker
from helpers import make_source
from deltafin_mlx.convert.convert import ConvertOptions, convert

PROMPT_TOKENS = 3000


def measure(model, budget, step):
    """Peak RSS over the baseline, as bench.studies.prefill_memory measures it."""
    p = subprocess.run(worker.command("prefill-peak", model, budget, PROMPT_TOKENS, step),
                       capture_output=True, text=True, timeout=600, env=worker.environment())
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def eight_layers(tmp_path_factory):
    # K3's layout with 8 layers: a whole-prompt prefill of 3,000 tokens needs far
    # more memory than the model itself (hundreds of MB over a floor of ~18 MB).
    root = tmp_path_factory.mktemp("eight_layers")
    src = make_source(root / "src", "kimi_k3", num_layers=8)
    convert(str(src), root / "model", ConvertOptions(progress=False))
    return root / "model"


def test_a_3000_token_prompt_stays_within_a_budget_it_would_overrun_in_one_pass(
        eight_layers):
    budget = 40_000_000  # the issue's --budget 40MB
    whole = measure(eight_layers, str(budget), str(PROMPT_TOKENS + 1))  # the prompt in one pass
    assert whole["prompt"] == PROMPT_TOKENS
    assert whole["over_baseline"] > 1.5 * budget  # the scenario: one pass does not fit
    planned = measure(eight_layers, str(budget), "plan")
    assert planned["budget"] == budget and planned["pass"] < PROMPT_TOKENS
    assert planned["over_baseline"] <= 1.5 * budget, planned
