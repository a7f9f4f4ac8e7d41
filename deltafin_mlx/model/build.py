"""mlx-lm's own model class, built from config.json and quantized as mlx-lm would.

The converter builds it to convert a layer at a time, the planner to count a
source's bytes before anything is downloaded, the loader to run it: all three get
the same modules, casts and quantized classes from here.
"""

from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from deltafin_mlx.compat import model_classes
from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.dtypes import mlx_dtype
from deltafin_mlx.model.config import check_config
from deltafin_mlx.model.quantization import cast_dtype


def build_model(config: dict, where="config.json") -> nn.Module:
    """mlx-lm's model for `config`, lazily: its random initial weights are never
    evaluated unless something loads over them. Its sizes are checked first."""
    check_config(config, where)
    try:
        model_class, args_class = model_classes(config)
        return model_class(args_class.from_dict(config))
    except Exception as e:
        raise ModelError(f"{where}: cannot build mlx-lm's model ({e})") from None


def build_moe(config: dict, where="config.json"):
    """mlx-lm's model of `config` built lazily, its decoder layers' paths, its
    routed-expert modules (layer -> path) and its MoeShape, from config.json alone;
    a model without routed experts is refused in one line (mlx-lm runs it)."""
    from deltafin_mlx.model.modules import layer_paths, moe_shape, routed_expert_paths

    model = build_model(config, where)
    paths = layer_paths(model)
    model_type = config.get("model_type", "?")
    switches = routed_expert_paths(model, paths, model_type)
    return model, paths, switches, moe_shape(model, switches, model_type)


def source_dtype(config: dict) -> Optional[mx.Dtype]:
    """The dtype mlx_lm.convert casts floating weights to (None: leave as is)."""
    dtype = cast_dtype(config)
    return mlx_dtype(dtype) if dtype is not None else None


def quantize_like_config(model: nn.Module, config: dict):
    """Give modules the quantized classes config.json names (mlx-lm's rules)."""
    quant = config.get("quantization")
    if not quant:
        return

    def predicate(p, m):
        if p in quant:
            return quant[p]
        return False

    nn.quantize(model, quant["group_size"], quant["bits"], mode=quant.get("mode", "affine"),
                class_predicate=predicate)


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


def expert_recipe(model: nn.Module, switch_path: str, linear: str, float_quant: dict) -> dict:
    """How mlx_lm.convert quantizes float experts' `linear` of the routed-expert
    module at `switch_path`: `float_quant` (the options), unless the model's own
    quant_predicate gives it other settings (granitemoe's down_proj at 8 bits)."""
    from deltafin_mlx.errors import ConvertError
    from deltafin_mlx.model.modules import get_module

    predicate = getattr(model, "quant_predicate", None)
    path = f"{switch_path}.{linear}"
    says = predicate(path, get_module(model, path)) if predicate is not None else True
    if says is False:
        raise ConvertError(f"mlx-lm's recipe for {type(model).__module__.rsplit('.', 1)[-1]} "
                           f"keeps {path} in float; Deltafin's expert records are quantized")
    return {**float_quant, **(says if isinstance(says, dict) else {})}
