"""Perplexity of a text file, and the KL divergence of a model's next-token
distributions from a reference run's: `deltafin-run perplexity MODEL FILE`.

The file's tokens are cut into windows of `context` tokens, as llama-perplexity
and mlx_lm.perplexity cut them, and each window is scored as a "tokens" line of a
score job would be (jobs/score.py): the windows are packed into passes, and one
sweep over the experts serves every window of a pass.

    stride None (llama-perplexity's default): windows side by side (the text's
        first context x (tokens // context) tokens); each window scores its second
        half, the first half being context only.
    stride S (llama-perplexity's --ppl-stride): a window starts every S tokens and
        scores its last S tokens, so every token after the first window's context
        is scored once; S = context scores every token of side-by-side windows but
        the first of each (mlx_lm.perplexity's rule).

Perplexity is exp(mean NLL of the scored tokens); its standard error is
mlx_lm.perplexity's: perplexity x the standard error of the mean NLL.

A long text is a long job: each window's scores are kept as its pass finishes,
with `output` in a JSONL file (one line a window, docs/FORMAT.md) appended, locked
and resumed by score's rule (jobs/results_file.py `Results`, jobs/job_options.py),
so a rerun scores only the windows it lacks and ends with the value a run never
stopped gives; a Ctrl-C raises `Interrupted` with the estimate so far.

KL divergence (llama-perplexity's --kl-divergence-base / --kl-divergence): a base
run writes, for every scored position, the top K next tokens and their
log-probabilities, the log of the mass outside them (the tail) and the scored
token's log-probability (docs/FORMAT.md, "KL reference"); a run of another
conversion of the same model against that file reports KL(base || this) per
position over the K + 1 bins (the top K of the base and the tail: a lower bound of
the KL over the whole vocabulary, as loose as the tail is heavy, so the mass the
top K held is shown, and warned of under COVERAGE_WARNING); with K the whole
vocabulary there is no tail and the KL is exact. Its statistics are
llama-perplexity's (`kl_summary`).
"""

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from deltafin_mlx.units import count, human_bytes, is_int
from deltafin_mlx.errors import JobError
from deltafin_mlx.jobs.job_options import check_options
from deltafin_mlx.jobs.outcome import Outcome
from deltafin_mlx.jobs.progress import Progress
from deltafin_mlx.jobs.score import ScoreOptions, iter_passes
from deltafin_mlx.jobs.score_lines import ScoreItem
from deltafin_mlx.jobs.results_file import LINE_MAX_BYTES, Results, open_regular, read_regular
from deltafin_mlx.jobs.score_results import write_safetensors
from deltafin_mlx.format.safetensors import header_length, parse_header
from deltafin_mlx.generation.logprobs import tail_logprob
from deltafin_mlx.model.modules import model_vocab

REFERENCE_KIND = "deltafin-kl-reference"
# Far above the texts perplexity is measured on (wikitext-2's test set: 1.3 MB);
# a text's tokens are held as Python ints, several times its bytes.
TEXT_MAX_BYTES = 64 << 20
# A reference's five tensors and its windows: a header of a few hundred bytes.
REFERENCE_HEADER_MAX_BYTES = 1 << 16
# name: (dtype, dimensions) of a reference's tensors (docs/FORMAT.md).
REFERENCE_TENSORS = {"tokens": ("I32", 1), "top_ids": ("I32", 2), "top_logprobs": ("F32", 2),
                     "tail_logprob": ("F32", 1), "token_logprobs": ("F32", 1)}


@dataclass
class Windows:
    context: int  # tokens per window
    stride: Optional[int] = None  # None: side by side, second half scored

    def check(self):
        if self.context < 2:
            raise JobError(f"-c/--context must be 2 or more (got {self.context})")
        if self.stride is not None and not 1 <= self.stride <= self.context:
            raise JobError(f"--stride must be between 1 and the context, {self.context} "
                             f"(got {self.stride})")

    @property
    def step(self) -> int:
        return self.context if self.stride is None else self.stride

    @property
    def first_scored(self) -> int:
        """The first position of a window that is scored (the ones before it are
        context only; position 0 has no prediction)."""
        if self.stride is None:
            return self.context // 2
        return max(1, self.context - self.stride)

    def starts(self, n_tokens: int, limit: Optional[int] = None) -> List[int]:
        starts = list(range(0, n_tokens - self.context + 1, self.step))
        return starts[:limit] if limit else starts


@dataclass
class PerplexityOptions:
    windows: Windows  # with kl_reference, the reference's (a stride left None: its own)
    chunks: Optional[int] = None  # at most this many windows (llama-perplexity's --chunks)
    max_pass_tokens: Optional[int] = None  # tokens per pass at most (None: the plan's)
    kl_base: Optional[str] = None  # write the reference distributions here
    kl_reference: Optional[str] = None  # compare with the distributions written here
    top_k: int = 32  # the base's top K per position (beyond the vocabulary: all of it)
    output: Optional[str] = None  # each window's scores, appended; a rerun resumes from it

    def recorded(self, text: str) -> dict:
        """What the windows' scores depend on, by flag (jobs/job_options.py)."""
        return {"-c": self.windows.context, "--stride": self.windows.stride,
                "--chunks": self.chunks, "--kl-top-k": self.top_k if self.kl_base else None,
                "--kl-divergence-base": self.kl_base, "--kl-divergence": self.kl_reference,
                "FILE (sha256)": hashlib.sha256(text.encode("utf-8")).hexdigest()}


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


def window_items(tokens: List[int], windows: Windows, chunks: Optional[int] = None
                 ) -> List[ScoreItem]:
    """One ScoreItem per window: its tokens, the positions it scores."""
    starts = windows.starts(len(tokens), chunks)
    if not starts:
        raise JobError(f"the text has {len(tokens)} tokens, fewer than one window of "
                         f"{windows.context} (-c)")
    return [ScoreItem.scored_from(i, tokens[s : s + windows.context], windows.first_scored)
            for i, s in enumerate(starts)]


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
        write_reference(opts.kl_base, tokens[: summary["tokens"]], opts,
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
    try:  # the options first: another run's lines are refused by them, not line by line
        note = check_options(opts.output, opts.recorded(text),
                             started=os.fstat(out.fd).st_size > 0)
        out.scan(on_record=keep)
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
    mean = float(losses.mean()) if losses.size else float("nan")
    se = float(losses.std(ddof=1) / math.sqrt(losses.size)) if losses.size > 1 else 0.0
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


@dataclass
class Reference:
    windows: Windows
    chunks: Optional[int]
    tokens: np.ndarray  # (tokens covered,) int32
    top_ids: np.ndarray  # (scored positions, K) int32, best first
    top_logprobs: np.ndarray  # (scored positions, K) float32
    tail_logprob: np.ndarray  # (scored positions,) float32
    token_logprobs: np.ndarray  # (scored positions,) float32


def write_reference(path, tokens, opts: PerplexityOptions, top_ids, top_logprobs, token_logprobs):
    """The base's distributions as one safetensors file (docs/FORMAT.md)."""
    top_logprobs = top_logprobs.astype(np.float32)
    write_safetensors(Path(path), {
        "tokens": np.asarray(tokens, np.int32),
        "top_ids": top_ids.astype(np.int32),
        "top_logprobs": top_logprobs,
        "tail_logprob": tail_logprob(top_logprobs),
        "token_logprobs": token_logprobs.astype(np.float32),
    }, metadata={"kind": REFERENCE_KIND, "context": str(opts.windows.context),
                 "stride": str(opts.windows.stride or 0), "chunks": str(opts.chunks or 0)})


def _reference_header(f, path):
    """The checked header of the safetensors file `f` (format/safetensors.py) and its
    metadata, which must say it is a KL reference."""
    size = os.fstat(f.fileno()).st_size
    n = header_length(path, f.read(8), size, JobError)
    if n > REFERENCE_HEADER_MAX_BYTES:
        raise ValueError(f"a header of {n} bytes")
    raw = f.read(n)
    entries = parse_header(path, raw, size, JobError)
    meta = json.loads(raw).get("__metadata__")
    if not isinstance(meta, dict) or meta.get("kind") != REFERENCE_KIND:
        raise ValueError("not a KL reference")
    return entries, meta


def read_reference(path) -> Reference:
    """The reference at `path`, checked whole before anything uses it: a regular file,
    its tensors of the dtypes and shapes written (as many positions as its windows
    score), ids not negative (the vocabulary is the model's: `perplexity` checks
    them against it), log-probabilities finite and not positive."""
    f = os.fdopen(open_regular(path, os.O_RDONLY, "KL reference"), "rb")
    try:
        with f:
            entries, meta = _reference_header(f, path)
            t = {}
            for name, (dtype, dims) in REFERENCE_TENSORS.items():
                e = entries.get(name)
                if e is None or e.dtype != dtype or len(e.shape) != dims:
                    raise ValueError(f"no {dims}-d {dtype} tensor {name}")
                f.seek(e.offset)
                t[name] = np.fromfile(f, f"<{dtype[0].lower()}4", math.prod(e.shape)
                                      ).reshape(e.shape)
        windows = Windows(int(meta["context"]), int(meta["stride"]) or None)
        chunks = int(meta["chunks"]) or None
        windows.check()
        starts = windows.starts(len(t["tokens"]), chunks)
        n, k = t["top_ids"].shape
        if (not starts or starts[-1] + windows.context != len(t["tokens"]) or k < 1
                or (chunks or 1) < 1
                or n != len(starts) * (windows.context - windows.first_scored)
                or t["top_logprobs"].shape != (n, k)
                or not t["tail_logprob"].shape == t["token_logprobs"].shape == (n,)):
            raise ValueError("its tensors' shapes are not those of its windows")
        if (t["top_ids"] < 0).any():
            raise ValueError("a negative token id")
        for x in ("top_logprobs", "tail_logprob", "token_logprobs"):
            if not (np.isfinite(t[x]).all() and (t[x] <= 0).all()):
                raise ValueError(f"{x} holds a value that is not a log-probability")
    except (OSError, ValueError, TypeError, KeyError) as e:
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise JobError(f"{path}: not a KL reference written by --kl-divergence-base "
                       f"({why})") from None
    return Reference(windows, chunks, t["tokens"], t["top_ids"], t["top_logprobs"],
                     t["tail_logprob"], t["token_logprobs"])


def check_reference_output(path, text=None, model_dir=None):
    """Refuse a --kl-divergence-base REF that would replace what is not a reference:
    the text, a file or folder of the model's (its config, its tokenizer), or any
    existing file but a KL reference written here; and one that could not be written
    (its folder missing or read-only): refused now, not after the scoring."""
    real = os.path.realpath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)):
        raise JobError(f"{path}: {folder} is not a folder this run can write the reference "
                       "in; give a path in one")
    for given, what in ((text, "the text measured"), (model_dir, "in the model directory")):
        if given is not None and os.path.commonpath([os.path.realpath(given), real]) == \
                os.path.realpath(given):
            raise JobError(f"{path}: this is {what} ({given}); write the reference to "
                           "another file")
    if not os.path.lexists(path):
        return
    try:
        with os.fdopen(open_regular(path, os.O_RDONLY, "KL reference"), "rb") as f:
            _reference_header(f, path)
    except (OSError, ValueError):
        raise JobError(f"{path}: exists and is not a KL reference; --kl-divergence-base "
                       "replaces only a reference: give a new file") from None


def reference_windows(ref: Reference, path, context: Optional[int] = None,
                      stride: Optional[int] = None, chunks: Optional[int] = None):
    """The windows and chunks a run against the reference at `path` scores: its own;
    any other given (not None), by the command's flags or the library's options, is refused."""
    for flag, given, theirs in (("-c", context, ref.windows.context),
                                ("--stride", stride, ref.windows.stride),
                                ("--chunks", chunks, ref.chunks)):
        if given is not None and given != theirs:
            raise JobError(f"{flag} {given}: {path} was written with {flag} "
                           f"{theirs or 'unset'}, and --kl-divergence scores the windows "
                           f"of its reference (leave {flag} out)")
    return ref.windows, ref.chunks


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
