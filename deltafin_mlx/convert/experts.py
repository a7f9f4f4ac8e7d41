"""Routed experts: find them in a source checkpoint and turn each into one bank record.

Two layouts: one tensor per expert and projection (Hugging Face releases, here),
and mlx-lm's stacked experts (convert/mlx_lm_source.py); `open_experts` picks the
one the source has. Both give, per expert, its record, the source bytes it reads and
(for experts carried over byte for byte) where its sections lie in the source.

Each expert is quantized on its own (`mx.quantize` groups run along the input axis,
so quantizing one expert gives the same bytes as quantizing mlx-lm's stacked
`(E, out, in)` tensor). Kimi K3's MXFP4 experts are already in MLX's `mxfp4` layout
and are carried over byte for byte.
"""

import re
from collections import defaultdict
from typing import Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from deltafin_mlx.format.dtypes import to_numpy
from deltafin_mlx.format.record import PROJECTIONS

from deltafin_mlx.errors import ConvertError

from deltafin_mlx.model.quantization import expert_quantization, mlx_lm_quantization

from .mlx_lm_source import StackedExperts, is_stacked
from .source import Source

# Source names of routed experts in every supported layout:
#   Kimi K3:                 ...layers.L.block_sparse_moe.experts.E.w1.weight_packed / weight_scale
#   Mixtral:                 ...layers.L.block_sparse_moe.experts.E.w1.weight
#   DeepSeek-V3 / K2, Qwen3: ...layers.L.mlp.experts.E.gate_proj.weight
EXPERT_RE = re.compile(
    r"^(?P<prefix>.*\blayers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe))\.experts\."
    r"(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\."
    r"(?P<kind>weight|weight_packed|weight_scale)$"
)
PROJ_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def parse_expert_name(name: str):
    """(layer, expert, projection, kind) for a routed-expert tensor name, else None."""
    m = EXPERT_RE.match(name)
    if m is None:
        return None
    proj = PROJ_NAMES.get(m["proj"], m["proj"])
    return int(m["layer"]), int(m["expert"]), proj, m["kind"]


def group_experts(names) -> Dict[int, Dict[int, Dict[str, str]]]:
    """layer -> expert -> "proj.kind" -> source name."""
    out = defaultdict(lambda: defaultdict(dict))
    for name in names:
        parsed = parse_expert_name(name)
        if parsed:
            layer, expert, proj, kind = parsed
            out[layer][expert][f"{proj}.{kind}"] = name
    return out


def expert_record(
    source: Source,
    names: Dict[str, str],
    layer: int,
    expert: int,
    shapes: Dict[str, tuple],
    quant: dict,
    dtype: Optional[mx.Dtype],
) -> Dict[str, np.ndarray]:
    """One expert's tensors in MLX's quantized layout, as numpy arrays."""
    out = {}
    for proj in PROJECTIONS:
        out_dim, in_dim = shapes[proj]
        if quant.get("carried_over"):
            packed_name = names.get(f"{proj}.weight_packed")
            scale_name = names.get(f"{proj}.weight_scale")
            if packed_name is None or scale_name is None:
                raise ConvertError(
                    f"layer {layer} expert {expert}: {proj} lacks weight_packed/weight_scale"
                )
            _check(source, packed_name, ("U8",), (out_dim, in_dim // 2))
            _check(source, scale_name, ("U8",), (out_dim, in_dim // 32))
            packed = source.load(packed_name)
            out[f"{proj}.weight"] = to_numpy(packed.view(mx.uint32))
            out[f"{proj}.scales"] = to_numpy(source.load(scale_name))
        else:
            w_name = names.get(f"{proj}.weight", names.get(f"{proj}.weight_packed"))
            if w_name is None:
                raise ConvertError(f"layer {layer} expert {expert}: missing {proj} weight")
            _check(source, w_name, ("BF16", "F16", "F32"), (out_dim, in_dim))
            w = source.load(w_name)
            if dtype is not None:
                w = w.astype(dtype)
            q = mx.quantize(w, quant["group_size"], quant["bits"], mode=quant["mode"])
            out[f"{proj}.weight"] = to_numpy(q[0])
            out[f"{proj}.scales"] = to_numpy(q[1])
            if len(q) > 2:
                out[f"{proj}.biases"] = to_numpy(q[2])
    return out


def _check(source: Source, name: str, dtypes, shape):
    t = source.tensors[name]
    if t.dtype not in dtypes or tuple(t.shape) != tuple(shape):
        raise ConvertError(
            f"{source.path / t.shard}: tensor {name} is {t.dtype} {list(t.shape)}, "
            f"expected {'/'.join(dtypes)} {list(shape)}"
        )


def linkable(quant: dict) -> bool:
    """Experts whose record sections are source tensors byte for byte (Kimi K3's
    MXFP4 ones): only these can be linked instead of copied."""
    return bool(quant.get("carried_over"))


class PerExpertTensors:
    """The routed experts of a Hugging Face release: one tensor per expert."""

    def __init__(self, source: Source, switches: Dict[int, str], shapes: Dict[str, tuple],
                 num_experts: int, quant: dict, dtype: Optional[mx.Dtype]):
        self.source, self.shapes, self.quant, self.dtype = source, shapes, quant, dtype
        self.scales_dtype = str(dtype or mx.bfloat16).split(".")[-1]
        self.by_layer = group_experts(source.tensors)
        for layer in switches:
            found = self.by_layer.get(layer, {})
            if len(found) != num_experts or set(found) != set(range(num_experts)):
                raise ConvertError(f"layer {layer}: source has {len(found)} routed experts, "
                                   f"config says {num_experts}")

    def names(self, layer) -> set:
        return {n for e in self.by_layer.get(layer, {}).values() for n in e.values()}

    def nbytes(self, layer: int, expert: int) -> int:
        return sum(self.source.nbytes(n) for n in self.by_layer[layer][expert].values())

    def record(self, layer: int, expert: int) -> Dict[str, np.ndarray]:
        return expert_record(self.source, self.by_layer[layer][expert], layer, expert,
                             self.shapes, self.quant, self.dtype)

    def locations(self, layer: int, expert: int) -> Dict[str, Tuple[str, int, int]]:
        """Record section -> (shard, offset, length) of the source tensor holding
        its bytes as they are (for a linkable expert, its record already checked)."""
        names = self.by_layer[layer][expert]
        out = {}
        for proj in PROJECTIONS:
            for kind, src in (("weight", "weight_packed"), ("scales", "weight_scale")):
                t = self.source.tensors[names[f"{proj}.{src}"]]
                out[f"{proj}.{kind}"] = (t.shard, t.offset, t.nbytes)
        return out


def open_experts(source: Source, config: dict, switches: Dict[int, str],
                 shapes: Dict[str, tuple], num_experts: int, expert_bits: int,
                 expert_group_size: int, dtype: Optional[mx.Dtype]):
    """The source's routed experts in whichever layout it has them (`switches`:
    MoE layer -> its SwitchGLU's path in mlx-lm's model)."""
    if is_stacked(source, switches.values()):
        float_quant = {"mode": "affine", "bits": expert_bits, "group_size": expert_group_size}
        return StackedExperts(source, switches, shapes, num_experts,
                              mlx_lm_quantization(config), float_quant, dtype)
    if mlx_lm_quantization(config) is not None:
        raise ConvertError("config.json has mlx-lm's quantization block but the source has "
                           f"no stacked experts ({next(iter(switches.values()))}.gate_proj."
                           "weight): not a directory mlx_lm.convert wrote")
    quant = expert_quantization(config, expert_bits, expert_group_size)
    return PerExpertTensors(source, switches, shapes, num_experts, quant, dtype)
