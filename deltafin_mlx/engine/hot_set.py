"""Warm restarts: the expert cache's hot set, saved when the runtime closes and read
back in the background at the next load of the same model.

A restart starts with an empty cache, so without this the first tokens re-read
what the last run held. What is saved is expert ids only, per MoE layer the
resident experts, most valuable first as the pool's policy ranks them, at most the
cache's slot count, in `~/.cache/deltafin/hot/` (under $XDG_CACHE_HOME when set),
one file per key: the manifest's SHA-256, the activation dtype and, under tensor
parallelism, the rank and rank count (a rank's slots hold its slices). The file is
named by a hash of the key and holds the key itself, so a file copied from another
model is recognised as such.

At load the ids are queued as guesses behind every demand read (the reader serves
demand reads first), each into a free slot only, so the first token is never held
back by them: a miss gives up an unstarted warm read before anything the run has
read, and a warm read its token needs before a thread took it is read at once as a
demand read (`ExpertCache.warm`). Routing never depends on what is resident, so
the tokens are those of a cold start.

The file lives in the user's own directory but may be damaged, copied or replaced:
it is read as every file Deltafin reads (a regular file, non-blocking, bounded by
what the model's slots can need), every field is checked, and anything wrong is one
warning on the `deltafin_mlx` logger (shown on stderr when nothing else is
configured) and a cold start, never an error or a hang. Writes go to a temporary
file renamed into place, so a reader never sees half a file.
"""

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Dict, List, Optional

from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.integrity import read_inside
from deltafin_mlx.plan.rates import cache_dir

FORMAT = "deltafin-hot-set"
VERSION = 1

log = logging.getLogger("deltafin_mlx")


def hot_dir() -> Path:
    return cache_dir() / "hot"


def hot_key(manifest, activation_dtype, rank: int = 0, ranks: int = 1) -> Optional[str]:
    """What a hot set is valid for; None for a manifest read from no file."""
    if not manifest.digest:
        return None
    dtype = str(activation_dtype).rpartition(".")[2]
    key = f"{manifest.digest}/{dtype}"
    return f"{key}/rank{rank}of{ranks}" if ranks > 1 else key


def hot_path(key: str) -> Path:
    return hot_dir() / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def size_limit(ids: int, layers: int) -> int:
    """The most bytes a file of `ids` expert ids over `layers` layers takes: each id
    at most 12 characters with its separator, each layer's entry 32, the rest 4 KiB."""
    return 4096 + 12 * ids + 32 * layers


class HotSet:
    """The hot set of one loaded model's cache: `preload` at load, `save` at close."""

    def __init__(self, cache, key: str, path: Optional[Path] = None):
        self.cache = cache
        self.key = key
        self.path = Path(path) if path is not None else hot_path(key)
        self.preloaded = 0  # warm reads queued at load

    def read(self) -> Dict[int, List[int]]:
        """{layer: experts, most valuable first} from the file; {} when there is
        none, or it is refused (one warning says why)."""
        if not os.path.lexists(self.path):
            return {}
        cache = self.cache
        try:
            # Bounded by the model, not this cache: a run with a larger budget may
            # have saved more than this one holds.
            raw = read_inside(self.path.parent, self.path.name,
                              size_limit(cache.num_experts * len(cache.layers), len(cache.layers)),
                              inside="the hot-set directory")
            return self._parse(raw)
        except (ModelError, ValueError, RecursionError, TypeError, UnicodeDecodeError) as e:
            detail = str(e).replace(f"{self.path}: ", "").splitlines()[0][:200]
            log.warning("deltafin: warm start: %s ignored (%s); starting cold", self.path, detail)
            return {}

    def _parse(self, raw: bytes) -> Dict[int, List[int]]:
        d = json.loads(raw)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError("not a hot-set file")
        if d.get("version") != VERSION:
            raise ValueError(f"version {d.get('version')!r:.20}, this Deltafin reads {VERSION}")
        if d.get("key") != self.key:
            raise ValueError("saved for another model, activation dtype or rank")
        experts = d.get("experts")
        if not isinstance(experts, dict):
            raise ValueError("no expert lists")
        cache, out = self.cache, {}
        layers = {str(layer): layer for layer in cache.layers}
        for name, ids in experts.items():
            if name not in layers:
                raise ValueError(f"layer {name!r:.20} is not a MoE layer of this model")
            if not isinstance(ids, list) or not all(
                    type(e) is int and 0 <= e < cache.num_experts for e in ids):
                raise ValueError(f"layer {name}: expert ids out of range "
                                 f"(0..{cache.num_experts - 1})")
            if len(set(ids)) != len(ids):
                raise ValueError(f"layer {name}: an expert id repeats")
            out[layers[name]] = ids
        return out

    def preload(self) -> int:
        """Queue the saved hot set's reads; returns how many were queued."""
        saved = self.read()
        # Round robin over layers: a smaller cache than the one that saved the set
        # then keeps every layer's most valuable experts.
        order, depth = [], max((len(v) for v in saved.values()), default=0)
        for i in range(depth):
            order.extend((layer, saved[layer][i]) for layer in self.cache.layers
                         if i < len(saved.get(layer, ())))
        self.preloaded = self.cache.warm(order[: self.cache.capacity])
        return self.preloaded

    def ranked(self) -> Dict[int, List[int]]:
        """What to save: the resident experts by value, then the warm reads given up
        unread (still the last run's hot set), at most the cache's slots."""
        cache = self.cache
        unread = cache.cancel_warm()
        cache.drain()
        ranked = cache.pool.ranked()
        for layer, e in unread:
            if e not in ranked[layer]:
                ranked[layer].append(e)
        room, out = cache.capacity, {}
        for layer in cache.layers:
            out[layer] = ranked[layer][:room] if room > 0 else []
            room -= len(out[layer])
        return out

    def save(self):
        """Write the hot set (nothing when nothing is resident); a directory that
        cannot be written is one warning, never an error at close."""
        experts = self.ranked()
        if not any(experts.values()):
            return
        body = {"format": FORMAT, "version": VERSION, "key": self.key,
                "experts": {str(layer): ids for layer, ids in experts.items() if ids}}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "w") as f:
                json.dump(body, f, separators=(",", ":"))
            os.replace(tmp, self.path)
        except OSError as e:
            log.warning("deltafin: warm start: cannot save %s (%s)", self.path, e.strerror or e)
            try:
                tmp.unlink()
            except OSError:
                pass
