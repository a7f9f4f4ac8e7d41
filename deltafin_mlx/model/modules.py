"""Finding and replacing modules inside an mlx-lm model by their parameter paths."""

import mlx.nn as nn


def get_module(model: nn.Module, path: str):
    m = model
    for part in path.split("."):
        m = m[int(part)] if isinstance(m, list) else m[part]
    return m


def set_module(model: nn.Module, path: str, new: nn.Module):
    parent_path, _, last = path.rpartition(".")
    parent = get_module(model, parent_path) if parent_path else model
    if isinstance(parent, list):
        parent[int(last)] = new
    else:
        parent[last] = new


def layer_paths(model: nn.Module) -> list:
    """The module path of every decoder layer, in order."""
    ids = {id(layer): i for i, layer in enumerate(model.layers)}
    paths = [None] * len(ids)
    for path, module in model.named_modules():
        if id(module) in ids:
            paths[ids[id(module)]] = path
    return paths


def switch_classes():
    """mlx-lm's routed-expert modules: what Deltafin streams (their quantized forms
    are the same classes, with QuantizedSwitchLinear children)."""
    # Imported here: importing any of mlx-lm imports its generation code and
    # transformers, which `list` and `plan` of a converted model never need.
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    return (SwitchGLU, SwitchMLP)


def switch_paths(layer: nn.Module) -> list:
    """The paths of the routed-expert modules (SwitchGLU/SwitchMLP) within `layer`."""
    classes = switch_classes()
    return [path for path, module in layer.named_modules() if isinstance(module, classes)]


def switch_path(layer: nn.Module):
    """The path of the layer's routed-expert module within it, or None; a layer
    with more than one is refused (a bank holds one module's experts per layer)."""
    paths = switch_paths(layer)
    if len(paths) > 1:
        from deltafin_mlx.errors import ModelError

        raise ModelError(f"a decoder layer holds {len(paths)} routed-expert modules "
                         f"({', '.join(sorted(paths))}); Deltafin streams one per layer")
    return paths[0] if paths else None


def switch_linears(switch: nn.Module) -> dict:
    """A routed-expert module's expert linears in the module's order: name ->
    (num_experts, out, in, has per-expert bias), float or quantized."""
    out = {}
    for name, child in switch.children().items():
        if not isinstance(child, nn.Module) or "weight" not in child:
            continue
        e, o = child.weight.shape[:2]
        i = child.scales.shape[-1] * child.group_size if "scales" in child else child.weight.shape[2]
        out[name] = (e, o, i, "bias" in child)
    return out


def find_path(model: nn.Module, suffix: str):
    for path, _ in model.named_modules():
        if path == suffix or path.endswith("." + suffix):
            return path
    return None


def model_vocab(model) -> int:
    """Rows of the model's embedding table, which token ids index (a tokenizer may
    know more ids than the model has rows)."""
    embed = get_module(model, find_path(model, "embed_tokens"))
    return getattr(type(embed), "vocab_size", None) or embed.weight.shape[0]
