"""Teacher-forced scoring: every log-probability equals mlx-lm's own model fully in
memory (float32, within 1e-4) and the first of the top K is its argmax, for every
fixture architecture at a streaming and a full budget; a pass reads each routed
expert at most once (within 10% of the union of its routing); many short texts take
one sweep; a killed job resumes without duplicates or lost lines; the safetensors
output reads back with plain numpy."""

import json
import os
import signal
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest

import deltafin_mlx
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.score.job import ScoreOptions, run_job
from deltafin_mlx.score.packing import pack

ARCHS = ["kimi_k3", "kimi_k2", "qwen3_moe", "mixtral"]
WORDS = ("the experts stream from disk while the trunk stays in memory and every "
         "token routes to a few of them 12 34 def route(x): return x").split()


def texts(n, words=12, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(words + rng.integers(-3, 4)))) for _ in range(n)]


def reference_logprobs(reference, tokens):
    logits = reference(mx.array([tokens]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("slots", [3, None], ids=["streaming", "full"])
def test_logprobs_equal_mlx_lm_in_memory(converted, references, arch, slots):
    """Each scored token's log-probability and the top K at each position match
    mlx-lm's model run on that text alone, fully in memory; top-1 is the argmax."""
    model, tok = load(converted(arch), "200MB", cache_slots=slots, warm_start=False)
    if slots is not None:
        slots = runtime(model).plan.slots
        assert slots < runtime(model).plan.num_experts * runtime(model).plan.moe_layers
    inputs = texts(5) + [{"id": "pc", "prompt": "the experts", "completion": " stream from disk"}]
    results = deltafin_mlx.score(model, tok, inputs, top_logprobs=4)
    ref = references(arch)
    for r in results:
        assert "error" not in r, r
        lp = reference_logprobs(ref, r["tokens"])
        assert r["token_logprobs"][0] is None and r["top_logprobs"][0] is None
        scored = 0
        for p in range(1, len(r["tokens"])):
            got = r["token_logprobs"][p]
            if got is None:
                continue
            scored += 1
            want = lp[p - 1]
            assert abs(got - want[r["tokens"][p]]) < 1e-4
            top = r["top_logprobs"][p]
            assert top[0][0] == int(np.argmax(want))
            assert [round(v, 4) for _, v in top] == [round(float(want[i]), 4) for i, _ in top]
            assert all(abs(v - want[i]) < 1e-4 for i, v in top)
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert scored == r["scored_tokens"] > 0
        assert abs(r["logprob"] - sum(v for v in r["token_logprobs"] if v is not None)) < 1e-3
    pc = results[-1]
    n_prompt = len(tok.encode("the experts"))
    assert all(v is None for v in pc["token_logprobs"][:n_prompt])
    assert all(v is not None for v in pc["token_logprobs"][n_prompt:])
    runtime(model).close()
