"""score's JSONL results as a parquet dataset in trainers' layout (`deltafin-run
export`, docs/FORMAT.md "Parquet export"): one row per text, in input order, with
ms-swift's column names, the teacher's top K aligned as a model's logits are (row t
predicts token t + 1), readable by `datasets.load_dataset("parquet", ...)`.

OUT (a regular file, or `-` for stdin: jobs/results_file.py `open_input`) is read
twice, a line at a time, no line longer than LINE_MAX_BYTES: once for each text's
place (its input line number) and id type, then in input order a row group at a
time, so memory holds one row group, not the corpus. Results in either layout are
read: separate top-K arrays, or the [id, logprob] pairs score wrote before (their
tail by the same rule).
pyarrow (the `distill` extra) is imported only here, when an export runs.
"""

import json
import os
import tempfile
from pathlib import Path

import numpy as np

from deltafin_mlx.errors import JobError
from deltafin_mlx.generation.logprobs import tail_logprob
from deltafin_mlx.jobs.results_file import LINE_MAX_BYTES, open_input, read_lines
from deltafin_mlx.units import human_bytes, is_int

INSTALL = "pip install 'deltafin[distill]'"
PARQUET_MAGIC = b"PAR1"
GROUP_VALUES = 1 << 22  # top-K values (and tokens) per row group: tens of MB in memory
IGNORED_LABEL = -100  # the label of an unscored token, as trainers' losses skip it


def parquet_modules():
    """(pyarrow, pyarrow.parquet), or one line saying how to install them."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise JobError(f"the parquet export needs pyarrow, which is not installed: {INSTALL}") \
            from None
    return pyarrow, pyarrow.parquet


def check_parquet_output(path):
    """Refuse before reading anything an output that exists and is not a parquet file
    (it would be replaced): only an earlier export is written over."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        return
    except OSError as e:
        raise JobError(f"{path}: cannot be written ({e.strerror})") from None
    if head != PARQUET_MAGIC:
        raise JobError(f"{path}: exists and is not a parquet file; not replacing it "
                       "(give a new file name)")


def top_arrays(line: dict):
    """A result line's per-position (top ids, top log-probabilities, tail
    log-probability), None where not scored, from either layout."""
    if "top_ids" in line:
        return line["top_ids"], line["top_logprobs"], line["tail_logprob"]
    pairs = line["top_logprobs"]  # [[id, logprob], ...] per position: the layout before
    ids = [None if p is None else [int(i) for i, _ in p] for p in pairs]
    vals = [None if p is None else [float(v) for _, v in p] for p in pairs]
    tails = [None if v is None else float(tail_logprob(np.asarray([v], np.float32))[0])
             for v in vals]
    return ids, vals, tails


def _scan(f, path):
    """(places, ids are all integers, error lines): each result line's (sort key,
    byte offset) in `f`, the key its input line number, then its place in OUT."""
    places, ints, errors, end = [], True, 0, 0
    for n, raw, _ in read_lines(f):
        at, end = end, f.tell()
        if raw is None:
            raise JobError(f"{path}: line {n} is longer than {human_bytes(LINE_MAX_BYTES)}: "
                           "not score's results")
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            raise JobError(f"{path}: line {n} is not JSON: not score's results") from None
        if not isinstance(line, dict) or "shard" in line:
            raise JobError(f"{path}: line {n} is not a result line of score's JSONL "
                           "(--format jsonl; a --format safetensors index cannot be "
                           "exported)")
        if "error" in line:
            errors += 1
            continue
        if "tokens" not in line or "token_logprobs" not in line:
            raise JobError(f"{path}: line {n} has no tokens: not score's results")
        if "top_logprobs" not in line:
            raise JobError(f"{path}: line {n} has no top K: score with --top-logprobs K "
                           "to export teacher distributions")
        ints = ints and is_int(line["id"])
        places.append(((line.get("line") or 0, n), at))
    places.sort()
    return [at for _, at in places], ints, errors


def export_row(line: dict, ints: bool) -> dict:
    """One text's row: `input_ids` its tokens, `labels` them with IGNORED_LABEL where
    not scored, and the teacher's top K in the logits' alignment: row t (of as many
    as tokens) is the distribution after tokens 0..t, which predicts token t + 1
    (None where that token is not scored, and in the last row)."""
    tokens = line["tokens"]
    ids, vals, tails = top_arrays(line)
    return {"id": line["id"] if ints or isinstance(line["id"], str) else json.dumps(line["id"]),
            "input_ids": tokens,
            "labels": [t if v is not None else IGNORED_LABEL
                       for t, v in zip(tokens, line["token_logprobs"])],
            "teacher_topk_indices": ids[1:] + [None],
            "teacher_topk_logprobs": vals[1:] + [None],
            "teacher_tail_logprob": tails[1:] + [None]}


def export_parquet(in_path, out_path) -> dict:
    """Write score's JSONL results `in_path` as a parquet file `out_path` (a
    temporary file beside it, renamed when whole); {"texts", "errors", "top_k"}."""
    pa, pq = parquet_modules()
    out_path = Path(out_path)
    check_parquet_output(out_path)
    with open_input(in_path) as f:
        return _export(f, in_path, out_path, pa, pq)


def _export(f, in_path, out_path: Path, pa, pq) -> dict:
    places, ints, errors = _scan(f, in_path)
    if not places:
        raise JobError(f"{in_path}: no scored text to export")
    schema = pa.schema([
        ("id", pa.int64() if ints else pa.string()),
        ("input_ids", pa.list_(pa.int64())), ("labels", pa.list_(pa.int64())),
        ("teacher_topk_indices", pa.list_(pa.list_(pa.int64()))),
        ("teacher_topk_logprobs", pa.list_(pa.list_(pa.float32()))),
        ("teacher_tail_logprob", pa.list_(pa.float32()))])
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    top_k = 0
    try:
        with pq.ParquetWriter(tmp, schema) as writer:
            rows, values = [], 0
            for i, at in enumerate(places):
                f.seek(at)
                row = export_row(json.loads(f.readline()), ints)
                top_k = top_k or max((len(r) for r in row["teacher_topk_indices"] if r), default=0)
                rows.append(row)
                values += len(row["input_ids"]) * max(top_k, 1)
                if values >= GROUP_VALUES or i == len(places) - 1:
                    writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                    rows, values = [], 0
        os.replace(tmp, out_path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise JobError(f"{out_path}: could not be written ({e.strerror or e})") from None
        raise
    return {"texts": len(places), "errors": errors, "top_k": top_k}
