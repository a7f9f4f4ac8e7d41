"""Trunk weights: everything but routed experts, converted one decoder layer at a time
with mlx-lm's own model class, `sanitize`, cast and quantization rules.

The model skeleton is built lazily (its random initial weights are never evaluated),
each layer's module receives that layer's sanitized source tensors, is cast and
quantized exactly as `mlx_lm.convert` would do it, saved, and then dropped.
"""

from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path
from mlx_lm.utils import _get_classes

from .source import ConvertError

CONVERSION_DTYPES = ("float16", "bfloat16", "float32")


def build_skeleton(config: dict) -> nn.Module:
    try:
        model_class, args_class = _get_classes(config)
        return model_class(args_class.from_dict(config))
    except Exception as e:
        raise ConvertError(f"cannot build the mlx-lm model from config.json ({e})") from None


def source_dtype(config: dict) -> Optional[mx.Dtype]:
    """The dtype mlx_lm.convert casts floating weights to (None: leave as is)."""
    dtype = config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    return getattr(mx, dtype) if dtype in CONVERSION_DTYPES else None


def release(module: nn.Module):
    """Drop a processed layer's weights (the module stays: sanitize inspects it)."""
    module.update(tree_map(lambda _: mx.zeros((0,)), module.parameters()))


def convert_unit(
    model: nn.Module,
    prefix: str,
    module: nn.Module,
    weights: Dict[str, mx.array],
    skip: Callable[[str], bool],
    trunk_quant: Optional[dict],
    dtype: Optional[mx.Dtype],
) -> Tuple[Dict[str, mx.array], Dict[str, dict]]:
    """Load `weights` (sanitized, full mlx-lm names) into `module` (found at
    `prefix`), cast and quantize it as mlx_lm.convert does, and return its
    parameters by full name plus the quantization of each quantized module.
    Parameters whose full path `skip` accepts (routed experts; other layers when
    converting the globals) are left out."""

    def full(p):
        return f"{prefix}.{p}" if prefix else p

    skipped = skip
    expected = {
        full(k): v
        for k, v in tree_flatten(module.parameters())
        if not skipped(full(k))
    }
    for name, w in weights.items():
        if name not in expected:
            raise ConvertError(f"unexpected tensor {name} (mlx-lm's model has no such parameter)")
        if tuple(w.shape) != tuple(expected[name].shape):
            raise ConvertError(
                f"tensor {name} has shape {list(w.shape)}, "
                f"expected {list(expected[name].shape)}"
            )
        if not (mx.issubdtype(w.dtype, mx.floating) or w.dtype == expected[name].dtype):
            raise ConvertError(f"tensor {name} has dtype {w.dtype}, expected a float")
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ConvertError(f"missing tensor {missing[0]} ({len(missing)} missing in all)")
    n = len(prefix) + 1 if prefix else 0
    module.load_weights([(k[n:], v) for k, v in weights.items()], strict=False)

    if dtype is not None:
        cast_predicate = getattr(model, "cast_predicate", lambda _: True)

        def set_dtype(k, v):
            if cast_predicate(full(k)) and mx.issubdtype(v.dtype, mx.floating):
                return v.astype(dtype)
            return v

        module.update(tree_map_with_path(set_dtype, module.parameters()))

    quantized = quantize_like_mlx_lm(model, module, prefix, skip, trunk_quant)
    params = {full(k): v for k, v in tree_flatten(module.parameters()) if not skipped(full(k))}
    return params, quantized


def quantize_like_mlx_lm(model: nn.Module, module: nn.Module, prefix: str,
                         skip: Callable[[str], bool], trunk_quant: Optional[dict]) -> Dict[str, dict]:
    """Quantize `module` (found at `prefix` in `model`) with mlx_lm.utils.quantize_model's
    rules on full paths: modules with `to_quantized` whose input size the group size
    divides, as the model's own `quant_predicate` says. Returns path -> params."""
    quantized = {}
    if trunk_quant is None:
        return quantized
    group_size, bits = trunk_quant["group_size"], trunk_quant["bits"]
    model_predicate = getattr(model, "quant_predicate", None)

    def predicate(p, m):
        p = f"{prefix}.{p}" if prefix else p
        if skip(p) or not hasattr(m, "to_quantized"):
            return False
        if m.weight.shape[-1] % group_size != 0:
            return False
        params = model_predicate(p, m) if model_predicate is not None else True
        if params is False:
            return False
        if params is True:
            params = dict(trunk_quant)
        quantized[p] = params
        return params

    nn.quantize(module, group_size, bits, mode=trunk_quant["mode"], class_predicate=predicate)
    return quantized
