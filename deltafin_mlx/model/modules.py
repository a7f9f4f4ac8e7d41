"""Finding and replacing modules inside an mlx-lm model by their parameter paths."""

import re
from dataclasses import dataclass

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


class LayerIndex:
    """Which decoder layer a tensor or module name belongs to, read as the built
    model names its layers: the index after the name of the list that holds them
    (`model.layers.12.`, phi's `transformer.h.3.`), wherever that list sits (a
    source may nest it elsewhere, `model.language_model.layers.12.`, for its
    sanitize to move). The one rule for a name's layer."""

    def __init__(self, paths: list):
        lists = sorted({p.split(".")[-2] for p in paths if "." in p})
        # After a dot or at the start: `h.3.` is no layer inside `mlp.gh.3.`.
        self.pattern = re.compile(r"(?<![^.])(" + "|".join(map(re.escape, lists)) + r")\.(\d+)\."
                                  if lists else r"(?!)")

    def index(self, name: str):
        """The layer `name` lies in, or None (a global)."""
        m = self.pattern.search(name)
        return None if m is None else int(m.group(2))

    def end(self, name: str) -> int:
        """Where the layer's part of `name` ends (`name` lies in a layer)."""
        return self.pattern.search(name).end()

    def generic(self, name: str) -> str:
        """`name` with its layer index as `#` (the same tensor of every layer)."""
        return self.pattern.sub(r"\1.#.", name)

    def moved(self, name: str, layer: int) -> str:
        """`name` as the same tensor of `layer` (only its first layer index changes)."""
        return self.pattern.sub(lambda m: f"{m.group(1)}.{layer}.", name, count=1)

    def rename(self, names: list, layer: int):
        """(`layers.L.`, `layers.0.`) in `names`' own spelling: layer L's names as layer
        0's of a one-layer model, for a sanitize that looks at layer 0 only."""
        m = next(m for m in map(self.pattern.search, names) if m is not None)
        return (f"{m.group(1)}.{layer}.", f"{m.group(1)}.0.")


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


def routed_expert_paths(model: nn.Module, paths: list, model_type) -> dict:
    """layer index -> the path of its routed-expert module, for every layer that has
    one; a model with none (a dense model, or no layers) is refused in one line."""
    from deltafin_mlx.errors import ModelError

    try:
        found = {i: f"{p}.{sp}" for i, p in enumerate(paths)
                 if (sp := switch_path(get_module(model, p))) is not None}
    except ModelError as e:
        raise ModelError(f"{model_type}: {e}") from None
    found = {i: sp for i, sp in found.items()  # a switch of 0 experts routes nothing
             if next(iter(switch_linears(get_module(model, sp)).values()), (0,))[0]}
    if not found:
        raise ModelError(
            f"{model_type}: not a Mixture of Experts model (mlx-lm builds it with no routed "
            "experts, no SwitchGLU/SwitchMLP module); Deltafin streams routed experts, and "
            "mlx-lm runs this model as it is (mlx_lm.generate)")
    return found


@dataclass(frozen=True)
class MoeShape:
    """A model's Mixture of Experts as mlx-lm's built model holds it: read from its
    modules, never from config.json's key names (each family names them its own way:
    `num_experts_per_tok`, ERNIE's `moe_k`, Step's `moe_top_k`, ...)."""

    experts_per_token: int  # the routed experts the router gives each token
    num_experts: int  # routed experts per MoE layer
    # What an MoE block computes per token beside its routed experts (shared
    # experts, router): the output widths of its other matrices, in elements.
    shared_width: int


class _Routed(Exception):
    pass


class _RouteProbe(nn.Module):
    def __call__(self, x, indices, *args, **kwargs):
        raise _Routed(indices.shape[-1])  # the router's indices: k per token


def routed_per_token(model: nn.Module, switch_path: str, hidden: int):
    """How many experts the model's router gives each token at `switch_path`: the
    module around the routed experts (or, where that one is only a wrapper called with
    the routing, the module around it) is called on one token of zeros with a probe in
    their place. Nothing is evaluated: the indices' shape is known lazily. None where
    no call reaches the probe."""
    import mlx.core as mx

    switch = get_module(model, switch_path)
    set_module(model, switch_path, _RouteProbe())
    try:
        parent = switch_path
        while "." in parent:
            parent = parent.rpartition(".")[0]
            module = get_module(model, parent)
            if isinstance(module, list):
                return None  # reached the list of layers
            try:
                module(mx.zeros((1, 1, hidden)))
            except _Routed as routed:
                return routed.args[0]
            except Exception:  # a module that takes other arguments: the one around it
                continue
        return None
    finally:
        set_module(model, switch_path, switch)


def shared_width(shapes: dict, switch_path: str) -> int:
    """`MoeShape.shared_width` of the block around `switch_path`, from its parameters'
    shapes (name -> shape: a built model's, or a converted model's trunk tensors)."""
    block = switch_path.rpartition(".")[0] + "."
    return sum(shape[0] for name, shape in shapes.items()
               if name.startswith(block) and not name.startswith(switch_path + ".")
               and name.endswith(".weight") and len(shape) == 2)


def moe_shape(model: nn.Module, switches: dict, model_type) -> MoeShape:
    """The MoeShape of a built model whose routed-expert modules are `switches`
    (`routed_expert_paths`); its first MoE layer speaks for all (one record layout)."""
    from mlx.utils import tree_flatten

    from deltafin_mlx.compat import embedding_path
    from deltafin_mlx.errors import ModelError

    first = switches[min(switches)]
    embed = get_module(model, embedding_path(model))
    hidden = getattr(embed, "dims", None) or embed.weight.shape[-1]
    k = routed_per_token(model, first, hidden)
    if k is None:
        raise ModelError(f"{model_type}: calling mlx-lm's MoE block at {first} does not "
                         "reach its routed experts, so how many each token uses is unknown")
    experts = next(iter(switch_linears(get_module(model, first)).values()))[0]
    shapes = {n: a.shape for n, a in tree_flatten(model.parameters())}
    return MoeShape(k, experts, max(shared_width(shapes, sp) for sp in switches.values()))


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


def model_vocab(model) -> int:
    """Rows of the model's embedding table, which token ids index (a tokenizer may
    know more ids than the model has rows)."""
    from deltafin_mlx.compat import embedding_path

    embed = get_module(model, embedding_path(model))
    return getattr(type(embed), "vocab_size", None) or embed.weight.shape[0]
