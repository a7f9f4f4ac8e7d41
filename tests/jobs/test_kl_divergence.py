"""KL divergence against a reference, as llama-perplexity's --kl-divergence-base /
--kl-divergence: a base run writes its next-token distributions (top K + the
tail's mass per scored position, a safetensors file numpy reads), a later run on
the same text reports mean/median/p99 KL and top-1 agreement. Against itself: KL
0 and 100% agreement; against a 2-bit conversion of the same source: KL > 0 and
agreement below 100%."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from deltafin_mlx.cli.main import main
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.errors import JobError
from deltafin_mlx.jobs.perplexity import PerplexityOptions, Windows, perplexity

ARGS = ["-c", "48", "--budget", "200MB", "--json"]


WORDS = ("the experts stream from disk while the trunk stays in memory and every "
         "token routes to a few of them 12 34 def route(x): return x").split()


def corpus(seed, lines=20):
    rng = np.random.default_rng(seed)
    return "\n".join(" ".join(rng.choice(WORDS, size=13)) for _ in range(lines)) + "\n"


@pytest.fixture(scope="module")
def base(converted, tmp_path_factory):
    """The qwen3_moe fixture's reference distributions on a text (4-bit experts)."""
    root = tmp_path_factory.mktemp("kl")
    text, ref = root / "corpus.txt", root / "base.kld.safetensors"
    text.write_text(corpus(seed=1))
    assert main(["perplexity", str(converted("qwen3_moe")), str(text), *ARGS,
                 "--kl-top-k", "16", "--kl-divergence-base", str(ref)]) == 0
    return text, ref


def kl_of(capsys, model, text, ref, *extra):
    assert main(["perplexity", str(model), str(text), "--budget", "200MB", "--json",
                 "--kl-divergence", str(ref), *extra]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err.strip().splitlines()[-1]


def test_the_reference_is_top_k_and_the_tails_mass_per_scored_position(base, capsys):
    text, ref = base
    t = load_file(str(ref))
    n = t["token_logprobs"].shape[0]
    assert t["top_ids"].shape == t["top_logprobs"].shape == (n, 16)
    assert t["top_ids"].dtype == np.int32 and t["top_logprobs"].dtype == np.float32
    mass = np.exp(t["top_logprobs"].astype(np.float64)).sum(-1) + np.exp(t["tail_logprob"])
    assert np.allclose(mass, 1.0, atol=1e-5)
    assert (np.diff(t["top_logprobs"], axis=-1) <= 0).all()  # best first
    assert (t["token_logprobs"] <= t["top_logprobs"][:, 0] + 1e-6).all()


def test_a_model_against_its_own_reference_has_kl_0_and_agrees_everywhere(converted, base,
                                                                           capsys):
    text, ref = base
    s, last = kl_of(capsys, converted("qwen3_moe"), text, ref, "-c", "48")  # the same: taken
    kl = s["kl"]
    assert kl["positions"] == s["scored_tokens"] > 100
    assert kl["mean"] == kl["median"] == kl["p99"] == kl["max"] == 0.0
    assert kl["same_top"] == 1.0 and kl["ln_ppl_ratio"] == 0.0
    assert "KL divergence from the reference (top 16 + tail" in last
    assert "mean 0.000000 ± 0.000000, median 0.000000, p99 0.000000" in last
    assert "same top token 100.00 ± 0.00 %" in last


def test_a_2_bit_conversion_of_the_same_source_diverges(sources, base, tmp_path, capsys):
    text, ref = base
    two_bit = tmp_path / "qwen3_moe-2bit"
    convert(str(sources("qwen3_moe")), two_bit, ConvertOptions(expert_bits=2, progress=False))
    s, last = kl_of(capsys, two_bit, text, ref)
    kl = s["kl"]
    assert kl["mean"] > 0 and kl["p99"] >= kl["median"] > 0 and kl["max"] >= kl["p99"]
    assert 0 < kl["same_top"] < 1.0
    assert f"same top token {100 * kl['same_top']:.2f}" in last


def test_a_reference_of_another_text_or_not_a_reference_is_refused(converted, base, tmp_path,
                                                                    capsys):
    text, ref = base
    other = tmp_path / "other.txt"
    other.write_text(corpus(seed=2))
    assert main(["perplexity", str(converted("qwen3_moe")), str(other), "--budget", "200MB",
                 "--kl-divergence", str(ref)]) == 1
    assert "its tokens are not this text's" in capsys.readouterr().err
    assert main(["perplexity", str(converted("qwen3_moe")), str(text), "--kl-divergence",
                 str(text)]) == 1
    assert "not a KL reference written by --kl-divergence-base" in capsys.readouterr().err
    assert main(["perplexity", str(converted("qwen3_moe")), str(text), "-c", "64",
                 "--kl-divergence", str(ref)]) == 1
    assert (f"-c 64: {ref} was written with -c 48, and --kl-divergence scores the windows of "
            "its reference") in capsys.readouterr().err
    assert main(["perplexity", str(converted("qwen3_moe")), str(text), "--kl-top-k", "8",
                 "--kl-divergence", str(ref)]) == 1
    assert "--kl-top-k is what --kl-divergence-base keeps" in capsys.readouterr().err


def test_the_library_refuses_a_reference_of_other_windows_as_the_command_does(converted,
                                                                                base):
    """deltafin_mlx.jobs.perplexity compares with a reference on the reference's
    windows: a context or stride other than its own is refused in the command's
    words, and a stride left unset takes the reference's."""
    text, ref = base
    model, tok = load(converted("qwen3_moe"), "200MB", warm_start=False)
    try:
        with pytest.raises(JobError, match=f"^-c 64: {ref} was written with -c 48, and "
                           "--kl-divergence scores the windows of its reference"):
            perplexity(model, tok, text.read_text(),
                       PerplexityOptions(Windows(64), kl_reference=str(ref)))
        with pytest.raises(JobError, match=f"^--stride 16: {ref} was written with --stride "
                           "unset"):
            perplexity(model, tok, text.read_text(),
                       PerplexityOptions(Windows(48, 16), kl_reference=str(ref)))
        s = perplexity(model, tok, text.read_text(),
                       PerplexityOptions(Windows(48), kl_reference=str(ref)))
        assert s["context"] == 48 and s["kl"]["positions"] == s["scored_tokens"] > 100
    finally:
        runtime(model).close()
