"""The KL reference file (llama-perplexity's --kl-divergence-base): for every
scored position of a base run, the top K next tokens and their log-probabilities,
the log of the mass outside them (the tail) and the scored token's log-probability,
with the windows that scored them (docs/FORMAT.md, "KL reference"). Written whole,
read checked whole before anything uses it, written only over a reference."""

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from deltafin_mlx.errors import JobError
from deltafin_mlx.format.safetensors import header_length, parse_header
from deltafin_mlx.generation.logprobs import tail_logprob
from deltafin_mlx.jobs.results_file import open_regular
from deltafin_mlx.jobs.score_results import write_safetensors
from deltafin_mlx.jobs.text_windows import Windows

REFERENCE_KIND = "deltafin-kl-reference"
# A reference's five tensors and its windows: a header of a few hundred bytes.
REFERENCE_HEADER_MAX_BYTES = 1 << 16
# name: (dtype, dimensions) of a reference's tensors (docs/FORMAT.md).
REFERENCE_TENSORS = {"tokens": ("I32", 1), "top_ids": ("I32", 2), "top_logprobs": ("F32", 2),
                     "tail_logprob": ("F32", 1), "token_logprobs": ("F32", 1)}



@dataclass
class Reference:
    windows: Windows
    chunks: Optional[int]
    tokens: np.ndarray  # (tokens covered,) int32
    top_ids: np.ndarray  # (scored positions, K) int32, best first
    top_logprobs: np.ndarray  # (scored positions, K) float32
    tail_logprob: np.ndarray  # (scored positions,) float32
    token_logprobs: np.ndarray  # (scored positions,) float32


def write_reference(path, tokens, windows: Windows, chunks: Optional[int], top_ids,
                    top_logprobs, token_logprobs):
    """The base's distributions as one safetensors file (docs/FORMAT.md)."""
    top_logprobs = top_logprobs.astype(np.float32)
    write_safetensors(Path(path), {
        "tokens": np.asarray(tokens, np.int32),
        "top_ids": top_ids.astype(np.int32),
        "top_logprobs": top_logprobs,
        "tail_logprob": tail_logprob(top_logprobs),
        "token_logprobs": token_logprobs.astype(np.float32),
    }, metadata={"kind": REFERENCE_KIND, "context": str(windows.context),
                 "stride": str(windows.stride or 0), "chunks": str(chunks or 0)})


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

