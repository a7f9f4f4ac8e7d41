"""Pinned trunk layers streamed through a pass, so the pass gets their memory.

During a pass each trunk layer is used once, so a pinned layer saves the pass no
more than one read of it (plan/memory.py pass_tokens). A pass that gives the expert cache back
(ExpertStore.begin_pass) gives these layers back too: from the next layer a long
call enters, they stream through buffers of their own (engine/trunk_stream.py's
TrunkStreamer, its reads one layer ahead), and the memory plan sizes the pass with
their bytes (plan/memory.py `pass_trunk_bytes`). When decoding resumes
(ExpertStore.end_pass) they are read back whole, as `load` read them, and pinned
again: one read of them per prefill, where decoding would otherwise read them for
every token.

The layer a pass is in when it gives them back keeps its pinned weights to its
end: its remaining operations (its MoE block's shared experts, its norms) look up
the module's weights after the router has run, so its weights are replaced only
at a later layer's entry.
"""

from typing import Dict, List

import mlx.core as mx

from deltafin_mlx.engine.trunk_stream import TrunkStreamer, tap_layer
from deltafin_mlx.errors import ModelError
from deltafin_mlx.model.modules import get_module


class PassTrunk:
    def __init__(self, model, manifest, layer_paths: Dict[int, str], layers: List[int],
                 act: mx.Dtype):
        self.model, self.manifest, self.paths, self.act = model, manifest, layer_paths, act
        self.layers = sorted(layers)
        self.prefixes = tuple(layer_paths[i] + "." for i in self.layers)
        self.streamer = None  # while a pass streams them
        self.pending = False  # given back: streamed from the next long call's next layer
        self.passes = 0  # passes that streamed them
        self._read = 0  # bytes streamed by passes that have ended
        for i in self.layers:
            tap_layer(get_module(model, layer_paths[i]), self.enter, i)

    @property
    def bytes_read(self) -> int:
        """Trunk bytes passes read streaming these layers (not their re-pinning)."""
        return self._read + (self.streamer.bytes_read if self.streamer is not None else 0)

    def release(self):
        """A pass gives the cache back: stream these layers from the next one it enters."""
        if self.streamer is None:
            self.pending = True

    def enter(self, layer: int, x: mx.array, cache):
        if self.pending and x.ndim >= 2 and x.shape[-2] > 1:
            self.pending = False
            self.passes += 1
            # Replaces the pinned weights with its buffers; everything computed
            # with them is evaluated at its first `enter`, then they are freed.
            self.streamer = TrunkStreamer(self.model, self.manifest, self.paths, self.layers,
                                          self.act, tap=False, first=layer)
            self.streamer.enter(layer, x, cache)
            mx.clear_cache()
            return
        if self.streamer is not None:
            self.streamer.enter(layer, x, cache)

    def restore(self):
        """Decoding resumes: the layers are read back whole and pinned again. Each
        step leaves the layers' weights right if stopped (a Ctrl-C): they are read
        before the streamer is let go, and the streamer goes after the modules hold
        them (ExpertStore.end_pass then runs this again)."""
        self.pending = False
        if self.streamer is None:
            return
        weights = self._pinned_weights()
        self.model.load_weights(weights, strict=False)
        streamer, self.streamer = self.streamer, None
        self._read += streamer.bytes_read
        streamer.close()  # its reads in flight end first
        del streamer
        mx.clear_cache()

    def _pinned_weights(self) -> list:
        """The layers' tensors as engine/load.load_trunk loads them: the files'
        tensors, floats cast to the activation dtype (if one is given), evaluated."""
        weights = []
        for rel in sorted({self.manifest.trunk_files[str(i)] for i in self.layers}):
            path = self.manifest.path / rel
            try:
                loaded = mx.load(str(path))
            except Exception as e:
                raise ModelError(f"{path}: unreadable trunk file ({e})") from None
            weights.extend((k, v.astype(self.act) if self.act is not None
                            and mx.issubdtype(v.dtype, mx.floating) else v)
                           for k, v in loaded.items() if k.startswith(self.prefixes))
        mx.eval([v for _, v in weights])
        return weights

    def close(self):
        if self.streamer is not None:
            self.streamer.close()
