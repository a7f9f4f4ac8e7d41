"""mlx-lm's own format as a conversion source: what `mlx_lm.convert` writes, the
layout of every mlx-community repository.

Its tensors are already what mlx-lm's model class `sanitize` makes of a release:
named as the model's parameters, each MoE layer's routed experts stacked along a
first axis of E (`<switch>.gate_proj.weight` of shape (E, out, in), with `.scales`
and `.biases` where quantized), DeepSeek-V3's kv_b_proj already split into
embed_q/unembed_out. Expert e's slice of a stacked tensor is one contiguous run of
bytes, so each expert is read alone, by (file, offset, length): a layer's stacked
tensors are never loaded whole, and conversion memory stays one expert plus one
layer's trunk. Experts mlx-lm quantized are carried over byte for byte (and can be
linked); float ones are quantized with the options, as Hugging Face experts are.
"""

from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from deltafin_mlx.errors import ConvertError
from deltafin_mlx.format.dtypes import NUMPY, SAFETENSORS
from deltafin_mlx.format.record import PROJECTIONS
from deltafin_mlx.model.quantization import carried_quantization, module_quantization

from .source import Source

KINDS = ("weight", "scales", "biases")
FLOAT_CODES = ("BF16", "F16", "F32")


def is_stacked(source: Source, switch_paths) -> bool:
    """The source holds its experts stacked where mlx-lm's model has them."""
    return any(f"{sp}.{p}.weight" in source.tensors for sp in switch_paths for p in PROJECTIONS)


def saved_quantization(block: Optional[dict], path: str, in_dim: int, weight, scales) -> dict:
    """How a module mlx-lm saved quantized was quantized: its entry in the
    quantization block where it has one, else inferred from the saved shapes and
    scales dtype (mlx_lm.utils.infer_quant_config's rule, on safetensors headers)."""
    if block is not None and isinstance(block.get(path), dict):
        return module_quantization(block, path)
    group = in_dim // max(scales.shape[-1], 1)
    bits = weight.shape[-1] * 32 // in_dim
    if scales.dtype != "U8":
        return {"group_size": group, "bits": bits, "mode": "affine"}
    modes = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}
    return {"group_size": group, "bits": bits, "mode": modes.get((bits, group), "unknown")}


class StackedExperts:
    """The routed experts of an mlx-lm format source, one record at a time."""

    def __init__(self, source: Source, switches: Dict[int, str], shapes: Dict[str, tuple],
                 num_experts: int, block: Optional[dict], float_quant: dict,
                 dtype: Optional[mx.Dtype]):
        self.source, self.shapes, self.num_experts, self.dtype = source, shapes, num_experts, dtype
        self.tensors: Dict[int, Dict[str, str]] = {}  # layer -> "proj.kind" -> name
        found = {}  # quantization -> first "layer L proj" that has it
        for layer, sp in switches.items():
            names = {f"{p}.{k}": f"{sp}.{p}.{k}" for p in PROJECTIONS for k in KINDS
                     if f"{sp}.{p}.{k}" in source.tensors}
            self.tensors[layer] = names
            for p in PROJECTIONS:
                if f"{p}.weight" not in names:
                    raise ConvertError(f"layer {layer}: the source has no {sp}.{p}.weight "
                                       "(mlx-lm's stacked experts)")
                q = None
                if f"{p}.scales" in names:
                    t = source.tensors
                    q = saved_quantization(block, f"{sp}.{p}", shapes[p][1],
                                           t[names[f"{p}.weight"]], t[names[f"{p}.scales"]])
                found.setdefault(None if q is None else tuple(sorted(q.items())),
                                 f"layer {layer} {p}")
        if len(found) > 1:
            kinds = [f"{w}: " + ("float" if q is None else "{mode} {bits}-bit group {group_size}"
                                 .format(**dict(q))) for q, w in found.items()]
            raise ConvertError("the experts are quantized differently from layer to layer or "
                               "projection to projection (" + "; ".join(kinds[:2]) + "); "
                               "Deltafin's records hold one quantization for all")
        saved = next(iter(found))
        self.quant = (float_quant if saved is None
                      else carried_quantization(dict(saved), "the source's experts"))
        # Carried scales keep their saved dtype; quantized ones are in the cast dtype.
        first = self.tensors[next(iter(switches))]
        self._scales_code = saved and source.tensors[first["gate_proj.scales"]].dtype
        self.scales_dtype = (SAFETENSORS[self._scales_code] if saved is not None
                             else str(dtype or mx.bfloat16).split(".")[-1])
        # Float: a weight; affine: weight, scales, biases; the fp modes: no biases.
        kinds = (("weight",) if saved is None else
                 KINDS if self.quant["mode"] == "affine" else ("weight", "scales"))
        for layer, names in self.tensors.items():
            extra = sorted(set(names) - {f"{p}.{k}" for p in PROJECTIONS for k in kinds})
            if extra:
                raise ConvertError(f"layer {layer}: the source has {names[extra[0]]}, which "
                                   f"its experts' quantization ({self._what()}) does not have")
            for p in PROJECTIONS:
                for k in kinds:
                    if f"{p}.{k}" not in names:
                        raise ConvertError(f"layer {layer}: the source lacks {switches[layer]}."
                                           f"{p}.{k} (its experts are {self._what()})")
            for key, name in names.items():
                self._check(key, name)

    def _expected(self, key: str) -> Tuple[tuple, tuple]:
        """(safetensors dtypes, shape of one expert) the section `key` must have."""
        proj, kind = key.split(".")
        out, inp = self.shapes[proj]
        if not self.quant.get("carried_over"):
            return FLOAT_CODES, (out, inp)
        bits, group = self.quant["bits"], self.quant["group_size"]
        if kind == "weight":
            return ("U32",), (out, inp * bits // 32)
        return (self._scales_code,), (out, inp // group)  # one dtype in every record

    def _what(self) -> str:
        q = self.quant
        return (f"{q['mode']} {q['bits']}-bit, group size {q['group_size']}"
                if q.get("carried_over") else "float")

    def _check(self, key: str, name: str):
        t = self.source.tensors[name]
        dtypes, shape = self._expected(key)
        if t.dtype not in dtypes or tuple(t.shape) != (self.num_experts,) + shape:
            raise ConvertError(f"{self.source.path / t.shard}: tensor {name} is {t.dtype} "
                               f"{list(t.shape)}, expected {'/'.join(dtypes)} "
                               f"{[self.num_experts, *shape]}")

    def names(self, layer) -> set:
        return set(self.tensors.get(layer, {}).values())

    def nbytes(self, layer: int, expert: int) -> int:
        return sum(self.source.tensors[n].nbytes for n in self.tensors[layer].values()
                   ) // self.num_experts

    def locations(self, layer: int, expert: int) -> Dict[str, Tuple[str, int, int]]:
        """Record section -> (shard, offset, length) of expert's slice of its
        stacked tensor: the first axis is outermost, so the slice is one run."""
        out = {}
        for key, name in self.tensors[layer].items():
            t = self.source.tensors[name]
            size = t.nbytes // self.num_experts
            out[key] = (t.shard, t.offset + expert * size, size)
        return out

    def _read(self, name: str, run: Tuple[str, int, int]) -> np.ndarray:
        shard, offset, size = run
        t = self.source.tensors[name]
        buf = np.empty(size, dtype=np.uint8)
        try:
            with open(self.source.path / shard, "rb") as f:
                f.seek(offset)
                got = f.readinto(memoryview(buf))
        except OSError as e:
            raise ConvertError(f"{self.source.path / shard}: cannot read ({e.strerror})"
                               ) from None
        if got != size:
            raise ConvertError(f"{self.source.path / shard}: truncated (it shrank during "
                               "the conversion)")
        return buf.view(NUMPY[SAFETENSORS[t.dtype]]).reshape(t.shape[1:])

    def record(self, layer: int, expert: int) -> Dict[str, np.ndarray]:
        """One expert's record sections: its slices as they are when carried over,
        else its float weights cast and quantized as mlx_lm.convert would (groups
        run along the input axis, so one expert alone quantizes to the same bytes)."""
        runs = self.locations(layer, expert)
        names = self.tensors[layer]
        if self.quant.get("carried_over"):
            return {key: self._read(names[key], run) for key, run in runs.items()}
        out = {}
        for proj in PROJECTIONS:
            key = f"{proj}.weight"
            raw = self._read(names[key], runs[key])
            w = mx.array(raw)
            if self.source.tensors[names[key]].dtype == "BF16":
                w = w.view(mx.bfloat16)
            if self.dtype is not None:
                w = w.astype(self.dtype)
            q = mx.quantize(w, self.quant["group_size"], self.quant["bits"],
                            mode=self.quant["mode"])
            for kind, a in zip(KINDS, q):
                out[f"{proj}.{kind}"] = np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16
                                                   else a)
        return out
