"""How the converter quantizes: the options it takes and what routed experts become.

Stated here, not in the converter, because the planner applies the same rules to a
source it has not downloaded.
"""

from deltafin_mlx.errors import ConvertError
from deltafin_mlx.model.config import text_config

BITS = (2, 3, 4, 6, 8)
GROUP_SIZES = (32, 64, 128)


def check_quantization(bits, group_size: int, expert_bits: int, expert_group_size: int):
    """The conversion options' quantization, or one line naming the bad option."""
    if bits is not None and bits not in BITS:
        raise ConvertError(f"--bits must be one of {BITS} (got {bits})")
    if group_size not in GROUP_SIZES:
        raise ConvertError(f"--group-size must be one of {GROUP_SIZES}")
    if expert_bits not in BITS:
        raise ConvertError(f"--expert-bits must be one of {BITS}")
    if expert_group_size not in GROUP_SIZES:
        raise ConvertError(f"--expert-group-size must be one of {GROUP_SIZES}")


def expert_quantization(config: dict, expert_bits: int, expert_group_size: int) -> dict:
    """What a source's routed experts become: K3's MXFP4 experts are carried over
    as they are; bf16/fp16/fp32 experts are quantized (affine) with the options."""
    qc = config.get("quantization_config") or text_config(config).get("quantization_config")
    if qc:
        fmt = qc.get("format")
        if qc.get("quant_method") == "compressed-tensors" and fmt == "mxfp4-pack-quantized":
            return {"mode": "mxfp4", "bits": 4, "group_size": 32, "carried_over": True}
        raise ConvertError(
            f"source quantization {qc.get('quant_method')}/{fmt} is not supported "
            "(supported: bf16/fp16/fp32 weights, or compressed-tensors mxfp4 experts)"
        )
    return {"mode": "affine", "bits": expert_bits, "group_size": expert_group_size}
