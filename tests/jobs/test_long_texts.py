"""Any text length within the plan: a text longer than a scoring pass is scored
across passes keeping its KV/state (jobs/score_sweep.run_long), as a long prompt is
prefilled, so only one pass's activations and the text's KV are held: its
log-probabilities equal the same text scored in one pass at a large budget (and
mlx-lm's model fully in memory) within 1e-4, and its peak RSS stays within the
budget over the interpreter's baseline (25% allowed for what the plan does not
model yet: issue 31 is open on it)."""

import json

import numpy as np

from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.jobs.score import ScoreOptions, Sizing, iter_passes, prepare_all
from deltafin_mlx.jobs.batch_lines import read_requests
from deltafin_mlx.testing.peak import measure as measure_peak

TOKENS = 2500


def scores(model, tok, tokens):
    """(log-probabilities, passes) of one text."""
    requests = read_requests([json.dumps({"id": 0, "tokens": tokens})], spec_of=dict)
    items, _ = prepare_all(requests, tok, ScoreOptions())
    out, passes = None, 0
    for results, stats in iter_passes(model, items, ScoreOptions(top_logprobs=2)):
        out, passes = results[0], passes + stats.passes
    return out, passes


def test_a_long_text_across_passes_scores_as_in_one_pass(converted, references):
    tokens = np.random.default_rng(0).integers(1, 500, TOKENS).tolist()
    small, tok = load(converted("kimi_k3"), "40MB", warm_start=False)
    segment = Sizing(small).segment(TOKENS)
    assert segment is not None and segment < TOKENS  # too long for one pass at 40 MB
    across, passes = scores(small, tok, tokens)
    runtime(small).close()
    assert passes == -(-TOKENS // segment) > 1
    large, tok = load(converted("kimi_k3"), "2GB", warm_start=False)
    assert Sizing(large).segment(TOKENS) is None
    whole, one = scores(large, tok, tokens)
    runtime(large).close()
    assert one == 1
    np.testing.assert_allclose(across.token_logprobs[1:], whole.token_logprobs[1:], atol=1e-4)
    assert (across.top_ids[1:, 0] == whole.top_ids[1:, 0]).all()
    import mlx.core as mx

    logits = references("kimi_k3")(mx.array([tokens]))[0].astype(mx.float32)
    ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    np.testing.assert_allclose(across.token_logprobs[1:],
                               ref[np.arange(TOKENS - 1), tokens[1:]], atol=1e-4)


def test_a_long_texts_peak_stays_within_the_budget(eight_layers):
    budget = 40_000_000  # the issue's --budget 40MB
    r = measure_peak("score-peak", eight_layers, budget, 3000, timeout=1200)
    assert r["passes"] > 1 and np.isfinite(r["logprob"])
    # Within the budget itself since glibc is kept from holding what MLX frees
    # (engine/allocator.py); the figures are in docs/PERFORMANCE.md and docs/LEARNED.md.
    assert r["over_baseline"] <= budget, r
