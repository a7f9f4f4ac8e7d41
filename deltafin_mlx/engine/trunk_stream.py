"""Streaming trunk layers and embedding rows, for budgets below the whole trunk.

Decoder layers of the same shape (the plan's "streamed" units) share two sets of
weight buffers. The order layers run in is known, so while one layer computes, the
next layer of its shape is read into the other buffer on a background thread:
read-ahead that is exact, not speculative. A buffer is refilled only after
everything that used it has been evaluated: at the entry of a streamed layer its
input, and the cache state of the layer that last used the buffer, are evaluated
first.

The embedding table can instead stay on disk: each call reads only the rows of the
tokens it embeds and dequantizes them exactly as mlx-lm's QuantizedEmbedding does.
"""

import os
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from deltafin_mlx.format.dtypes import NUMPY, SAFETENSORS, in_memory, name_of, to_mlx, to_numpy, widen
from deltafin_mlx.model.modules import get_module
from deltafin_mlx.errors import ModelError, TrunkReadError
from deltafin_mlx.format.safetensors import read_header


def safetensors_index(path) -> Dict[str, tuple]:
    """name -> (dtype name, shape, absolute offset, nbytes) for one trunk file, its
    header checked (format/safetensors.py: reads go where it says); a damaged header,
    or a dtype the streamer does not read, is a ModelError naming the file."""
    out = {}
    for name, e in read_header(path, ModelError).items():
        dtype = SAFETENSORS[e.dtype]
        if dtype not in NUMPY:
            raise ModelError(f"{path}: tensor {name:.200} is {e.dtype}, a dtype the trunk "
                             "streamer does not read")
        out[name] = (dtype, e.shape, e.offset, e.nbytes)
    return out


def _read_into(fd: int, path, dst: np.ndarray, disk_dtype: str, offset: int, nbytes: int,
               scratch: np.ndarray):
    """Read one tensor into `dst` (converting bf16/f16 to a wider float dtype)."""
    direct = dst.dtype == NUMPY[disk_dtype] and dst.nbytes == nbytes
    target = dst.reshape(-1).view(np.uint8) if direct else scratch[:nbytes]
    got = os.preadv(fd, [memoryview(target)], offset)
    if got != nbytes:
        raise TrunkReadError(f"{path}: short read at offset {offset} ({got} of {nbytes} bytes)")
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    if direct:
        return
    widen(dst, target.view(NUMPY[disk_dtype]).reshape(dst.shape))



class Buffer:
    """One set of weight arrays shaped like a layer of one signature."""

    def __init__(self, template: Dict[str, tuple], act: mx.Dtype):
        self.arrays = {}
        self.views = {}
        for rel, (dtype, shape) in template.items():
            a = mx.zeros(shape, dtype=in_memory(dtype, act))
            mx.eval(a)
            self.arrays[rel] = a
            self.views[rel] = to_numpy(a)
        self.holds = None  # the layer whose weights are in it
        self.future = None  # its read in flight
        self.last_user = None  # the layer that computed with it last
        self.tree = tree_unflatten(list(self.arrays.items()))


class TrunkStreamer:
    """Feeds the plan's streamed decoder layers through shared buffers."""

    def __init__(self, model, manifest, layer_paths: Dict[int, str], streamed: List[int],
                 act: mx.Dtype, tap: bool = True, first: int = None):
        """`tap`: call `enter` as each streamed layer starts (without it the caller
        does: engine/trunk_pass.py); `first`: the layer each shape's first read
        starts at (the first of each shape from it on), where a pass joins midway."""
        self.act = act
        self.order = sorted(streamed)
        self.paths = layer_paths
        self.modules = {i: get_module(model, layer_paths[i]) for i in self.order}
        self.files = {i: manifest.path / manifest.trunk_files[str(i)] for i in self.order}
        self.index = {i: safetensors_index(self.files[i]) for i in self.order}
        self.fds = {i: os.open(self.files[i], os.O_RDONLY) for i in self.order}
        self.caches = {}  # layer -> the cache object of its last call
        self.bytes_read = 0
        self.stall_seconds = 0.0
        self._lock = threading.Lock()

        # Layers with the same tensor names, dtypes and shapes share buffers.
        self.signature = {}
        templates = {}
        for i in self.order:
            prefix = layer_paths[i] + "."
            tmpl = {name[len(prefix):]: (d, s) for name, (d, s, _, _) in self.index[i].items()}
            sig = tuple(sorted((k, d, s) for k, (d, s) in tmpl.items()))
            self.signature[i] = sig
            templates[sig] = tmpl
        self.group = defaultdict(list)
        for i in self.order:
            self.group[self.signature[i]].append(i)
        self.buffers = {sig: [Buffer(t, act) for _ in range(min(2, len(self.group[sig])))]
                        for sig, t in templates.items()}
        self.scratch = np.empty(max(n for idx in self.index.values() for *_, n in idx.values()),
                                dtype=np.uint8)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltafin-trunk")
        for i in self.order:
            if tap:
                tap_layer(self.modules[i], self.enter, i)
            # Drop the weights held so far (the skeleton's, never evaluated, or a
            # pinned layer's a pass streams).
            self.modules[i].update(self.buffers[self.signature[i]][0].tree)
        # The first layer of each shape is read now; the rest follow one ahead.
        for sig, layers in self.group.items():
            later = [i for i in layers if first is None or i >= first]
            self._start(self.buffers[sig][0], (later or layers)[0])

    def _start(self, buf: Buffer, layer: int):
        if buf.holds == layer:
            return
        buf.holds = layer
        buf.future = self.pool.submit(self._read, buf, layer)

    def _read(self, buf: Buffer, layer: int):
        prefix = self.paths[layer] + "."
        fd, path = self.fds[layer], self.files[layer]
        for name, (dtype, shape, offset, nbytes) in self.index[layer].items():
            _read_into(fd, path, buf.views[name[len(prefix):]], dtype, offset, nbytes, self.scratch)
            with self._lock:
                self.bytes_read += nbytes

    def _buffer_of(self, layer: int) -> Buffer:
        for buf in self.buffers[self.signature[layer]]:
            if buf.holds == layer:
                return buf
        return None

    def enter(self, layer: int, x: mx.array, cache):
        """Called as `layer` starts: make its weights present, read the next ahead."""
        sig = self.signature[layer]
        layers = self.group[sig]
        buf = self._buffer_of(layer)
        # Everything computed before this layer, and the recurrent/KV state the
        # previous users of this shape's buffers produced, must be evaluated
        # before a buffer is refilled.
        pending = [x]
        for b in self.buffers[sig]:
            c = self.caches.get(b.last_user)
            if c is not None:
                pending.extend(a for a in _state_arrays(c))
        mx.eval(pending)
        if buf is None:  # not read ahead (first call, or an unusual order)
            ring = self.buffers[sig]
            buf = ring[0] if ring[0].last_user != layer else ring[-1]
            self._start(buf, layer)
        start = time.perf_counter()
        try:
            buf.future.result()
        except OSError as e:
            buf.holds = None
            raise TrunkReadError(f"{self.files[layer]}: read failed ({e.strerror or e})") from None
        self.stall_seconds += time.perf_counter() - start
        self.modules[layer].update(buf.tree)
        buf.last_user = layer
        self.caches[layer] = cache
        # Read the next layer of this shape into the other buffer.
        nxt = layers[(layers.index(layer) + 1) % len(layers)]
        if nxt != layer:
            other = next((b for b in self.buffers[sig] if b is not buf), None)
            if other is not None:
                self._start(other, nxt)

    def close(self):
        self.pool.shutdown(wait=True)
        for fd in self.fds.values():
            os.close(fd)


def _state_arrays(cache):
    try:
        state = cache.state
    except Exception:
        return []
    out = []
    stack = [state]
    while stack:
        s = stack.pop()
        if isinstance(s, mx.array):
            out.append(s)
        elif isinstance(s, (list, tuple)):
            stack.extend(s)
    return out


def tap_layer(module: nn.Module, enter, layer: int):
    """Call `enter(layer, x, cache)` as the decoder layer `module` starts."""
    base = type(module)

    def __call__(self, x, *args, **kwargs):
        cache = kwargs.get("cache", args[1] if len(args) > 1 else None)
        enter(layer, x, cache)
        return base.__call__(self, x, *args, **kwargs)

    module.__class__ = type(f"Streamed{base.__name__}", (base,), {"__call__": __call__})


class RowEmbedding(nn.Module):
    """An embedding whose table stays on disk: each call reads just its rows.

    Exactly mlx-lm's Embedding / QuantizedEmbedding arithmetic, on those rows."""

    def __init__(self, original: nn.Module, path, prefix: str, act: mx.Dtype):
        super().__init__()
        self._path = str(path)
        index = safetensors_index(path)
        self._parts = {}
        for part in ("weight", "scales", "biases"):
            if f"{prefix}.{part}" in index:
                self._parts[part] = index[f"{prefix}.{part}"]
        self._quant = {k: getattr(original, k) for k in ("group_size", "bits", "mode")
                       if hasattr(original, k)} if "scales" in self._parts else None
        self._act = act
        self._num_rows = self._parts["weight"][1][0]
        if tuple(self._parts["weight"][1]) != tuple(original.weight.shape):
            raise ModelError(f"{path}: {prefix}.weight is {self._parts['weight'][1]} in the "
                             f"file, {tuple(original.weight.shape)} in the model")
        self._fd = os.open(self._path, os.O_RDONLY)
        self._scratch = np.empty(max(n // s[0] for _, s, _, n in self._parts.values()),
                                 dtype=np.uint8)

    @property
    def num_rows(self) -> int:
        return self._num_rows

    def _rows(self, part: str, ids: np.ndarray) -> mx.array:
        dtype, shape, offset, nbytes = self._parts[part]
        row = nbytes // shape[0]
        dst_dtype = name_of(in_memory(dtype, self._act))
        out = np.empty((len(ids), *shape[1:]), dtype=NUMPY[dst_dtype])
        for j, t in enumerate(ids):
            _read_into(self._fd, self._path, out[j], dtype, offset + int(t) * row, row,
                       self._scratch)
        return to_mlx(out, dst_dtype)

    def __call__(self, x: mx.array) -> mx.array:
        mx.eval(x)
        flat = np.array(x).reshape(-1).astype(np.int64)
        ids, inverse = np.unique(flat, return_inverse=True)
        pos = mx.array(inverse.reshape(x.shape).astype(np.uint32))
        w = self._rows("weight", ids)
        if self._quant is None:
            return w[pos]
        s = self._rows("scales", ids)
        b = self._rows("biases", ids) if "biases" in self._parts else None
        return mx.dequantize(w[pos], scales=s[pos], biases=b[pos] if b is not None else None,
                             **self._quant)
