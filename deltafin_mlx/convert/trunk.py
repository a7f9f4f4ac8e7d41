"""Trunk weights: everything but routed experts, converted one decoder layer at a time
with mlx-lm's own model class, `sanitize`, cast and quantization rules.

The model skeleton is built lazily (its random initial weights are never evaluated),
each layer's module receives that layer's sanitized source tensors, is cast and
quantized exactly as `mlx_lm.convert` would do it, saved, and then dropped. A model
mlx_lm.convert already quantized is taken as `mlx_lm.load` takes it: its modules get
the quantized classes its weights were saved with, and nothing is cast or quantized.
"""

from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from deltafin_mlx.errors import ConvertError
from deltafin_mlx.model.build import quantize_like_mlx_lm
from deltafin_mlx.model.quantization import module_quantization


def release(module: nn.Module):
    """Drop a processed layer's weights (the module stays: sanitize inspects it)."""
    module.update(tree_map(lambda _: mx.zeros((0,)), module.parameters()))


def convert_unit(model: nn.Module,
                 prefix: str,
                 module: nn.Module,
                 weights: Dict[str, mx.array],
                 skip: Callable[[str], bool],
                 trunk_quant: Optional[dict],
                 dtype: Optional[mx.Dtype],
                 saved_quant: Optional[dict] = None) -> Tuple[Dict[str, mx.array], Dict[str, dict]]:
    """Load `weights` (sanitized, full mlx-lm names) into `module` (found at
    `prefix`), cast and quantize it as mlx_lm.convert does, and return its
    parameters by full name plus the quantization of each quantized module.
    Parameters whose full path `skip` accepts (routed experts; other layers when
    converting the globals) are left out. `saved_quant`: the quantization block of
    a model mlx_lm.convert quantized, whose weights are loaded as they are."""

    def full(p):
        return f"{prefix}.{p}" if prefix else p

    if saved_quant is not None:
        quantized = quantize_as_saved(module, prefix, skip, weights, saved_quant)

    skipped = skip
    expected = {full(k): v for k, v in tree_flatten(module.parameters()) if not skipped(full(k))}
    for name, w in weights.items():
        if name not in expected:
            raise ConvertError(f"unexpected tensor {name} (mlx-lm's model has no such parameter)")
        if tuple(w.shape) != tuple(expected[name].shape):
            raise ConvertError(f"tensor {name} has shape {list(w.shape)}, "
                               f"expected {list(expected[name].shape)}")
        if not (mx.issubdtype(w.dtype, mx.floating) or w.dtype == expected[name].dtype):
            raise ConvertError(f"tensor {name} has dtype {w.dtype}, expected a float")
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ConvertError(f"missing tensor {missing[0]} ({len(missing)} missing in all)")
    n = len(prefix) + 1 if prefix else 0
    module.load_weights([(k[n:], v) for k, v in weights.items()], strict=False)

    if saved_quant is None:
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


def quantize_as_saved(module: nn.Module, prefix: str, skip: Callable[[str], bool],
                      weights: Dict[str, mx.array], block: dict) -> Dict[str, dict]:
    """Give `module`'s modules the quantized classes their saved weights have, by
    mlx_lm.utils.load_model's rule: a module's entry in the quantization block,
    else, where its `.scales` were saved, the parameters its shapes show
    (mlx-lm's `infer_quant_config`). Returns path -> params."""
    from mlx_lm.utils import infer_quant_config

    quantized = {}

    def predicate(p, m):
        p = f"{prefix}.{p}" if prefix else p
        if skip(p):
            return False
        if p in block:  # as saved, nulls as MLX takes them
            params = block[p] if not isinstance(block[p], dict) else {
                **block[p], **module_quantization(block, p)}
        elif not hasattr(m, "to_quantized") or f"{p}.scales" not in weights:
            return False
        else:
            params = infer_quant_config(p, m, weights)
        if params is not False:
            quantized[p] = params
        return params

    try:
        nn.quantize(module, block["group_size"], block["bits"], mode=block.get("mode", "affine"),
                    class_predicate=predicate)
    except ValueError as e:
        raise ConvertError(f"config.json's quantization: {e}") from None
    return quantized
