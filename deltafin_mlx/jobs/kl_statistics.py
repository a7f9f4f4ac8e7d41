"""The KL divergence of a model's next-token distributions from a reference's,
per position over the reference's top K and the tail (a lower bound of the KL over
the whole vocabulary, as loose as the tail is heavy; exact when K is the whole
vocabulary), and llama-perplexity's --kl-divergence statistics over them."""

import math
from typing import Optional, Tuple

import numpy as np

from deltafin_mlx.generation.logprobs import tail_logprob


def kl_rows(p_log: np.ndarray, p_tail: np.ndarray, q_log: np.ndarray, exact: bool
            ) -> np.ndarray:
    """KL(base || this) per row over the base's top K (`p_log`, this model's
    log-probabilities of the same ids `q_log`) and the tail; `exact`: the K ids are
    the whole vocabulary, so there is no tail (what the base's rows leave of 1 is
    rounding)."""
    p, q = p_log.astype(np.float64), q_log.astype(np.float64)
    kl = (np.exp(p) * (p - q)).sum(axis=-1)
    if not exact:
        p_t, q_t = p_tail.astype(np.float64), tail_logprob(q_log).astype(np.float64)
        kl = kl + np.exp(p_t) * (p_t - q_t)
    return np.maximum(kl, 0.0)  # rounding can leave -1e-9 where the two agree



PERCENTILES = (99.9, 99, 95, 90, 10, 5, 1, 0.1)  # llama-perplexity's, as it prints them
COVERAGE_WARNING = 0.9  # a top K holding less of the mass: the KL is a loose lower bound


def mean_se(x: np.ndarray) -> Tuple[float, float]:
    """The mean and its standard error (llama-perplexity's and mlx_lm.perplexity's)."""
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else 0.0


def spread(x: np.ndarray) -> dict:
    """Median, extremes and PERCENTILES (linear between ranks, as llama-perplexity's)."""
    return {"median": float(np.median(x)), "max": float(x.max()), "min": float(x.min()),
            "percentiles": {f"{p:g}": float(np.percentile(x, p)) for p in PERCENTILES}}


def kl_summary(kl: np.ndarray, token_logprobs: np.ndarray, base_logprobs: np.ndarray,
               same_top: np.ndarray) -> dict:
    """llama-perplexity's --kl-divergence statistics, per scored position: the KL's
    mean and spread; Δp, this model's probability of the text's token less the
    base's (mean, RMS, spread); how often the most likely tokens agree; the two
    perplexities, their ratio, difference and ln ratio with llama-perplexity's
    uncertainties, and the correlation of the two models' per-token ln PPL."""
    n = kl.size
    nll, nll_base = -token_logprobs.astype(np.float64), -base_logprobs.astype(np.float64)
    (ln_q, se_q), (ln_b, se_b) = mean_se(nll), mean_se(nll_base)
    cov = float(np.cov(nll, nll_base)[0, 1]) / n if n > 1 else 0.0  # of the two means
    ppl, ppl_base = math.exp(min(ln_q, 700)), math.exp(min(ln_b, 700))
    ln_ratio_se = math.sqrt(max(se_q ** 2 + se_b ** 2 - 2 * cov, 0.0))
    corr = float(np.corrcoef(nll, nll_base)[0, 1]) if n > 1 and se_q and se_b else None
    dp = np.exp(-nll) - np.exp(-nll_base)
    dp_mean, dp_se = mean_se(dp)
    mse, mse_se = mean_se(dp ** 2)
    rms = math.sqrt(mse)
    kl_mean, kl_se = mean_se(kl)
    agree = float(same_top.mean())
    return {"positions": n, "mean": kl_mean, "mean_se": kl_se, **spread(kl),
            "delta_p": {"mean": dp_mean, "mean_se": dp_se, "rms": rms,
                        "rms_se": 0.5 / rms * mse_se if rms > 0 else 0.0, **spread(dp)},
            "same_top": agree,
            "same_top_se": math.sqrt(agree * (1 - agree) / (n - 1)) if n > 1 else 0.0,
            "base_perplexity": ppl_base, "base_perplexity_se": ppl_base * se_b,
            "ln_ppl_ratio": ln_q - ln_b, "ln_ppl_ratio_se": ln_ratio_se,
            "ppl_ratio": math.exp(min(ln_q - ln_b, 700)),
            "ppl_ratio_se": math.exp(min(ln_q - ln_b, 700)) * ln_ratio_se,
            "ppl_difference": ppl - ppl_base,
            "ppl_difference_se": math.sqrt(max((ppl * se_q) ** 2 + (ppl_base * se_b) ** 2
                                               - 2 * ppl * ppl_base * cov, 0.0)),
            "ln_ppl_correlation": corr}


def coverage_warning(s: dict) -> Optional[str]:
    """One line when the top K of a reference (written now, or compared with) held
    less than COVERAGE_WARNING of the mass on average: its KL is a loose bound."""
    if "kl" in s and not s["kl"]["exact"] and s["kl"]["top_k_mass"] < COVERAGE_WARNING:
        k, mass = s["kl"]["top_k"], s["kl"]["top_k_mass"]
        vocab = s["kl"]["vocab"]
    elif s.get("kl_base_top_k_mass", 1.0) < COVERAGE_WARNING:
        k, mass, vocab = s["kl_base_top_k"], s["kl_base_top_k_mass"], None
    else:
        return None
    return (f"warning: the reference's top {k} held {100 * mass:.2f} % of the probability "
            f"mass on average (under {100 * COVERAGE_WARNING:.0f} %): the KL over them and the "
            f"tail is a loose lower bound; a reference written with a larger --kl-top-k "
            f"(the vocabulary{f', {vocab},' if vocab else ''} for the exact KL) tightens it")

