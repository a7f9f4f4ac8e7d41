"""Where scores go: JSONL result lines, or safetensors shards with a JSONL index.

JSONL (`--format jsonl`): one line per text, appended and fsynced as each pass
finishes (batch_io.Results, which also locks OUT): id, tokens, token_logprobs (null where not scored, the
first token included), top_logprobs with K > 0 ([id, logprob] pairs best first,
null where not scored), logprob (the sum), scored_tokens, greedy.

Safetensors (`--format safetensors`, docs/FORMAT.md): each pass is one shard of
rows, one row per token of its texts, `tokens` (int32), `token_logprobs` (float16,
NaN where not scored) and with K > 0 `top_ids` (int32, T x K) and `top_logprobs`
(float16, T x K); a shard is written whole under a temporary name, fsynced, renamed
and its directory fsynced, and only then are its texts' lines appended to the index
(OUT itself): {"id", "shard", "offset", "length", "logprob", "scored_tokens",
"greedy"}. A kill leaves at worst a shard no index line names, which the next run
deletes before scoring those texts again.

Either way a rerun skips the ids OUT already answers (batch_io.Results.scan: a
last line without its newline, all a kill mid-write can leave, is truncated away), and
error lines ({"id", "line", "error"}) answer their ids too.
"""

import json
import os
import re
from pathlib import Path
from typing import List

import numpy as np

from deltafin_mlx.jobs.results_file import Results, read_lines
from deltafin_mlx.errors import BatchError
from deltafin_mlx.format.dtypes import SAFETENSORS_CODE
from deltafin_mlx.generation.logprobs import top_pairs
from deltafin_mlx.jobs.score_sweep import Scored

FORMATS = ("jsonl", "safetensors")


def summary_fields(s: Scored) -> dict:
    return {"logprob": s.logprob, "scored_tokens": s.item.scored_tokens, "greedy": s.greedy}


def result_line(s: Scored) -> dict:
    scored = s.item.scored
    line = {"id": s.item.request.id, "tokens": s.item.tokens,
            "token_logprobs": [float(v) if ok else None
                               for v, ok in zip(s.token_logprobs, scored)]}
    if s.top_ids is not None:
        line["top_logprobs"] = [top_pairs(i, v) if ok else None
                                for i, v, ok in zip(s.top_ids, s.top_logprobs, scored)]
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


def write_safetensors(path: Path, tensors: dict, metadata: dict = None):
    """A safetensors file written whole: temporary name, fsync, rename, fsync of
    the directory (so a file under its final name is always complete);
    `metadata`: strings for its header's __metadata__."""
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
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head)
        for data in blobs:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardOutput:
    """Shards named OUT's stem + `.NNNNN.safetensors`, beside the index OUT."""

    def __init__(self, index_path, top_k: int):
        self.index = Path(index_path)
        self.top_k = top_k
        self.out = Results(self.index)
        self.done = self.out.scan()  # every line a result (else refused), a cut last one gone
        named = set()
        with open(self.index, "rb") as f:
            for _, raw, _ in read_lines(f):
                if raw and raw.strip():
                    shard = json.loads(raw).get("shard")
                    if shard is not None:
                        named.add(shard)
        self.pattern = re.compile(re.escape(self.index.stem) + r"\.(\d{5})\.safetensors")
        numbers = [-1]
        for p in self.index.parent.iterdir():
            m = self.pattern.fullmatch(p.name)
            if m is None:
                continue
            if p.name not in named:
                p.unlink()  # written, never indexed: its texts are scored again
            else:
                numbers.append(int(m.group(1)))
        self.next = max(numbers) + 1

    def write_pass(self, results: List[Scored]):
        if not results:
            return
        name = f"{self.index.stem}.{self.next:05d}.safetensors"
        if self.next > 99999:
            raise BatchError(f"{self.index}: 100,000 shards already; use another output file")
        self.next += 1
        tensors = {
            "tokens": np.concatenate([np.asarray(s.item.tokens, np.int32) for s in results]),
            "token_logprobs": np.concatenate([s.token_logprobs for s in results]).astype(np.float16),
        }
        if self.top_k:
            tensors["top_ids"] = np.concatenate([s.top_ids for s in results]).astype(np.int32)
            tensors["top_logprobs"] = np.concatenate(
                [s.top_logprobs for s in results]).astype(np.float16)
        write_safetensors(self.index.parent / name, tensors)
        offset = 0
        for s in results:
            n = len(s.item.tokens)
            self.out.write({"id": s.item.request.id, "shard": name, "offset": offset,
                            "length": n, **summary_fields(s)})
            offset += n

    def write_error(self, line: dict):
        self.out.write(line)

    def close(self):
        self.out.close()


def open_output(path, fmt: str, top_k: int):
    if fmt not in FORMATS:
        raise BatchError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    return JsonlOutput(path) if fmt == "jsonl" else ShardOutput(path, top_k)
