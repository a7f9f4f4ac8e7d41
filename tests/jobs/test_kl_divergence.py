"""KL divergence against a reference, as llama-perplexity's --kl-divergence-base /
--kl-divergence: a base run writes its next-token distributions (top K + the
tail's mass per scored position, a safetensors file numpy reads), a later run on
the same text reports llama-perplexity's statistics (KL mean, median and
percentiles, Δp and its RMS, same top token, the perplexity ratio, difference and
Cor(ln PPL)) and how much of the mass the base's top K held, with a warning when
that makes the KL a loose bound. Against itself: KL 0 and 100% agreement; against
a 2-bit conversion of the same source: KL > 0 and agreement below 100%; with the
whole vocabulary kept (a --kl-top-k beyond it is cut to it before anything is
scored), the KL is the exact one, as numpy computes it from the two models' logits."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

import math

import mlx.core as mx

import deltafin_mlx.jobs.perplexity as perplexity_job
from deltafin_mlx.cli.main import main
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.errors import JobError
from deltafin_mlx.jobs.kl_statistics import kl_summary
from deltafin_mlx.jobs.perplexity import PerplexityOptions, perplexity
from deltafin_mlx.jobs.text_windows import Windows

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


@pytest.fixture(scope="module")
def two_bit(sources, tmp_path_factory):
    """The same source as the qwen3_moe fixture, its experts at 2 bits."""
    out = tmp_path_factory.mktemp("kl2") / "qwen3_moe-2bit"
    convert(str(sources("qwen3_moe")), out, ConvertOptions(expert_bits=2, progress=False))
    return out


def kl_of(capsys, model, text, ref, *extra):
    """(the summary, its KL lines, the warning line or None)."""
    assert main(["perplexity", str(model), str(text), "--budget", "200MB", "--json",
                 "--no-progress", "--kl-divergence", str(ref), *extra]) == 0
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    warning = [l for l in lines if "warning:" in l]
    assert len(warning) <= 1
    return json.loads(out), lines[-4 if warning else -3:][:3], (warning or [None])[0]


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
    s, lines, _ = kl_of(capsys, converted("qwen3_moe"), text, ref, "-c", "48")  # the same: taken
    kl = s["kl"]
    assert kl["positions"] == s["scored_tokens"] > 100
    assert kl["mean"] == kl["median"] == kl["max"] == kl["min"] == 0.0
    assert set(kl["percentiles"]) == {"99.9", "99", "95", "90", "10", "5", "1", "0.1"}
    assert set(kl["percentiles"].values()) == {0.0}
    assert kl["same_top"] == 1.0 and kl["ln_ppl_ratio"] == 0.0 and kl["ppl_ratio"] == 1.0
    assert kl["delta_p"]["rms"] == 0.0 and kl["ppl_difference"] == 0.0
    assert abs(kl["ln_ppl_correlation"] - 1.0) < 1e-12
    assert "KL divergence from the reference (top 16 + tail, a lower bound: the top 16 held" \
        in lines[0]
    assert "mean 0.000000 ± 0.000000, median 0.000000, max 0.000000" in lines[0]
    assert "percentiles 99.9 % 0.000000, 99 % 0.000000, 95 % 0.000000, 90 % 0.000000" in lines[0]
    assert "RMS 0.000 ± 0.000 %" in lines[1] and "same top token 100.000 ± 0.000 %" in lines[1]
    assert "ratio 1.000000 ± 0.000000 (ln ratio +0.000000" in lines[2]
    assert "Cor(ln PPL) 100.00 %" in lines[2]


def test_a_2_bit_conversion_of_the_same_source_diverges(two_bit, base, capsys):
    text, ref = base
    s, lines, _ = kl_of(capsys, two_bit, text, ref)
    kl = s["kl"]
    p = kl["percentiles"]
    assert kl["mean"] > 0 and kl["max"] >= p["99.9"] >= p["99"] >= p["90"] >= kl["median"] > 0
    assert kl["median"] >= p["10"] >= p["5"] >= p["1"] >= p["0.1"] >= kl["min"] >= 0
    assert 0 < kl["same_top"] < 1.0 and kl["delta_p"]["rms"] > 0
    assert f"same top token {100 * kl['same_top']:.3f}" in lines[1]
    assert f"RMS {100 * kl['delta_p']['rms']:.3f}" in lines[1]
    assert f"ratio {kl['ppl_ratio']:.6f} ± {kl['ppl_ratio_se']:.6f}" in lines[2]


def test_the_statistics_are_llama_perplexitys(capsys):
    """kl_summary against llama-perplexity's own arithmetic (running sums of x and
    x², its covariance and uncertainties, its percentile rule) on small data."""
    rng = np.random.default_rng(3)
    n = 257
    kl = rng.gamma(0.5, 0.02, n)
    lp = -rng.gamma(2.0, 1.0, n)
    lp_base = lp + rng.normal(0, 0.1, n)
    lp_base = np.minimum(lp_base, 0)
    same = rng.random(n) < 0.9
    s = kl_summary(kl, lp, lp_base, same)

    def mean_unc(x):
        f = x.sum() / n
        return f, math.sqrt((np.sum(x * x) / n - f * f) / (n - 1))

    def pct(values, fraction):
        v = np.sort(values)
        p = fraction * (n - 1)
        i = int(p)
        return (1 - (p - i)) * v[i] + (p - i) * v[min(i + 1, n - 1)]

    nll, nll_b = -lp, -lp_base
    (q, uq), (b, ub) = mean_unc(nll), mean_unc(nll_b)
    cov = (np.sum(nll * nll_b) / n - q * b) / (n - 1)
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, abs(b))
    assert close(s["mean"], kl.mean()) and close(s["mean_se"], mean_unc(kl)[1])
    for name, fraction in (("99.9", .999), ("99", .99), ("95", .95), ("90", .9), ("10", .1),
                           ("5", .05), ("1", .01), ("0.1", .001)):
        assert close(s["percentiles"][name], pct(kl, fraction))
    assert close(s["median"], np.sort(kl)[n // 2]) and s["max"] == kl.max()
    assert close(s["ln_ppl_ratio"], q - b)
    assert close(s["ln_ppl_ratio_se"], math.sqrt(uq * uq + ub * ub - 2 * cov))
    assert close(s["ppl_ratio"], math.exp(q - b))
    assert close(s["ppl_ratio_se"], math.exp(q - b) * math.sqrt(uq * uq + ub * ub - 2 * cov))
    assert close(s["ln_ppl_correlation"], cov / (uq * ub))
    assert close(s["base_perplexity"], math.exp(b)) and close(s["base_perplexity_se"],
                                                              math.exp(b) * ub)
    ppl, ppl_b = math.exp(q), math.exp(b)
    assert close(s["ppl_difference"], ppl - ppl_b)
    assert close(s["ppl_difference_se"], math.sqrt((ppl * uq) ** 2 + (ppl_b * ub) ** 2
                                                   - 2 * ppl * ppl_b * cov))
    dp = np.exp(lp) - np.exp(lp_base)
    mse, mse_unc = mean_unc(dp * dp)
    assert close(s["delta_p"]["mean"], dp.mean()) and close(s["delta_p"]["rms"], math.sqrt(mse))
    assert close(s["delta_p"]["rms_se"], 0.5 / math.sqrt(mse) * mse_unc)
    assert close(s["delta_p"]["percentiles"]["1"], pct(dp, 0.01))
    p_top = same.sum() / n
    assert close(s["same_top"], p_top)
    assert close(s["same_top_se"], math.sqrt(p_top * (1 - p_top) / (n - 1)))


def test_the_top_ks_coverage_is_shown_and_a_loose_bound_warned_of(two_bit, base, capsys):
    """A top 16 of 512 tokens of an untrained model holds little of the mass: the
    base run and the comparison say how much, and warn in one line."""
    text, ref = base
    t = load_file(str(ref))
    mass = float(np.exp(t["top_logprobs"].astype(np.float64)).sum(-1).mean())
    assert mass < 0.9
    s, lines, warning = kl_of(capsys, two_bit, text, ref)
    assert s["kl"]["top_k_mass"] == pytest.approx(mass, abs=1e-12)
    assert s["kl"]["exact"] is False and s["kl"]["vocab"] == 512
    assert f"the top 16 held {100 * mass:.2f} % of the reference's mass" in lines[0]
    assert warning == (f"[deltafin] warning: the reference's top 16 held {100 * mass:.2f} % "
                       "of the probability mass on average (under 90 %): the KL over them "
                       "and the tail is a loose lower bound; a reference written with a "
                       "larger --kl-top-k (the vocabulary, 512, for the exact KL) tightens it")


def full_logprobs(model, tokens):
    """log_softmax of the model's plain forward pass (not the scoring path), in float64."""
    logits = model(mx.array(tokens, dtype=mx.int32)[None])[0].astype(mx.float32)
    x = np.array(logits).astype(np.float64)
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - x.max(-1, keepdims=True)


def test_the_whole_vocabulary_gives_the_exact_kl(converted, two_bit, base, tmp_path, capsys,
                                                 monkeypatch):
    """--kl-top-k 1000 on a 512-token vocabulary keeps all 512, decided before any
    pass is scored; the comparison then is the exact KL, equal to numpy's from the
    two models' full logits within 1e-5, its coverage 100 % and no warning."""
    text, _ = base
    ref = tmp_path / "full.kld.safetensors"
    asked = []
    real = perplexity_job.iter_passes

    def counted(model, items, opts, *a, **k):
        asked.append(opts.top_logprobs)
        yield from real(model, items, opts, *a, **k)

    monkeypatch.setattr(perplexity_job, "iter_passes", counted)
    assert main(["perplexity", str(converted("qwen3_moe")), str(text), "-c", "48", "--chunks",
                 "3", "--budget", "200MB", "--no-progress", "--kl-top-k", "1000",
                 "--kl-divergence-base", str(ref)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == ("[perplexity] --kl-top-k 1000 is more than this model's vocabulary of "
                      "512: keeping all 512 (the exact KL)")
    assert asked == [512]  # every pass scored with the 512 kept, none before
    assert "its top 512 held 100.00 % of the probability mass" in err[-1]
    assert load_file(str(ref))["top_ids"].shape[1] == 512
    monkeypatch.undo()

    s, lines, warning = kl_of(capsys, two_bit, text, ref)
    kl = s["kl"]
    assert kl["exact"] is True and warning is None
    assert "(exact: the whole vocabulary of 512; 72 positions)" in lines[0]
    tokens = load_file(str(ref))["tokens"].tolist()
    want = []
    for path in (converted("qwen3_moe"), two_bit):
        model, _ = load(path, "200MB", warm_start=False)
        try:
            want.append(np.concatenate([full_logprobs(model, tokens[w * 48:(w + 1) * 48])[23:47]
                                        for w in range(3)]))
        finally:
            runtime(model).close()
    p, q = want
    exact = (np.exp(p) * (p - q)).sum(-1)
    assert kl["positions"] == exact.size == 72
    assert abs(kl["mean"] - exact.mean()) < 1e-5
    assert abs(kl["max"] - exact.max()) < 1e-5 and abs(kl["median"] - np.median(exact)) < 1e-5


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
    with pytest.raises(SystemExit) as exit:
        main(["perplexity", str(converted("qwen3_moe")), str(text), "--kl-divergence"])
    assert exit.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["deltafin-run perplexity: error: --kl-divergence needs REF, the reference a "
                   "run of the base model wrote with --kl-divergence-base REF (see deltafin-run "
                   "perplexity --help)"]


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


def test_a_comparison_kept_in_an_output_resumes_to_the_same_statistics(two_bit, base, tmp_path,
                                                                       capsys):
    text, ref = base
    out = tmp_path / "windows.jsonl"
    first, _, _ = kl_of(capsys, two_bit, text, ref, "-o", str(out))
    again, _, _ = kl_of(capsys, two_bit, text, ref, "-o", str(out))
    assert first["windows_resumed"] == 0 and again["windows_resumed"] == again["windows"] > 3
    assert again["sweeps"] == 0 and again["kl"] == first["kl"]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(line["id"] for line in lines) == list(range(first["windows"]))
    assert set(lines[0]) == {"id", "token_logprobs", "top1", "kl"}
