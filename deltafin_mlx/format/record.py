"""The sections of one expert's bank record: which tensors, in which order and shape.

The converter writes records in this layout, the manifest check expects it, and the
planner sizes a source's records with it before conversion.
"""

from typing import Dict, List

from deltafin_mlx.format.bank import Section, make_sections

# mlx-lm's SwitchGLU projections, in record order.
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_sections(shapes: Dict[str, tuple], quant: dict, scales_dtype: str) -> List[Section]:
    """The record layout for experts whose unquantized projections have `shapes`
    ((out, in) per projection), quantized as `quant` says."""
    bits, group, mode = quant["bits"], quant["group_size"], quant["mode"]
    tensors = []
    for proj in PROJECTIONS:
        out_dim, in_dim = shapes[proj]
        tensors.append((f"{proj}.weight", "uint32", (out_dim, in_dim * bits // 32)))
        if mode == "mxfp4":
            tensors.append((f"{proj}.scales", "uint8", (out_dim, in_dim // group)))
        else:
            tensors.append((f"{proj}.scales", scales_dtype, (out_dim, in_dim // group)))
            tensors.append((f"{proj}.biases", scales_dtype, (out_dim, in_dim // group)))
    return make_sections(tensors)
