"""Perplexity of a text file, and the KL divergence of a model's next-token
distributions from a reference run's: `deltafin-run perplexity MODEL FILE`.

The file's tokens are cut into windows (jobs/text_windows.py), each scored as a
"tokens" line of a score job would be: the windows are packed into passes, and one
sweep over the experts serves every window of a pass.

Perplexity is exp(mean NLL of the scored tokens); its standard error is
mlx_lm.perplexity's: perplexity x the standard error of the mean NLL.

A long text is a long job: each window's scores are kept as its pass finishes,
with `output` in a JSONL file (one line a window, docs/FORMAT.md) appended, locked
and resumed by score's rule (jobs/results_file.py `Results`, jobs/job_options.py),
so a rerun scores only the windows it lacks and ends with the value a run never
stopped gives; a Ctrl-C raises `Interrupted` with the estimate so far.

KL divergence (llama-perplexity's --kl-divergence-base / --kl-divergence): a base
run writes a reference (jobs/kl_reference.py); a run of another conversion of the
same model against it reports KL(base || this) and llama-perplexity's statistics
(jobs/kl_statistics.py), with the mass the reference's top K held.
"""

import hashlib
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from deltafin_mlx.units import count, human_bytes, is_int
from deltafin_mlx.errors import JobError
from deltafin_mlx.jobs.job_options import activation_record, check_options
from deltafin_mlx.jobs.outcome import Outcome
from deltafin_mlx.jobs.progress import Progress
from deltafin_mlx.jobs.score import ScoreOptions, iter_passes
from deltafin_mlx.jobs.kl_reference import (check_reference_output, read_reference,
                                             reference_windows, write_reference)
from deltafin_mlx.jobs.kl_statistics import kl_rows, kl_summary, mean_se
from deltafin_mlx.jobs.results_file import LINE_MAX_BYTES, Results, read_regular
from deltafin_mlx.jobs.text_windows import Windows, window_items
from deltafin_mlx.model.modules import model_vocab

# Far above the texts perplexity is measured on (wikitext-2's test set: 1.3 MB);
# a text's tokens are held as Python ints, several times its bytes.
TEXT_MAX_BYTES = 64 << 20


@dataclass
class PerplexityOptions:
    windows: Windows  # with kl_reference, the reference's (a stride left None: its own)
    chunks: Optional[int] = None  # at most this many windows (llama-perplexity's --chunks)
    max_pass_tokens: Optional[int] = None  # tokens per pass at most (None: the plan's)
    kl_base: Optional[str] = None  # write the reference distributions here
    kl_reference: Optional[str] = None  # compare with the distributions written here
    top_k: int = 32  # the base's top K per position (beyond the vocabulary: all of it)
    output: Optional[str] = None  # each window's scores, appended; a rerun resumes from it
    activation_dtype: str = "auto"  # the model's load option, as given

    def recorded(self, text: str) -> dict:
        """What the windows' scores depend on, by flag (jobs/job_options.py)."""
        return {"-c": self.windows.context, "--stride": self.windows.stride,
                "--chunks": self.chunks, "--kl-top-k": self.top_k if self.kl_base else None,
                "--kl-divergence-base": self.kl_base, "--kl-divergence": self.kl_reference,
                "FILE (sha256)": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                **activation_record(self.activation_dtype)}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C in `perplexity`: `summary` is the estimate of the windows scored
    before it (with `output`, kept there for a rerun to resume from)."""

    def __init__(self, summary: dict):
        super().__init__()
        self.summary = summary


def read_text(path) -> str:
    try:
        return read_regular(path, "text", TEXT_MAX_BYTES).decode("utf-8")
    except UnicodeDecodeError as e:
        raise JobError(f"{path}: not UTF-8 text (byte {e.start}); perplexity reads a text "
                         "file") from None


# An id and a log-probability in a JSON line at most ("12345678, -1.2345678901234567e-05, ").
PAIR_JSON_BYTES = 40
# A window's line in OUTPUT (docs/FORMAT.md): name -> dtype, per scored position.
WINDOW_FIELDS = {"token_logprobs": np.float32, "top_ids": np.int64,
                 "top_logprobs": np.float32, "top1": np.int64, "kl": np.float64}


def window_record(line: dict, windows: int, n: int, fields) -> Tuple[int, dict]:
    """(window, its arrays) of an OUTPUT line, checked: a window of this run, each
    field of `fields` n rows (ValueError otherwise)."""
    w = line["id"]
    if not is_int(w) or not 0 <= w < windows or set(line) != {"id", *fields}:
        raise ValueError("not a window of this run")
    rec = {f: np.asarray(line[f], WINDOW_FIELDS[f]) for f in fields}
    if any(len(a) != n for a in rec.values()):
        raise ValueError("not a window of this run")
    return w, rec


def perplexity(model, tokenizer, text: str, opts: PerplexityOptions,
               show_progress: bool = False, progress_lines: bool = False) -> dict:
    """The perplexity summary of `text` (and with opts.kl_reference, the KL one).
    Each window's scores are kept as its pass finishes (in opts.output, if given:
    a rerun scores only the windows it lacks); a Ctrl-C raises `Interrupted` with
    the summary of the windows scored so far. `progress_lines`: the progress and
    running perplexity as a line per window, not one line redrawn (a log)."""
    opts.windows.check()
    if opts.kl_base and opts.kl_reference:
        raise JobError("--kl-divergence-base writes a reference and --kl-divergence "
                         "compares with one: give one of them")
    if opts.top_k < 1:
        raise JobError(f"--kl-top-k must be 1 or more (got {opts.top_k})")
    if opts.kl_base:
        check_reference_output(opts.kl_base)
    tokens = [int(t) for t in tokenizer.encode(text)]
    vocab = model_vocab(model)
    reference = None
    if opts.kl_reference:
        reference = read_reference(opts.kl_reference)
        if reference.top_ids.max() >= vocab:  # gathered unchecked, in the passes
            raise JobError(f"{opts.kl_reference}: token id {reference.top_ids.max()} is "
                           f"outside this model's vocabulary (0 to {vocab - 1})")
        opts.windows, opts.chunks = reference_windows(reference, opts.kl_reference,
                                                      opts.windows.context,
                                                      opts.windows.stride, opts.chunks)
        if tokens[: len(reference.tokens)] != reference.tokens.tolist():
            raise JobError(f"{opts.kl_reference}: its tokens are not this text's (another "
                             "text, or a tokenizer that splits it otherwise)")
    kept = min(opts.top_k, vocab)  # the options record keeps the K asked for
    if opts.kl_base and opts.top_k > vocab:
        print(f"[perplexity] --kl-top-k {opts.top_k} is more than this model's vocabulary "
              f"of {vocab}: keeping all {vocab} (the exact KL)", file=sys.stderr)
    items = window_items(tokens, opts.windows, opts.chunks)
    first = opts.windows.first_scored
    n = len(items[0].tokens) - first  # scored tokens per window
    fields = ["token_logprobs"] + (["top_ids", "top_logprobs"] if opts.kl_base else []) + \
        (["top1", "kl"] if reference is not None else [])
    if opts.output and opts.kl_base and n * kept * PAIR_JSON_BYTES > LINE_MAX_BYTES:
        raise JobError(f"-o {opts.output} with --kl-top-k {kept}: a window's line would hold "
                       f"{n} x {kept} ids and log-probabilities, more than the "
                       f"{human_bytes(LINE_MAX_BYTES)} a line may have; give a smaller "
                       "--kl-top-k or -c, or leave -o out")
    done = {}  # window -> its arrays (WINDOW_FIELDS)
    out = resume(opts, text, len(items), n, fields, done)
    exact = reference is not None and reference.top_ids.shape[1] >= vocab
    resumed = len(done)
    todo = [it for it in items if it.id not in done]
    at_ids = None
    if reference is not None:
        at_ids = [reference.top_ids[it.id * n : (it.id + 1) * n] for it in todo]
    top_k = kept if opts.kl_base else (1 if reference is not None else 0)
    score_opts = ScoreOptions(top_logprobs=top_k, max_pass_tokens=opts.max_pass_tokens)
    passes = []
    progress = Progress(len(items), len(done), show_progress, Outcome("perplexity"),
                        items="windows", every_line=progress_lines)
    logprob = sum(float(r["token_logprobs"].astype(np.float64).sum()) for r in done.values())
    start = time.perf_counter()
    try:
        for results, stats in iter_passes(model, todo, score_opts, at_ids):
            passes.append(stats)
            for s in results:
                w, rec = s.item.id, {"token_logprobs": s.token_logprobs[first:]}
                if opts.kl_base:
                    rec.update(top_ids=s.top_ids[first:], top_logprobs=s.top_logprobs[first:])
                if reference is not None:
                    rows = slice(w * n, (w + 1) * n)
                    rec.update(top1=s.top_ids[first:, 0], kl=kl_rows(
                        reference.top_logprobs[rows], reference.tail_logprob[rows],
                        s.at_logprobs, exact))
                if out is not None:
                    out.write({"id": w, **{f: rec[f].tolist() for f in fields}})
                done[w] = rec
                logprob += float(rec["token_logprobs"].astype(np.float64).sum())
                progress.tokens += n
                running = math.exp(min(-logprob / (len(done) * n), 700))
                progress.status = f", perplexity {running:.4f}"
                progress.finished({})
    except KeyboardInterrupt:
        raise Interrupted(summarize(opts, tokens, items, done, resumed, passes, start,
                                    reference, vocab, exact, interrupted=True)) from None
    finally:
        progress.close()
        if out is not None:
            out.close()
    summary = summarize(opts, tokens, items, done, resumed, passes, start, reference, vocab,
                        exact)
    if opts.kl_base:
        rows = [done[w] for w in range(len(items))]
        write_reference(opts.kl_base, tokens[: summary["tokens"]], opts.windows, opts.chunks,
                        np.concatenate([r["top_ids"] for r in rows]),
                        np.concatenate([r["top_logprobs"] for r in rows]),
                        np.concatenate([r["token_logprobs"] for r in rows]))
        summary["kl_base"] = str(opts.kl_base)
    return summary


def resume(opts: PerplexityOptions, text: str, windows: int, n: int, fields, done: dict):
    """opts.output opened (locked) and the windows it holds read into `done`, its
    options record checked or written (jobs/job_options.py); None without one."""
    if opts.output is None:
        return None

    def keep(line):
        w, rec = window_record(line, windows, n, fields)
        done[w] = rec

    out = Results(opts.output)
    try:  # another run's record refuses its lines first; a file of other lines writes none
        started = os.fstat(out.fd).st_size > 0
        check_options(opts.output, opts.recorded(text), started, record=False)
        out.scan(on_record=keep)
        note = check_options(opts.output, opts.recorded(text), started)
    except BaseException:
        out.close()
        raise
    if note:
        print(f"[perplexity] {note}", file=sys.stderr)
    return out


def summarize(opts: PerplexityOptions, tokens, items, done: dict, resumed: int, passes,
              start, reference, vocab: int, exact: bool, interrupted: bool = False) -> dict:
    """The summary of the windows `done` (all of them, unless `interrupted`), of which
    `resumed` were read from opts.output."""
    seconds = time.perf_counter() - start
    order = sorted(done)
    cat = lambda f: np.concatenate([done[w][f] for w in order]) if order else np.zeros(0)
    token_lp = cat("token_logprobs").astype(np.float64)
    losses = -token_lp
    mean, se = mean_se(losses) if losses.size else (float("nan"), 0.0)
    ppl = None if not losses.size else math.exp(mean) if mean < 700 else float("inf")
    covered = opts.windows.starts(len(tokens), opts.chunks)[-1] + opts.windows.context
    n = len(items[0].tokens) - opts.windows.first_scored
    summary = {"windows": len(items), "windows_done": len(done),
               "windows_resumed": resumed,
               "interrupted": interrupted, "context": opts.windows.context,
               "stride": opts.windows.stride, "first_scored": opts.windows.first_scored,
               "text_tokens": len(tokens), "tokens": covered, "scored_tokens": int(losses.size),
               "mean_nll": mean if losses.size else None, "perplexity": ppl,
               "perplexity_se": None if ppl is None else ppl * se,
               "sweeps": sum(p.passes for p in passes),
               "expert_bytes_read": sum(p.expert_bytes_read for p in passes),
               "union_bytes": sum(p.union_bytes for p in passes), "seconds": seconds,
               "tokens_per_second": (len(done) - resumed) * n / seconds if seconds > 0 else 0.0,
               "passes": [(p.expert_bytes_read, p.union_bytes) for p in passes]}
    if opts.kl_base and order:
        summary["kl_base_top_k"] = min(opts.top_k, vocab)
        summary["kl_base_top_k_mass"] = float(np.exp(
            cat("top_logprobs").astype(np.float64)).sum(axis=-1).mean())
    if reference is not None and order:
        rows = np.concatenate([np.arange(w * n, (w + 1) * n) for w in order])
        summary["kl"] = kl_summary(cat("kl"), token_lp,
                                   reference.token_logprobs[rows].astype(np.float64),
                                   cat("top1") == reference.top_ids[rows, 0])
        summary["kl"].update(top_k=int(reference.top_ids.shape[1]), vocab=vocab, exact=exact,
                             top_k_mass=float(np.exp(reference.top_logprobs[rows].astype(
                                 np.float64)).sum(axis=-1).mean()))
    return summary


def summary_lines(s: dict) -> List[str]:
    stride = "side by side, second half scored" if s["stride"] is None else f"stride {s['stride']}"
    value = "no window scored yet" if s["perplexity"] is None else (
        f"perplexity {s['perplexity']:.4f} ± {s['perplexity_se']:.4f} (mean NLL "
        f"{s['mean_nll']:.4f})")
    if s["interrupted"]:
        value = f"interrupted after {s['windows_done']} of them: {value} so far"
    resumed = f"{s['windows_resumed']} read from the output, " if s["windows_resumed"] else ""
    lines = [f"{s['windows']} windows of {s['context']} tokens ({stride}; scored from position "
             f"{s['first_scored']}), {s['tokens']} of the text's {s['text_tokens']} tokens, "
             f"{s['scored_tokens']} scored: {value}; {resumed}{count(s['sweeps'], 'sweep')}, "
             f"experts read {s['expert_bytes_read'] / 1e6:.1f} MB (union bound "
             f"{s['union_bytes'] / 1e6:.1f} MB); {s['tokens_per_second']:.1f} tok/s in "
             f"{s['seconds']:.1f} s"]
    if "kl_base" in s:
        lines.append(f"KL reference written to {s['kl_base']} ({s['scored_tokens']} positions; "
                     f"its top {s['kl_base_top_k']} held {100 * s['kl_base_top_k_mass']:.2f} % "
                     "of the probability mass on average)")
    if "kl" in s:
        k, d = s["kl"], s["kl"]["delta_p"]
        bins = (f"exact: the whole vocabulary of {k['vocab']}" if k["exact"] else
                f"top {k['top_k']} + tail, a lower bound: the top {k['top_k']} held "
                f"{100 * k['top_k_mass']:.2f} % of the reference's mass")
        cuts = ", ".join(f"{p} % {v:.6f}" for p, v in k["percentiles"].items())
        corr = "n/a" if k["ln_ppl_correlation"] is None else \
            f"{100 * k['ln_ppl_correlation']:.2f} %"
        lines += [f"KL divergence from the reference ({bins}; {k['positions']} positions): "
                  f"mean {k['mean']:.6f} ± {k['mean_se']:.6f}, median {k['median']:.6f}, "
                  f"max {k['max']:.6f}, min {k['min']:.6f}; percentiles {cuts}",
                  f"Δp (this model's probability of the text's token less the reference's): "
                  f"mean {100 * d['mean']:.3f} ± {100 * d['mean_se']:.3f} %, RMS "
                  f"{100 * d['rms']:.3f} ± {100 * d['rms_se']:.3f} %, max {100 * d['max']:.3f} %, "
                  f"min {100 * d['min']:.3f} %; same top token {100 * k['same_top']:.3f} ± "
                  f"{100 * k['same_top_se']:.3f} %",
                  f"perplexity {s['perplexity']:.4f} against the reference's "
                  f"{k['base_perplexity']:.4f} ± {k['base_perplexity_se']:.4f}: ratio "
                  f"{k['ppl_ratio']:.6f} ± {k['ppl_ratio_se']:.6f} (ln ratio "
                  f"{k['ln_ppl_ratio']:+.6f} ± {k['ln_ppl_ratio_se']:.6f}), difference "
                  f"{k['ppl_difference']:+.6f} ± {k['ppl_difference_se']:.6f}; "
                  f"Cor(ln PPL) {corr}"]
    return lines
