"""The sections of one expert's bank record: which tensors, in which order and shape.

A record holds one expert of a routed-expert module (mlx-lm's SwitchGLU, SwitchMLP):
for each of its expert linears, in the module's order, the quantized `weight`,
`scales`, `biases` (affine only) and the per-expert float `bias` where the module
has one (gpt-oss); experts kept in float (mode "float") hold their float `weight`
alone (and `bias`). A SwitchGLU without biases gives the gate/up/down records of
every model directory written before. The converter writes records in this layout,
the manifest check expects it, and the planner sizes a source's records with it
before conversion.
"""

from typing import Dict, List, Optional

from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.bank import Section, make_sections

# mlx-lm's SwitchGLU projections, in record order (the layout tensor parallelism splits).
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# A section's name is "<linear>.<kind>", with kinds in this order.
KINDS = ("weight", "scales", "biases", "bias")
# The experts' mode when they are kept in their float dtype (`quantization.experts`
# is then {"mode": "float", "dtype": ...}: mlx-lm's SwitchLinear, not quantized).
FLOAT_MODE = "float"


def float_experts(dtype: str) -> dict:
    """The experts' quantization when they are kept in float `dtype`."""
    return {"mode": FLOAT_MODE, "dtype": dtype}


def input_size(q: dict, weight_shape) -> int:
    """A linear's input size from its record weight's shape (out, columns) and its
    `linear_quant`: a float weight's columns, or the words packed at `bits`."""
    if q["mode"] == FLOAT_MODE:
        return weight_shape[-1]
    return weight_shape[-1] * 32 // q["bits"]


def linear_quant(quant: dict, name: str) -> dict:
    """How the record's linear `name` is quantized: the experts' quantization, or
    its own entry in `linears` where a model's recipe gives it other bits
    (granitemoe's down_proj at 8 bits, as mlx-lm's quant_predicate says)."""
    if quant["mode"] == FLOAT_MODE:
        return {"mode": FLOAT_MODE, "bits": None, "group_size": None}
    own = (quant.get("linears") or {}).get(name) or {}
    return {k: own.get(k, quant[k]) for k in ("mode", "bits", "group_size")}


def expert_sections(linears: Dict[str, tuple], quant: dict, scales_dtype: str,
                    bias_dtype: Optional[str] = None) -> List[Section]:
    """The record layout for experts whose linears are `linears` (name -> (out, in)
    or (out, in, has_bias), in the module's order), quantized as `quant` says (`linear_quant`);
    per-expert biases are kept in `bias_dtype` (default: `scales_dtype`). A linear
    whose input size the group size does not divide cannot be quantized: one line
    (the converter and the planner both lay records out here)."""
    tensors = []
    for name, dims in linears.items():
        q = linear_quant(quant, name)
        bits, group, mode = q["bits"], q["group_size"], q["mode"]
        out_dim, in_dim = dims[:2]
        if mode == FLOAT_MODE:  # kept as the source has it (quant["dtype"])
            tensors.append((f"{name}.weight", quant["dtype"], (out_dim, in_dim)))
        elif in_dim % group:
            raise ModelError(f"expert {name} input size {in_dim} is not a multiple of the "
                             f"expert group size {group} (choose another --expert-group-size)")
        else:
            tensors.append((f"{name}.weight", "uint32", (out_dim, in_dim * bits // 32)))
        if mode == "affine":
            tensors.append((f"{name}.scales", scales_dtype, (out_dim, in_dim // group)))
            tensors.append((f"{name}.biases", scales_dtype, (out_dim, in_dim // group)))
        elif mode != FLOAT_MODE:  # MLX's microscaled modes: one uint8 exponent per group
            tensors.append((f"{name}.scales", "uint8", (out_dim, in_dim // group)))
        if len(dims) > 2 and dims[2]:
            tensors.append((f"{name}.bias", bias_dtype or scales_dtype, (out_dim,)))
    return make_sections(tensors)


def record_linears(names) -> Dict[str, List[str]]:
    """The expert linears a record's section names hold: linear -> its kinds, in
    record order."""
    out: Dict[str, List[str]] = {}
    for n in names:
        name, _, kind = n.rpartition(".")
        out.setdefault(name, []).append(kind)
    return out
