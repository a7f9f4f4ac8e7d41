"""Routed experts: find them in a source checkpoint and turn each into one bank record.

Each expert is quantized on its own (`mx.quantize` groups run along the input axis,
so quantizing one expert gives the same bytes as quantizing mlx-lm's stacked
`(E, out, in)` tensor). Kimi K3's MXFP4 experts are already in MLX's `mxfp4` layout
and are carried over byte for byte.
"""

import re
from collections import defaultdict
from typing import Dict, Optional

import mlx.core as mx
import numpy as np

from deltafin_mlx.format.dtypes import to_numpy
from deltafin_mlx.format.record import PROJECTIONS

from deltafin_mlx.errors import ConvertError

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


def expert_locations(source: Source, names: Dict[str, str]) -> Dict[str, str]:
    """Record section -> the source tensor holding its bytes as they are (for a
    linkable expert whose record `expert_record` has already checked)."""
    out = {}
    for proj in PROJECTIONS:
        out[f"{proj}.weight"] = names[f"{proj}.weight_packed"]
        out[f"{proj}.scales"] = names[f"{proj}.weight_scale"]
    return out
