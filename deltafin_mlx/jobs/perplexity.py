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

KL divergence (llama-perplexity's --kl-divergence-base / --kl-divergence): a base
run writes, for every scored position, the top K next tokens and their
log-probabilities, the log of the mass outside them (the tail) and the scored
token's log-probability (docs/FORMAT.md, "KL reference"); a run of another
conversion of the same model against that file reports KL(base || this) per
position over the K + 1 bins (the top K of the base and the tail; a lower bound of
the KL over the whole vocabulary, and equal to it as K covers the mass), its
mean, median, 99th percentile and maximum, and how often the two models' most
likely tokens agree.
"""

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np

from deltafin_mlx.units import count
from deltafin_mlx.errors import JobError
from deltafin_mlx.jobs.outcome import Outcome
from deltafin_mlx.jobs.progress import Progress
from deltafin_mlx.jobs.score import ScoreOptions, iter_passes
from deltafin_mlx.jobs.score_lines import ScoreItem
from deltafin_mlx.jobs.results_file import open_regular, read_regular
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
    top_k: int = 32  # the base's top K per position


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


def perplexity(model, tokenizer, text: str, opts: PerplexityOptions,
               show_progress: bool = False) -> dict:
    """The perplexity summary of `text` (and with opts.kl_reference, the KL one)."""
    opts.windows.check()
    if opts.kl_base and opts.kl_reference:
        raise JobError("--kl-divergence-base writes a reference and --kl-divergence "
                         "compares with one: give one of them")
    if opts.top_k < 1:
        raise JobError(f"--kl-top-k must be 1 or more (got {opts.top_k})")
    if opts.kl_base:
        check_reference_output(opts.kl_base)
    tokens = [int(t) for t in tokenizer.encode(text)]
    reference = None
    if opts.kl_reference:
        reference = read_reference(opts.kl_reference)
        vocab = model_vocab(model)
        if reference.top_ids.max() >= vocab:  # gathered unchecked, in the passes
            raise JobError(f"{opts.kl_reference}: token id {reference.top_ids.max()} is "
                           f"outside this model's vocabulary (0 to {vocab - 1})")
        opts.windows, opts.chunks = reference_windows(reference, opts.kl_reference,
                                                      opts.windows.context,
                                                      opts.windows.stride, opts.chunks)
        if tokens[: len(reference.tokens)] != reference.tokens.tolist():
            raise JobError(f"{opts.kl_reference}: its tokens are not this text's (another "
                             "text, or a tokenizer that splits it otherwise)")
    items = window_items(tokens, opts.windows, opts.chunks)
    n = len(items[0].tokens) - opts.windows.first_scored  # scored tokens per window
    at_ids = None
    if reference is not None:
        at_ids = [reference.top_ids[i * n : (i + 1) * n] for i in range(len(items))]
    top_k = opts.top_k if opts.kl_base else (1 if reference is not None else 0)
    score_opts = ScoreOptions(top_logprobs=top_k, max_pass_tokens=opts.max_pass_tokens)
    nll = np.zeros((len(items), n), np.float64)
    tops = np.zeros((len(items), n, top_k), np.int64) if top_k else None
    top_vals = np.zeros((len(items), n, top_k), np.float32) if top_k else None
    asked = np.zeros((len(items), n, at_ids[0].shape[1]), np.float32) if at_ids else None
    passes = []
    progress = Progress(len(items), 0, show_progress, Outcome("perplexity"), items="windows")
    start = time.perf_counter()
    try:
        for results, stats in iter_passes(model, items, score_opts, at_ids):
            passes.append(stats)
            for s in results:
                w = s.item.id
                nll[w] = -s.token_logprobs[opts.windows.first_scored:]
                if top_k:
                    tops[w] = s.top_ids[opts.windows.first_scored:]
                    top_vals[w] = s.top_logprobs[opts.windows.first_scored:]
                if asked is not None:
                    asked[w] = s.at_logprobs
                progress.tokens += n
                progress.finished({})
    finally:
        progress.close()
    seconds = time.perf_counter() - start
    losses = nll.reshape(-1)
    mean = float(losses.mean())
    se = float(losses.std(ddof=1) / math.sqrt(losses.size)) if losses.size > 1 else 0.0
    ppl = math.exp(mean) if mean < 700 else float("inf")
    covered = opts.windows.starts(len(tokens), opts.chunks)[-1] + opts.windows.context
    summary = {"windows": len(items), "context": opts.windows.context,
               "stride": opts.windows.stride, "first_scored": opts.windows.first_scored,
               "text_tokens": len(tokens), "tokens": covered, "scored_tokens": int(losses.size),
               "mean_nll": mean, "perplexity": ppl, "perplexity_se": ppl * se,
               "sweeps": sum(p.passes for p in passes), "expert_bytes_read": sum(p.expert_bytes_read for p in passes),
               "union_bytes": sum(p.union_bytes for p in passes), "seconds": seconds,
               "tokens_per_second": losses.size / seconds if seconds > 0 else 0.0,
               "passes": [(p.expert_bytes_read, p.union_bytes) for p in passes]}
    if opts.kl_base:
        write_reference(opts.kl_base, tokens[:covered], opts, tops.reshape(-1, top_k),
                        top_vals.reshape(-1, top_k), -losses)
        summary["kl_base"] = str(opts.kl_base)
    if reference is not None:
        summary["kl"] = kl_summary(reference, asked.reshape(len(losses), -1),
                                   tops.reshape(-1), -losses)
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
    existing file but a KL reference written here."""
    real = os.path.realpath(path)
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


def kl_summary(ref: Reference, at_logprobs: np.ndarray, top1: np.ndarray,
               token_logprobs: np.ndarray) -> dict:
    """KL(base || this) per scored position over the base's top K and the tail,
    and how often the most likely tokens agree."""
    if at_logprobs.shape != ref.top_logprobs.shape:
        raise JobError("the reference's positions are not this run's (another -c, "
                         "--stride or --chunks)")
    p_log = ref.top_logprobs.astype(np.float64)
    q_log = at_logprobs.astype(np.float64)
    p_tail = ref.tail_logprob.astype(np.float64)
    q_tail = tail_logprob(at_logprobs).astype(np.float64)
    kl = (np.exp(p_log) * (p_log - q_log)).sum(axis=-1) + np.exp(p_tail) * (p_tail - q_tail)
    kl = np.maximum(kl, 0.0)  # rounding can leave -1e-9 where the two agree
    same = top1 == ref.top_ids[:, 0]
    n = kl.size
    ratio = float(ref.token_logprobs.astype(np.float64).mean() - token_logprobs.mean())
    agree = float(same.mean())
    return {"positions": n, "mean": float(kl.mean()),
            "mean_se": float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
            "median": float(np.median(kl)), "p99": float(np.percentile(kl, 99)),
            "max": float(kl.max()), "same_top": agree,
            "same_top_se": math.sqrt(agree * (1 - agree) / n),
            "base_perplexity": math.exp(-float(ref.token_logprobs.astype(np.float64).mean())),
            "ln_ppl_ratio": ratio, "top_k": int(ref.top_ids.shape[1])}


def summary_lines(s: dict) -> List[str]:
    stride = "side by side, second half scored" if s["stride"] is None else f"stride {s['stride']}"
    lines = [f"{s['windows']} windows of {s['context']} tokens ({stride}; scored from position "
             f"{s['first_scored']}), {s['tokens']} of the text's {s['text_tokens']} tokens, "
             f"{s['scored_tokens']} scored: perplexity {s['perplexity']:.4f} ± "
             f"{s['perplexity_se']:.4f} (mean NLL {s['mean_nll']:.4f}); {count(s['sweeps'], 'sweep')}, "
             f"experts read {s['expert_bytes_read'] / 1e6:.1f} MB (union bound "
             f"{s['union_bytes'] / 1e6:.1f} MB); {s['tokens_per_second']:.1f} tok/s in "
             f"{s['seconds']:.1f} s"]
    if "kl_base" in s:
        lines.append(f"KL reference written to {s['kl_base']} ({s['scored_tokens']} positions)")
    if "kl" in s:
        k = s["kl"]
        lines.append(f"KL divergence from the reference (top {k['top_k']} + tail, "
                     f"{k['positions']} positions): mean {k['mean']:.6f} ± {k['mean_se']:.6f}, "
                     f"median {k['median']:.6f}, p99 {k['p99']:.6f}, max {k['max']:.6f}; "
                     f"same top token {100 * k['same_top']:.2f} ± "
                     f"{100 * k['same_top_se']:.2f} %; perplexity {s['perplexity']:.4f} against "
                     f"the reference's {k['base_perplexity']:.4f} "
                     f"(ln ratio {k['ln_ppl_ratio']:+.6f})")
    return lines
