"""Routing traces: each token's routed experts per MoE layer, as JSONL.

One line per token: {"tok": i, "layers": [[expert ids of the 1st MoE layer], ...]},
the input of the cache simulator (python -m bench.studies.simulate_cache). Only the first sequence of a batch is traced.
"""

import json
import os
from contextlib import ExitStack

from deltafin_mlx.engine.runtime import runtime


class RoutingTrace:
    def __init__(self, model, path):
        state = runtime(model)
        self.file = open(os.path.expanduser(path), "w")
        self.layers = state.store.layers
        self.pending = {}
        self.tok = 0
        self._observing = ExitStack()
        self._observing.enter_context(state.observe(on_route=self.record))

    def record(self, layer, idx):
        self.pending[layer] = idx[0].reshape(-1, idx.shape[-1])  # (positions, k)
        if layer != self.layers[-1]:
            return
        if all(l in self.pending for l in self.layers):
            rows = [self.pending[l] for l in self.layers]
            for pos in range(rows[0].shape[0]):
                line = {"tok": self.tok, "layers": [sorted(int(e) for e in r[pos]) for r in rows]}
                self.file.write(json.dumps(line) + "\n")
                self.tok += 1
        self.pending = {}

    def close(self):
        self._observing.close()  # the last tokens' routing is heard, then written
        self.file.close()
