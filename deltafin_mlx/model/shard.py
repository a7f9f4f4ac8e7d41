"""Tensor parallelism over `mx.distributed`: each rank holds its slice of the trunk
and reads its slice of every routed expert.

The split is mlx-lm's own: the model class's `shard(group)` slices attention heads
and the dense/shared MLPs, and marks each MoE block with its `sharding_group` so
that the block sums the ranks' partial outputs with `all_sum`. Deltafin's part is
the routed experts: each rank's `StreamingSwitchGLU` reads only its rank's slice
of each record (the bank layout of `deltafin-convert --ranks N`, docs/FORMAT.md),
into slots of the slice's shapes, i.e. exactly the tensors mlx-lm's
`shard_inplace` leaves each rank with.

Under `mlx.launch` with more than one rank, `deltafin_mlx.load` shards by default
(`group="auto"`). At load the ranks exchange a fingerprint of the manifest, so
ranks pointed at different models stop with one line instead of computing garbage.
"""

import hashlib
import os
import sys
from dataclasses import replace
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.bank import BankLayout, Section, record_size_of, slice_sections
from deltafin_mlx.format.manifest import MANIFEST_NAME
from deltafin_mlx.format.record import PROJECTIONS
from deltafin_mlx.model.build import build_model, quantize_like_config
from deltafin_mlx.model.config import text_config
from deltafin_mlx.model.modules import get_module, layer_paths, set_module, switch_path


class FakeGroup:
    """Stands in for a `mx.distributed.Group` of `size` ranks where only shapes
    matter (planning: sharding a lazily built model never evaluates it)."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def detect_group(group="auto") -> Optional[mx.distributed.Group]:
    """The group to shard over: `group` itself, or for "auto" the launch's global
    group when `mlx.launch` started more than one rank; None: no sharding."""
    if group is None:
        return None
    if isinstance(group, str):
        if group != "auto":
            raise ValueError(f"group must be a mx.distributed.Group, None or 'auto' (got {group!r})")
        if not mx.distributed.is_available():
            return None
        group = mx.distributed.init()
    return group if group.size() > 1 else None


def quiet_other_ranks():
    """Under mlx.launch, only rank 0 prints results (every rank computes them)."""
    group = detect_group()
    if group is not None and group.rank() != 0:
        sys.stdout = open(os.devnull, "w")


def check_glu_sections(sections, where=""):
    """ModelError unless the records are SwitchGLU experts without per-expert
    biases: the layout whose rank slices are mlx-lm's shard of the experts."""
    glu = {f"{p}.{k}" for p in PROJECTIONS for k in ("weight", "scales", "biases")}
    other = sorted({s.name for s in sections} - glu)
    if other:
        raise ModelError(f"{where + ': ' if where else ''}tensor parallelism splits SwitchGLU "
                         "experts (gate/up/down projections without per-expert biases); this "
                         f"model's experts hold {other[0]}: run it in one process")


def check_divisible(config: dict, sections, ranks: int, where=""):
    """ModelError unless `ranks` divides what mlx-lm's shard() splits: attention
    heads, and the experts' intermediate dimension into whole quantization groups
    of down_proj's input (`sections`: one whole expert's)."""
    tc = text_config(config)
    heads = {"attention heads": tc.get("num_attention_heads"),
             "key/value heads": tc.get("num_key_value_heads")}
    linear = tc.get("linear_attn_config") or {}
    if isinstance(linear, dict):
        heads["linear attention heads"] = linear.get("num_heads")
    for what, n in heads.items():
        if isinstance(n, int) and n % ranks:
            raise ModelError(f"{where}: {ranks} ranks do not divide the model's {n} {what}")
    check_glu_sections(sections, where)
    by_name = {s.name: s for s in sections}
    width = by_name["gate_proj.weight"].shape[0]
    scales = by_name.get("down_proj.scales")  # none for float experts: any split is whole
    group = width // scales.shape[1] if scales is not None else 1
    if width % (ranks * group):
        raise ModelError(f"{where}: {ranks} ranks do not divide the experts' intermediate size "
                         f"{width} into whole quantization groups of {group}")


def expert_layout(manifest) -> BankLayout:
    """The record layout the manifest states (every bank has it; no file is read)."""
    sections = [Section.from_dict(d) for d in manifest.experts["sections"]]
    return BankLayout(0, manifest.experts["num_experts"], manifest.experts["record_size"],
                      0, sections, None, manifest.slices)


def rank_view(layout: BankLayout, rank: int, ranks: int, path="") -> BankLayout:
    try:
        return layout.for_rank(rank, ranks)
    except ValueError as e:
        raise ModelError(f"{path}: {e} (convert with deltafin-convert --ranks {ranks})") from None


def fingerprint(manifest) -> mx.array:
    """The manifest's SHA-256 as 8 int32 words (for exchanging between ranks)."""
    digest = hashlib.sha256((manifest.path / MANIFEST_NAME).read_bytes()).digest()
    return mx.array(list(digest), dtype=mx.uint8).view(mx.int32)


def check_same_model(manifest, group):
    """Every rank of `group` loaded the same manifest: ModelError otherwise (on
    every rank, so no rank is left waiting in a collective)."""
    mine = fingerprint(manifest)
    everyone = mx.distributed.all_gather(mine[None], group=group, stream=mx.cpu)
    mx.eval(everyone)
    differ = [r for r in range(group.size()) if not mx.array_equal(everyone[r], mine).item()]
    if differ:
        raise ModelError(f"{manifest.path}: ranks {differ} loaded a different model than rank "
                         f"{group.rank()} (every rank must run the same converted directory)")


class _NoExperts(nn.Module):
    """In place of a StreamingSwitchGLU while mlx-lm's shard() runs: it shards
    `switch_mlp.{gate,up,down}_proj` in place, which here hold no parameters
    (each rank's slot arrays already have its slice's shapes)."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Module(), nn.Module(), nn.Module()


def shard_model(model: nn.Module, group, switch_paths, path=""):
    """mlx-lm's model.shard(group) on a model whose routed experts stream."""
    if not hasattr(model, "shard"):
        raise ModelError(f"{path}: mlx-lm has no tensor-parallel shard() for "
                         f"{getattr(model, 'model_type', type(model).__module__)}")
    streaming = {sp: get_module(model, sp) for sp in switch_paths}
    for sp in streaming:
        set_module(model, sp, _NoExperts())
    try:
        model.shard(group)
    except ValueError as e:
        raise ModelError(f"{path}: cannot shard over {group.size()} ranks ({e})") from None
    finally:
        for sp, module in streaming.items():
            set_module(model, sp, module)


def sharded_inventory(inventory, config: dict, ranks: int, rank: int = 0, layout=None, where=""):
    """The inventory as one of `ranks` ranks sees it: each trunk unit's bytes as
    mlx-lm's shard() leaves them (measured on a lazily built, never evaluated
    model), and the expert record as that rank reads and holds it from `layout`
    (a manifest's `expert_layout`; None: as `deltafin-convert --ranks N` writes it)."""
    check_divisible(config, inventory.sections, ranks, where)
    if layout is None:
        sliced = slice_sections(inventory.sections, ranks)
        layout = BankLayout(0, inventory.num_experts, record_size_of(sliced) * ranks, 0,
                            sliced, None, ranks)
    view = rank_view(layout, rank, ranks, where)
    model = build_model(config, where)
    quantize_like_config(model, config)
    paths = layer_paths(model)
    switch = [f"{p}.{sp}" for p in paths if (sp := switch_path(get_module(model, p)))]

    def unit_bytes():
        sizes = {}
        for name, a in tree_flatten(model.parameters()):
            if any(name.startswith(sp + ".") for sp in switch):
                continue
            key = next((str(i) for i, p in enumerate(paths) if name.startswith(p + ".")), "globals")
            sizes[key] = sizes.get(key, 0) + a.nbytes
        return sizes

    before = unit_bytes()
    shard_model(model, FakeGroup(ranks, rank), switch, where)
    after = unit_bytes()
    units = {}
    for key, unit in inventory.units.items():
        ratio = after.get(key, 0) / before[key] if before.get(key) else 1.0
        units[key] = replace(unit, memory_bytes=round(unit.memory_bytes * ratio),
                             disk_bytes=round(unit.disk_bytes * ratio),
                             weights=round(unit.weights * ratio),
                             signature=unit.signature + (("ranks", ranks),))
    held = view.held_sections
    scale = held[0].shape[0] / inventory.sections[0].shape[0]
    return replace(inventory, units=units, record_size=view.record_size, sections=held,
                   expert_weights=round(inventory.expert_weights * scale),
                   notes=inventory.notes + [f"per rank of {ranks} (tensor parallel)"])
