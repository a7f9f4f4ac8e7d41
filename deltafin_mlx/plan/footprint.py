"""What a model is made of, in bytes: the planner's input.

From a converted model's manifest, or — before anything is downloaded — from a
source `config.json` plus the conversion options, by building mlx-lm's model class
lazily (no weight is ever allocated) and applying the converter's own cast and
quantization rules to it.
"""

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import mlx.core as mx

from deltafin_mlx.format.bank import Section, record_size_of
from deltafin_mlx.format.dtypes import FLOATS, ITEMSIZE, name_of
from deltafin_mlx.plan.slots import slot_bytes
from deltafin_mlx.format.record import FLOAT_MODE, expert_sections, input_size, linear_quant
from deltafin_mlx.model.build import build_moe, expert_recipe, quantize_like_mlx_lm, source_dtype
from deltafin_mlx.model.config import tied_embeddings
from deltafin_mlx.model.modules import LayerIndex, MoeShape, get_module, shared_width, switch_linears
from deltafin_mlx.model.quantization import (check_quantization, expert_quantization,
                                             mlx_lm_quantization, one_quantization,
                                             saved_layer_quantization)
from deltafin_mlx.model.shard import expert_layout



@dataclass
class Unit:
    """A piece of trunk loaded as one: a decoder layer's trunk, or the globals."""

    key: str  # "globals" or the decoder layer index
    memory_bytes: int  # once loaded, floats at the activation dtype
    disk_bytes: int
    weights: int  # matrix elements read per token (compute cost)
    signature: tuple = ()  # units with equal signatures can share buffers


@dataclass
class Inventory:
    model_type: str
    config: dict
    units: Dict[str, Unit]
    embed_bytes: int  # the embedding table's share of the globals (rows read on demand)
    embed_tied: bool
    moe_layers: List[int]
    moe: MoeShape
    record_size: int
    sections: List[Section]
    expert_weights: int  # matrix elements of one expert
    activation_dtype: mx.Dtype
    notes: List[str] = field(default_factory=list)
    # A source's trunk per unit as the checkpoint stores it (its dtype, unquantized):
    # what a download holds besides the experts (only from a config.json).
    source_unit_bytes: Dict[str, int] = field(default_factory=dict)
    # Every MoE layer's record sections where they differ from layer to layer
    # (mlx-lm's mixed_* recipes; empty otherwise). Its pool is then partitioned by
    # layer (engine/cache.py): equal slots per layer, so one slot's bytes are the
    # layers' mean (rounded up) and `record_size` the largest (the reader's buffers).
    layer_sections: Dict[int, List[Section]] = field(default_factory=dict)

    @property
    def num_experts(self) -> int:
        return self.moe.num_experts

    @property
    def experts_per_token(self) -> int:
        return self.moe.experts_per_token

    @property
    def slot_bytes(self) -> int:
        if self.layer_sections:
            total = sum(slot_bytes(s, self.activation_dtype) for s in self.layer_sections.values())
            return -(-total // len(self.layer_sections))
        return slot_bytes(self.sections, self.activation_dtype)

    @property
    def trunk_bytes(self) -> int:
        return sum(u.memory_bytes for u in self.units.values())

    @property
    def mean_record_size(self) -> float:
        """A record's bytes read, on average over the layers (equal but for mixed_*)."""
        return self.expert_disk_bytes / (self.num_experts * len(self.moe_layers))

    @property
    def expert_disk_bytes(self) -> int:
        if self.layer_sections:
            return self.num_experts * sum(record_size_of(s) for s in self.layer_sections.values())
        return self.record_size * self.num_experts * len(self.moe_layers)


def _tensor_memory(dtype: str, shape, act: mx.Dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    size = ITEMSIZE.get(dtype, 4)
    # Floats are cast up to float32 activations (CPU); nothing is cast down (GPU).
    return n * (max(size, act.size) if dtype in FLOATS else size)


def _tensor_disk(dtype: str, shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * ITEMSIZE.get(dtype, 4)


def _matrix_elements(name: str, dtype: str, shape, quant: Optional[dict]) -> int:
    if not name.endswith(".weight") or len(shape) < 2:
        return 0
    rows = 1
    for s in shape[:-1]:
        rows *= s
    cols = shape[-1] * 32 // quant["bits"] if quant and dtype == "uint32" else shape[-1]
    return rows * cols


def _generic(name: str, key: str) -> str:
    """A unit's tensor name with its layer index as `#` (the same tensor of every
    layer): the name's first path component that is the unit's index."""
    return name if key == "globals" else re.sub(rf"(?<![^.]){key}\.", "#.", name, count=1)


def _build(units_tensors: Dict[str, List[tuple]], act: mx.Dtype) -> Dict[str, Unit]:
    units = {}
    for key, tensors in units_tensors.items():
        mem = sum(_tensor_memory(d, s, act) for _, d, s, _ in tensors)
        disk = sum(_tensor_disk(d, s) for _, d, s, _ in tensors)
        weights = sum(_matrix_elements(n, d, s, q) for n, d, s, q in tensors
                      if "embed_tokens" not in n)
        sig = tuple(sorted((_generic(n, key), d, tuple(s)) for n, d, s, _ in tensors))
        units[key] = Unit(key, mem, disk, weights, sig)
    return units


def inventory_from_manifest(manifest, config: dict, act: mx.Dtype) -> Inventory:
    by_unit: Dict[str, List[tuple]] = {}
    file_unit = {f: k for k, f in manifest.trunk_files.items()}
    embed = 0
    for name, info in manifest.tensors.items():
        key = file_unit[info["file"]]
        by_unit.setdefault(key, []).append((name, info["dtype"], info["shape"],
                                            info.get("quantization")))
        if "embed_tokens" in name:
            embed += _tensor_memory(info["dtype"], info["shape"], act)
    # The expert as one process holds it (a sliced record's slices put together).
    sections = expert_layout(manifest).for_rank(0, 1).held_sections
    quant = manifest.quantization["experts"]
    shapes = {name: info["shape"] for name, info in manifest.tensors.items()}
    moe = MoeShape(manifest.experts["experts_per_token"], manifest.experts["num_experts"],
                   max(shared_width(shapes, manifest.switch_path(layer))
                       for layer in manifest.moe_layers))
    layers = {layer: [Section.from_dict(d) for d in manifest.layer_experts(layer)["sections"]]
              for layer in manifest.moe_layers} if manifest.mixed else {}
    return Inventory(model_type=manifest.model_type,
                     config=config,
                     units=_build(by_unit, act),
                     embed_bytes=embed,
                     embed_tied=embeddings_tied(config, manifest.tensors),
                     moe_layers=manifest.moe_layers,
                     moe=moe,
                     record_size=max([manifest.experts["record_size"]] + [
                         record_size_of(s) for s in layers.values()]),
                     sections=sections,
                     expert_weights=_expert_weights(sections, quant),
                     activation_dtype=act,
                     layer_sections=layers)


def embeddings_tied(config: dict, names) -> bool:
    """The embedding table is also the output head: config.json says so, or the
    model has no head of its own (lfm2_moe ties whatever its config says)."""
    return tied_embeddings(config) or not any(n.startswith("lm_head.") or ".lm_head." in n
                                              for n in names)


def _expert_weights(sections: List[Section], quant: dict) -> int:
    return sum(s.shape[0] * input_size(linear_quant(quant, s.name.rpartition(".")[0]), s.shape)
               for s in sections if s.name.endswith(".weight"))


def inventory_from_config(config: dict, act: mx.Dtype, bits: Optional[int] = 4,
                          group_size: int = 64, expert_bits: int = 4,
                          expert_group_size: int = 64) -> Inventory:
    """The inventory deltafin-convert would produce from a source with this config."""
    from mlx.utils import tree_flatten, tree_map_with_path

    check_quantization(bits, group_size, expert_bits, expert_group_size)
    model, paths, switches, moe = build_moe(config)
    dtype = source_dtype(config)
    layer_of = LayerIndex(paths)

    def skip(p):
        return any(p == s or p.startswith(s + ".") for s in switches.values())

    if dtype is not None:
        cast = getattr(model, "cast_predicate", lambda _: True)
        model.update(tree_map_with_path(
            lambda k, v: v.astype(dtype) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters()))
    source_units: Dict[str, int] = {}
    for name, a in tree_flatten(model.parameters()):
        if not skip(name):
            i = layer_of.index(name)
            key = "globals" if i is None else str(i)
            source_units[key] = source_units.get(key, 0) + a.nbytes
    trunk_quant = {"group_size": group_size, "bits": bits, "mode": "affine"} if bits else None
    quantized = quantize_like_mlx_lm(model, model, "", skip, trunk_quant)

    by_unit: Dict[str, List[tuple]] = {}
    embed = 0
    for name, a in tree_flatten(model.parameters()):
        if skip(name):
            continue
        i = layer_of.index(name)
        key = "globals" if i is None else str(i)
        d = name_of(a.dtype)
        by_unit.setdefault(key, []).append((name, d, tuple(a.shape),
                                            quantized.get(name.rsplit(".", 1)[0])))
        if "embed_tokens" in name:
            embed += _tensor_memory(d, a.shape, act)

    quant = expert_quantization(config, expert_bits, expert_group_size)
    first = next(iter(switches.values()))
    linears = switch_linears(get_module(model, first))
    if not quant.get("carried_over") and quant["mode"] != FLOAT_MODE:  # the model's recipe
        quant = one_quantization({n: expert_recipe(model, first, n, quant) for n in linears})
    shapes = {k: v[1:] for k, v in linears.items()}
    sections = expert_sections(shapes, quant, name_of(dtype or mx.bfloat16))
    block = mlx_lm_quantization(config)
    by_layer = saved_layer_quantization(block) if block is not None else {}
    layers = {layer: expert_sections(shapes, by_layer.get(layer, quant),
                                     name_of(dtype or mx.bfloat16))
              for layer in sorted(switches)} if len({str(q) for q in by_layer.values()}) > 1 else {}
    return Inventory(model_type=config.get("model_type", "?"),
                     config=config,
                     units=_build(by_unit, act),
                     embed_bytes=embed,
                     embed_tied=embeddings_tied(config, dict(tree_flatten(model.parameters()))),
                     moe_layers=sorted(switches),
                     moe=moe,
                     record_size=max(record_size_of(s) for s in [sections, *layers.values()]),
                     sections=sections,
                     expert_weights=_expert_weights(sections, quant),
                     activation_dtype=act,
                     source_unit_bytes=source_units,
                     layer_sections=layers)
