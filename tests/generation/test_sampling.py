"""One sampler (generation/sampling.py): batch's keyed sampler is mlx-lm's own
chain drawn from a key of its own, so a request's samples are exactly what
`mx.random.seed(S)` followed by mlx-lm's `make_sampler` draws (what a run with
`--seed S` samples), whatever else draws from MLX's global key meanwhile."""

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import make_sampler

import deltafin_mlx.cli.main as cli
from deltafin_mlx.generation.sampling import KeyedSampler, Sampling

from helpers import only_stderr_line


@pytest.mark.parametrize("options", [
    dict(temp=0.8), dict(temp=0.8, top_p=0.9), dict(temp=1.2, top_k=40, min_p=0.02),
])  # not XTC: mlx-lm's apply_xtc tosses its coin with the global key
def test_a_keyed_sampler_draws_what_the_seeded_mlx_lm_sampler_draws(options):
    logits = mx.random.normal((1, 300), key=mx.random.key(1))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.random.seed(7)
    chain = Sampling(**options).sampler()
    want = [chain(logprobs).item() for _ in range(24)]
    keyed = KeyedSampler(Sampling(**options), seed=7)
    got = []
    for _ in range(24):
        mx.random.uniform()  # another request's draw from the global key changes nothing
        got.append(keyed(logprobs).item())
    assert got == want and len(set(got)) > 1
    restarted = KeyedSampler(Sampling(**options), seed=7)  # a request run again
    assert [restarted(logprobs).item() for _ in range(24)] == want


def test_greedy_options_need_no_key():
    logprobs = mx.array([[0.1, 2.0, -1.0]])
    assert KeyedSampler(Sampling(), seed=3)(logprobs).item() == 1
    assert make_sampler(0.0)(logprobs).item() == 1


@pytest.mark.parametrize("args", [["--temp", "nan"], ["--temp", "-0.5"], ["--temp", "inf"],
                                  ["--top-p", "-0.1"], ["--top-p", "1.01"], ["--top-p", "nan"],
                                  ["-n", "-1"], ["--top-k", "-2"]])
def test_bad_sampling_options_are_refused(converted, args, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([str(converted("kimi_k3")), "hi", *args])
    assert e.value.code == 2
    assert "error: argument" in only_stderr_line(capsys.readouterr().err)
