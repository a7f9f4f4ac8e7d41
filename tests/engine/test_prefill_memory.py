"""Long prompts are prefilled in passes the memory plan sizes (each pass goes through
a layer whole, its attention in the plan's chunks), so a prompt's activations stay
within the budget: measured as peak RSS over the interpreter's baseline, in a fresh
process. (The peak is VmHWM: after exec, Linux's ru_maxrss
still counts the RSS of the process that spawned it, here pytest's.)"""

import json
import subprocess


from bench.lib import worker

PROMPT_TOKENS = 3000


def measure(model, budget, step):
    """Peak RSS over the baseline, as bench.studies.prefill_memory measures it."""
    p = subprocess.run(worker.command("prefill-peak", model, budget, PROMPT_TOKENS, step),
                       capture_output=True, text=True, timeout=600, env=worker.environment())
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_3000_token_prompt_stays_within_a_budget_it_would_overrun_in_one_pass(
        eight_layers):
    budget = 40_000_000  # the issue's --budget 40MB
    whole = measure(eight_layers, str(budget), str(PROMPT_TOKENS + 1))  # the prompt in one pass
    assert whole["prompt"] == PROMPT_TOKENS
    # The scenario: one pass does not fit (53.3 MB over the baseline, 2026-12-04).
    assert whole["over_baseline"] > budget
    planned = measure(eight_layers, str(budget), "plan")
    assert planned["budget"] == budget and planned["pass"] < PROMPT_TOKENS
    # Measured 32.1 and 32.2 MB (2026-12-04). The test allowed 1.5x until glibc was
    # kept from holding what MLX frees (engine/allocator.py, docs/LEARNED.md).
    assert planned["over_baseline"] <= budget, planned
