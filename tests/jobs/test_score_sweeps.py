"""Many short texts share a sweep at every budget: a scoring pass holds as many rows
as its tokens allow (plan/scoring.py), not as one attention call holds; texts longer
than an attention call are attended a group of rows at a time, each group along its
texts over a cache of its own (engine/chunked_attention). At 40 MB, 16 texts of
about 70 tokens take one sweep, read each routed expert once, and score as mlx-lm's
model does fully in memory."""

import json

import numpy as np

from conftest import reference_model
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.jobs.score import ScoreOptions, Sizing, run_job


def reference_logprobs(reference, tokens):
    import mlx.core as mx

    logits = reference(mx.array([tokens]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def test_16_texts_of_70_tokens_take_one_sweep_at_41mb(eight_layers, tmp_path):
    path, src = eight_layers, eight_layers.parent / "src"  # the measurements
    # At 41 MB this model's cache could hold every expert: 16 slots make it read. (40 MB
    # until the plan counted all a shared expert computes per token: 720 values, not 576.)
    model, tok = load(path, "41MB", cache_slots=16, warm_start=False)
    sizing = Sizing(model)
    assert sizing.attention(74) < 74  # longer than one attention call: the case at hand
    rng = np.random.default_rng(3)
    texts = [rng.integers(1, 500, int(70 + rng.integers(-4, 5))).tolist() for _ in range(16)]
    one_sweep_as_mlx_lm(model, tok, texts, src, tmp_path)


def test_16_texts_whose_tokens_fit_one_prefill_pass_take_one_sweep(wide_experts, tmp_path):
    """K3's layout with a cache a pass gives back (64 MB): 16 texts of equal length
    whose tokens fill one prefill pass are scored in one sweep (a scoring pass keeps
    no KV: it is never smaller), reading each routed expert about once, as mlx-lm's
    model scores them fully in memory."""
    model, tok = load(wide_experts, "64MB", warm_start=False)
    plan = runtime(model).plan
    assert plan.pass_slots  # the cache is given back during a pass
    length = plan.prefill_pass // 16
    rng = np.random.default_rng(5)
    texts = [rng.integers(1, 380, length).tolist() for _ in range(16)]
    one_sweep_as_mlx_lm(model, tok, texts, wide_experts.parent / "src", tmp_path, check=4)


def one_sweep_as_mlx_lm(model, tok, texts, src, tmp_path, check=None):
    """The texts scored as one job: one sweep reading at most 1.10x the union of
    their routing, and (the first `check` of) their log-probabilities those of
    mlx-lm's model of `src` fully in memory."""
    job = tmp_path / "in.jsonl"
    job.write_text("".join(json.dumps({"id": i, "tokens": t}) + "\n" for i, t in enumerate(texts)))
    s = run_job(model, tok, job, tmp_path / "out.jsonl", ScoreOptions(), show_progress=False)
    assert s["scored_texts"] == len(texts) and s["sweeps"] == 1, s
    assert 0 < s["expert_bytes_read"] <= 1.10 * s["union_bytes"], s
    ref = reference_model(src)
    for line in (tmp_path / "out.jsonl").read_text().splitlines()[:check]:
        r = json.loads(line)
        want = reference_logprobs(ref, r["tokens"])
        got = np.array([np.nan if v is None else v for v in r["token_logprobs"]][1:])
        expected = want[np.arange(len(r["tokens"]) - 1), r["tokens"][1:]]
        np.testing.assert_allclose(got, expected, atol=1e-4)
    runtime(model).close()
