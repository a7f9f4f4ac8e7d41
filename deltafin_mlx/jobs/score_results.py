"""Where scores go: JSONL result lines, or safetensors shards with a JSONL index.

JSONL (`--format jsonl`): one line per text, appended and fsynced as each pass
finishes (batch_io.Results, which also locks OUT), so in pass order: id, line (IN's
line number, which puts them back in input order), tokens, token_logprobs (null where
not scored, the first token included), with K > 0 top_ids, top_logprobs (per position
K ids and K log-probabilities, best first) and tail_logprob (log of the mass outside
them), null where not scored, then logprob (the sum), scored_tokens, greedy.

Safetensors (`--format safetensors`, docs/FORMAT.md): each pass is one shard of
rows, one row per token of its texts, `tokens` (int32), `token_logprobs` (float16,
NaN where not scored) and with K > 0 `top_ids` (int32, T x K), `top_logprobs`
(float16, T x K) and `tail_logprob` (float32, T); a shard is created under a name no
file has (never overwriting anything), written whole, fsynced with its directory, and
only then are its texts' lines appended to the index (OUT itself): {"id", "line",
"shard", "offset", "length", "logprob", "scored_tokens", "greedy"}. A kill leaves at worst a shard no index line
names, which the next run deletes (it can tell its own: ShardOutput) before scoring
those texts again; no other file beside OUT is ever deleted or written.

Either way a rerun skips the ids OUT already answers (batch_io.Results.scan: a
last line without its newline, all a kill mid-write can leave, is truncated away), and
error lines ({"id", "line", "error"}) answer their ids too.
"""

import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import List

import numpy as np

from deltafin_mlx.jobs.results_file import Results, read_lines, write_failed
from deltafin_mlx.errors import JobError
from deltafin_mlx.format.dtypes import SAFETENSORS_CODE
from deltafin_mlx.generation.logprobs import tail_logprob
from deltafin_mlx.jobs.score_sweep import Scored

FORMATS = ("jsonl", "safetensors")


def text_fields(s: Scored) -> dict:
    """The id, and the input line it answers (which puts lines in input order)."""
    return {"id": s.item.id} if s.item.line is None else {"id": s.item.id, "line": s.item.line}


def summary_fields(s: Scored) -> dict:
    return {"logprob": s.logprob, "scored_tokens": s.item.scored_tokens, "greedy": s.greedy}


def result_line(s: Scored) -> dict:
    scored = s.item.scored
    line = {**text_fields(s), "tokens": s.item.tokens}
    line["token_logprobs"] = [float(v) if ok else None for v, ok in zip(s.token_logprobs, scored)]
    if s.top_ids is not None:
        # Separate arrays, not [id, logprob] pairs: a reader that types columns
        # (pyarrow, datasets) keeps the ids integers.
        line["top_ids"] = [row.tolist() if ok else None for row, ok in zip(s.top_ids, scored)]
        line["top_logprobs"] = [row.tolist() if ok else None
                                for row, ok in zip(s.top_logprobs, scored)]
        line["tail_logprob"] = [float(v) if ok else None
                                for v, ok in zip(tail_logprob(s.top_logprobs), scored)]
    line.update(summary_fields(s))
    return line


class JsonlOutput:
    def __init__(self, path):
        self.out = Results(path)
        self.done = self.out.scan()

    def write_pass(self, results: List[Scored]):
        for s in results:
            self.out.write(result_line(s))

    def write_error(self, line: dict):
        self.out.write(line)

    def close(self):
        self.out.close()


# What marks a shard as written by a score job, and for which index (its name and
# the index file's identity): only such a shard, named by no index line, is deleted.
SHARD_KIND = "deltafin score shard"
HEADER_MAX_BYTES = 1 << 20


def _write_tensors(fd: int, tensors: dict, metadata: dict = None):
    """The safetensors bytes of `tensors` written to `fd`, then fsynced."""
    header, offset, blobs = {}, 0, []
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        data = a.tobytes()
        header[name] = {"dtype": SAFETENSORS_CODE[a.dtype.name], "shape": list(a.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with os.fdopen(os.dup(fd), "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for data in blobs:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(fd: int, path: Path, tensors: dict, metadata: dict = None):
    """Write `tensors` to `fd`, a file this process just created at `path`; a
    failed write removes that file (and only it: it is ours) and, for an OSError,
    says which file in one line ("disk full" when that is why)."""
    try:
        _write_tensors(fd, tensors, metadata)
    except BaseException as e:
        os.unlink(path)
        if isinstance(e, OSError):
            raise write_failed(path, e) from None
        raise
    finally:
        os.close(fd)


def _create_written(path: Path, tensors: dict, metadata: dict = None):
    """A new safetensors file at `path`, which must not exist (O_EXCL: nothing is
    ever overwritten; FileExistsError otherwise)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    _write_file(fd, path, tensors, metadata)


def write_safetensors(path: Path, tensors: dict, metadata: dict = None):
    """A safetensors file written whole at `path`, a file the user named: a
    temporary file of its own beside it (removed if the write fails), fsynced,
    renamed over `path`, the directory fsynced (so a file under its final name is
    always complete); `metadata`: strings for its header's __metadata__."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    _write_file(fd, Path(tmp), tensors, metadata)
    try:
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _shard_header_metadata(path: Path) -> dict:
    """The __metadata__ of the safetensors file at `path` ({} for anything that is
    not a regular file with a readable header)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
                     | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        n = int.from_bytes(os.pread(fd, 8, 0), "little")
        if not 0 < n <= HEADER_MAX_BYTES:
            return {}
        meta = json.loads(os.pread(fd, n, 8)).get("__metadata__")
        return meta if isinstance(meta, dict) else {}
    except (OSError, ValueError, AttributeError, RecursionError):
        return {}
    finally:
        os.close(fd)


class ShardOutput:
    """Shards named after the whole name of the index OUT (`OUT.NNNNN.safetensors`),
    beside it. A shard is created, never overwritten (O_EXCL: a number already
    taken, by anyone, is skipped), and records in its header which index it was
    written for (its name and the index file's device and inode). The files left
    by a kill between a shard and its index lines, and those only, are deleted at
    the next run: a name no index line gives, whose header names this index."""

    def __init__(self, index_path, top_k: int):
        self.index = Path(index_path)
        self.top_k = top_k
        self.out = Results(self.index)
        try:
            self.done = self.out.scan()  # every line a result (else refused), a cut last one gone
            named = self._named_shards()
        except BaseException:
            self.out.close()
            raise
        st = os.fstat(self.out.fd)
        self.owner = {"kind": SHARD_KIND, "index": self.index.name,
                      "index_file": f"{st.st_dev}:{st.st_ino}"}
        pattern = re.compile(re.escape(self.index.name) + r"\.(\d{5})\.safetensors")
        numbers = [-1]
        for p in self.index.parent.iterdir():
            m = pattern.fullmatch(p.name)
            if m is None:
                continue
            numbers.append(int(m.group(1)))  # taken, whoever wrote it: never reused
            if p.name not in named and _shard_header_metadata(p) == self.owner:
                p.unlink()  # ours, written and never indexed: its texts are scored again
        self.next = max(numbers) + 1

    def _named_shards(self) -> set:
        named = set()
        with open(self.index, "rb") as f:
            for n, raw, _ in read_lines(f):
                if raw and raw.strip():
                    shard = json.loads(raw).get("shard")
                    if shard is not None and not isinstance(shard, str):
                        raise JobError(f"{self.index}: line {n}: \"shard\" must be a file "
                                         "name (a string); not appending to it (use another "
                                         "output file)")
                    named.add(shard)
        return named

    def write_pass(self, results: List[Scored]):
        if not results:
            return
        tensors = {
            "tokens": np.concatenate([np.asarray(s.item.tokens, np.int32) for s in results]),
            "token_logprobs": np.concatenate([s.token_logprobs for s in results]).astype(np.float16),
        }
        if self.top_k:
            tensors["top_ids"] = np.concatenate([s.top_ids for s in results]).astype(np.int32)
            top = np.concatenate([s.top_logprobs for s in results])
            tensors["top_logprobs"] = top.astype(np.float16)
            tensors["tail_logprob"] = tail_logprob(top)  # of the float32 values, as JSONL's
        while True:
            if self.next > 99999:
                raise JobError(f"{self.index}: 100,000 shards already; use another output file")
            name = f"{self.index.name}.{self.next:05d}.safetensors"
            self.next += 1
            try:
                _create_written(self.index.parent / name, tensors, self.owner)
                break
            except FileExistsError:
                continue  # someone else's file: left as it is, the next number tried
        _fsync_dir(self.index.parent)
        offset = 0
        for s in results:
            n = len(s.item.tokens)
            self.out.write({**text_fields(s), "shard": name, "offset": offset,
                            "length": n, **summary_fields(s)})
            offset += n

    def write_error(self, line: dict):
        self.out.write(line)

    def close(self):
        self.out.close()


def open_output(path, fmt: str, top_k: int):
    if fmt not in FORMATS:
        raise JobError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    return JsonlOutput(path) if fmt == "jsonl" else ShardOutput(path, top_k)
