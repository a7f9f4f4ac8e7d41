"""Converting a hub checkpoint within a bounded scratch (`--scratch-limit SIZE`).

Only the small files are downloaded up front; every shard's safetensors header is
read with a range request, so the whole conversion is planned (and checked) before
any shard is fetched. Then the layers are converted in order: before a layer, the
shards it reads are downloaded into `OUT/deltafin.scratch/` (each checked against the
hub's sha256, its LFS oid, before use: a shard is renamed to its name only once it
matched); after a layer is durably recorded, every shard no later layer reads is
deleted. So the disk in use is the output so far plus at most the shards live at
once, which `plan_scratch` computes up front and the limit must hold.

Resuming: finished layers are in `deltafin.partial.json`; complete shards in the
scratch are kept, a partial download (`NAME.part`) is discarded and fetched again,
so a rerun re-downloads at most the shard that was in flight.
"""

import fnmatch
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from deltafin_mlx.errors import ConvertError
from deltafin_mlx.format.hub import SOURCE_PATTERNS, download_to, fetch_range, list_repo
from deltafin_mlx.units import human_bytes

from deltafin_mlx.format.safetensors import header_length

from .source import parse_safetensors_header, read_safetensors_header

SCRATCH_NAME = "deltafin.scratch"


@dataclass
class ScratchPlan:
    """Which shards each unit needs and when each can go."""

    order: list  # units in conversion order
    needs: Dict[object, set]  # unit -> shards it reads
    last_use: Dict[str, int]  # shard -> index in `order` of the last unit reading it
    peak: int  # the most bytes of shards live at once
    largest: int
    largest_name: str


def plan_scratch(order, needs, sizes: Dict[str, int]) -> ScratchPlan:
    first, last = {}, {}
    for i, unit in enumerate(order):
        for s in needs[unit]:
            first.setdefault(s, i)
            last[s] = i
    peak = max((sum(sizes[s] for s in first if first[s] <= i <= last[s])
                for i in range(len(order))), default=0)
    used = {s: sizes[s] for s in first}
    name = max(used, key=used.get) if used else ""
    return ScratchPlan(order, needs, last, peak, used.get(name, 0), name)


@dataclass
class HubScratch:
    """A hub repository fetched into a scratch folder a shard at a time."""

    repo: str
    commit: str
    dir: Path
    shard_sizes: Dict[str, int]
    shard_sha256: Dict[str, Optional[str]]
    progress: bool = True
    small_bytes: int = 0  # the config, index and tokenizer files, kept to the end
    downloaded: int = 0  # bytes fetched by this run
    download_seconds: float = 0.0
    on_download: Optional[object] = None  # called with bytes as they arrive
    _headers: Dict[str, tuple] = field(default_factory=dict)
    _since: Optional[float] = None  # when the download in flight started

    @property
    def shards(self) -> List[str]:
        return sorted(self.shard_sizes)

    def header(self, shard: str):
        """(tensors, size) of a shard from its header alone (two range requests)."""
        if shard not in self.shard_sizes:
            raise ConvertError(f"{self.repo}: the index names {shard}, which the repository "
                               "does not hold")
        if shard not in self._headers:
            size = self.shard_sizes[shard]
            where = f"{self.repo}/{shard}"
            if self.present(shard):  # already here (a resumed run)
                header = read_safetensors_header(self.dir / shard)
            else:
                head = fetch_range(self.repo, self.commit, shard, 0, 8)
                n = header_length(where, head, size, ConvertError)
                header = parse_safetensors_header(
                    where, fetch_range(self.repo, self.commit, shard, 8, n), size)
            self._headers[shard] = (header, size)
        return self._headers[shard]

    def present(self, shard: str) -> bool:
        p = self.dir / shard
        return p.is_file() and p.stat().st_size == self.shard_sizes[shard]

    def ensure(self, shards):
        """Every shard of `shards` downloaded and checked against its sha256."""
        for shard in sorted(shards):
            if self.present(shard):
                continue
            part = self.dir / (shard + ".part")
            self._since = time.perf_counter()
            try:
                got = download_to(self.repo, self.commit, shard, part,
                                  self.shard_sizes[shard], self._count)
            finally:
                self.download_seconds += time.perf_counter() - self._since
                self._since = None
            want = self.shard_sha256.get(shard)
            if want is not None and got != want:
                part.unlink(missing_ok=True)
                raise ConvertError(f"{self.repo}/{shard}: downloaded bytes do not match the "
                                   f"hub's sha256 (got {got[:12]}..., the hub says "
                                   f"{want[:12]}...); rerun to fetch it again")
            os.replace(part, self.dir / shard)

    def _count(self, n: int):
        self.downloaded += n
        if self.on_download:
            self.on_download(n)

    def release(self, shard: str):
        (self.dir / shard).unlink(missing_ok=True)

    @property
    def download_rate(self) -> float:
        """Bytes/s over the time spent downloading (the shard in flight included)."""
        busy = self.download_seconds + (time.perf_counter() - self._since if self._since else 0)
        return self.downloaded / busy if busy else 0.0

    def remove(self):
        shutil.rmtree(self.dir, ignore_errors=True)


def open_hub_scratch(repo: str, revision: Optional[str], out: Path, progress: bool) -> HubScratch:
    """List the repository, fetch its small files into OUT's scratch folder (kept
    across reruns) and discard any partial shard download of an earlier run."""
    listed = list_repo(repo, revision)
    if listed is None:
        raise ConvertError(f"{repo}: --scratch-limit converts from the hub as it downloads, "
                           "and the hub cannot be reached (offline; without --scratch-limit a "
                           "snapshot in the local hub cache is used)")
    scratch = out / SCRATCH_NAME
    scratch.mkdir(parents=True, exist_ok=True)
    for p in scratch.glob("*.part"):
        p.unlink()  # a download a kill cut short: fetched again when needed
    wanted = [f for f in listed.files.values()
              if any(fnmatch.fnmatch(f.name, pat) for pat in SOURCE_PATTERNS)
              and "/" not in f.name]
    shards = {f.name: f for f in wanted if f.name.endswith(".safetensors")}
    for f in wanted:
        if f.name in shards:
            continue
        dest = scratch / f.name
        if dest.is_file() and dest.stat().st_size == f.size:
            continue
        got = download_to(repo, listed.commit, f.name, scratch / (f.name + ".part"), f.size)
        if f.sha256 is not None and got != f.sha256:
            raise ConvertError(f"{repo}/{f.name}: downloaded bytes do not match the hub's "
                               "sha256; rerun to fetch it again")
        os.replace(scratch / (f.name + ".part"), dest)
    if not shards:
        raise ConvertError(f"{repo}: the repository holds no safetensors weights")
    return HubScratch(repo, listed.commit, scratch, {n: f.size for n, f in shards.items()},
                      {n: f.sha256 for n, f in shards.items()}, progress,
                      sum(f.size for f in wanted if f.name not in shards))


def check_scratch_limit(plan: ScratchPlan, limit: Optional[int], free: int,
                        output_left: int, small: int = 0) -> int:
    """The limit to hold to (default: what is free beyond the output still to be
    written), refused up front, with the numbers, when it cannot hold the shards
    that must be on disk at once (beside the `small` files kept to the end)."""
    if limit is None:
        limit = free - output_left
    peak = plan.peak + small
    if limit < plan.largest + small:
        raise ConvertError(
            f"--scratch-limit {human_bytes(max(limit, 0))}: smaller than the largest shard the "
            f"conversion needs, {plan.largest_name} ({human_bytes(plan.largest)}); "
            f"give at least {human_bytes(peak)}"
            + (f" (free disk beyond the output's {human_bytes(output_left)}: "
               f"{human_bytes(max(free - output_left, 0))})" if limit == free - output_left
               else ""))
    if limit < peak:
        raise ConvertError(
            f"--scratch-limit {human_bytes(limit)}: the layers need up to "
            f"{human_bytes(peak)} of shards on disk at once (a layer's tensors span "
            f"shards); give at least {human_bytes(peak)}")
    if output_left + peak > free:
        raise ConvertError(
            f"not enough free disk space: the output needs {human_bytes(output_left)} more "
            f"and the shards {human_bytes(peak)} at most, {human_bytes(free)} are free")
    return limit


def disk_in_use(out: Path) -> int:
    """Bytes of every file under OUT (the output so far and the scratch)."""
    total = 0
    for dirpath, _, names in os.walk(out):
        for n in names:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_size
            except OSError:
                pass
    return total
