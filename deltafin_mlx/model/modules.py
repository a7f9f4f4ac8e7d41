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


def switch_path(layer: nn.Module):
    """The path of the layer's routed-expert SwitchGLU within it, or None."""
    # Imported here: importing any of mlx-lm imports its generation code and
    # transformers, which `list` and `plan` of a converted model never need.
    from mlx_lm.models.switch_layers import SwitchGLU

    for path, module in layer.named_modules():
        if isinstance(module, SwitchGLU):
            return path
    return None


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
