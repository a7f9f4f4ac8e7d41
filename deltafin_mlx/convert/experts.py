"""Routed experts: from whatever layout a source has them in to one bank record per
expert, through mlx-lm's own model class and its own `sanitize`.

mlx-lm's `sanitize` is the one source of truth for a checkpoint's names and layouts:
it stacks one-tensor-per-expert releases, dequantizes FP8 block scales and INT4
compressed-tensors, splits gpt-oss's MXFP4 blocks and fused gate/up tensors, and
passes mlx-lm's own stacked format through. Every module of the built model that is
a SwitchGLU or SwitchMLP is a routed-expert module; its parameters, one row per
expert, are what a record holds (format/record.py).

A layer's experts are never held whole (a large release's outgrow memory). Per MoE
layer the source tensors are sorted first, by dry runs of `sanitize` on lazy
placeholders that are never evaluated: a tensor with an expert index in its name
(`experts.<e>.`) belongs to expert e; another whose first axis is the expert count
and which `sanitize` turns into the expert module's parameters (mlx-lm's
`switch_mlp.*`, gpt-oss's `gate_up_proj_blocks`, granitemoe's `input_linear`) is a
stacked expert tensor; the rest (the router among them) is trunk. Then the experts
are converted in groups of at most GROUP_BYTES of source: group [e0, e1) is expert
e0..e1-1's own tensors renamed 0..G-1 plus rows e0..e1-1 of each stacked tensor
(only those bytes are read), given to `sanitize` while the model's arguments say G
experts. Conversion memory is therefore about three groups (source, sanitized,
records) plus one layer's trunk, whatever a layer's experts weigh.

Experts the source already has quantized in a mode MLX runs (affine 2-8 bits,
mxfp4, nvfp4, mxfp8) are carried over byte for byte; float experts are quantized
with the options (`mx.quantize` groups run along the input axis, so one expert
alone quantizes to the same bytes as mlx-lm's stacked tensor), or kept in float
(`--expert-bits float`), cast as mlx_lm.convert casts them; per-expert float
biases stay float, cast likewise.
"""

import re
from contextlib import contextmanager
from dataclasses import dataclass, field, is_dataclass
from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

from deltafin_mlx.errors import ConvertError
from deltafin_mlx.format.dtypes import NUMPY, SAFETENSORS, name_of, to_numpy
from deltafin_mlx.format.record import (FLOAT_MODE, KINDS, expert_sections, float_experts,
                                       linear_quant, record_linears)
from deltafin_mlx.model.build import expert_recipe
from deltafin_mlx.model.modules import LayerIndex, get_module, layer_paths, switch_linears
from deltafin_mlx.model.quantization import (carried_quantization, module_quantization,
                                             one_quantization)
from deltafin_mlx.units import is_int

from .source import Source

# Source bytes of one group of experts converted together (see the docstring).
GROUP_BYTES = 1 << 28
# The arguments mlx-lm's model classes count routed experts and layers with.
EXPERT_COUNT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts",
                       "moe_num_experts", "n_experts", "num_routed_experts")
LAYER_COUNT_FIELDS = ("num_hidden_layers", "num_layers", "n_layers")
# MLX's microscaled modes by (bits, group size); their scales are uint8.
FP_MODES = {(4, 16): "nvfp4", (4, 32): "mxfp4", (8, 32): "mxfp8"}
EXPERT_INDEX = re.compile(r"\.(\d+)\.")


def _loaded_dtype(t) -> str:
    """The dtype MLX loads a source tensor as (FP8 as its bytes)."""
    dtype = SAFETENSORS.get(t.dtype, "uint8")
    return "uint8" if dtype == "float8_e4m3" else dtype


def _placeholder(t) -> mx.array:
    return mx.zeros(tuple(t.shape), dtype=getattr(mx, _loaded_dtype(t)))


def companions(name: str, names) -> List[str]:
    """The tensors a release stores beside `name` for it: an FP8 weight's
    `_scale_inv` and static `activation_scale`, INT4's `weight_scale`/`weight_shape`,
    a quantized module's `scales`/`biases`. They extend its module's prefix (`x.` for
    `x.weight`, `x.weight_packed`) or, for a tensor named as a module's parameter
    (`experts.down_proj`), its own name (`experts.down_proj_scale_inv`). Sanitize
    consumes them with it, so they are sorted with it: a weight without its scale,
    or a scale without its weight, is no layout sanitize takes."""
    leaf = name.rsplit(".", 1)[-1]
    base = name[:len(name) - len(leaf)] if leaf.startswith("weight") else name + "_"
    return [m for m in names if m != name and m.startswith(base)]


def _arg_holders(model) -> list:
    """Every arguments object the model's modules hold (and the nested per-part
    configs in them), where sanitize reads counts from."""
    seen, out = set(), []

    def add(obj):
        if obj is None or id(obj) in seen or not (is_dataclass(obj) or isinstance(obj, dict)
                                                    or hasattr(obj, "__dict__")):
            return
        if isinstance(obj, (int, float, str, bool, list, tuple)):
            return
        seen.add(id(obj))
        out.append(obj)
        values = obj.values() if isinstance(obj, dict) else vars(obj).values()
        for v in list(values):
            if is_dataclass(v) or isinstance(v, dict):
                add(v)

    for _, m in model.named_modules():
        add(m.__dict__.get("args"))
    return out


@contextmanager
def _counts(holders: list, experts: Tuple[int, int], layers: Optional[int]):
    """The arguments `holders` (`_arg_holders`) say `experts[1]` experts where they said `experts[0]`
    (and, with `layers`, that many layers) while sanitize runs; restored after."""
    def put(holder, name, value):
        if isinstance(holder, dict):
            holder[name] = value
        else:
            object.__setattr__(holder, name, value)

    changed = []
    for holder in holders:
        for name in EXPERT_COUNT_FIELDS + (LAYER_COUNT_FIELDS if layers else ()):
            get = holder.get if isinstance(holder, dict) else lambda n: getattr(holder, n, None)
            old = get(name)
            if not is_int(old):
                continue
            new = layers if name in LAYER_COUNT_FIELDS else (
                experts[1] if old == experts[0] else None)
            if new is None or new == old:
                continue
            changed.append((holder, name, old))
            put(holder, name, new)
    try:
        yield
    finally:
        for holder, name, old in reversed(changed):
            put(holder, name, old)


@dataclass
class LayerExperts:
    """Where one MoE layer's experts are in the source, and how sanitize takes them."""

    switch: str  # the routed-expert module's path in mlx-lm's model
    per_expert: Dict[int, List[str]]  # expert -> its own source tensors
    stacked: List[str]  # source tensors with one row per expert
    rename: Optional[Tuple[str, str]] = None  # ("layers.L.", "layers.0.") for sanitize
    links: Dict[str, str] = field(default_factory=dict)  # section -> source stem (linking)
    # Companions of stacked tensors without a row per expert (one FP8 scale for the
    # whole stack): every group gets them whole.
    whole: List[str] = field(default_factory=list)


class SanitizedExperts:
    """The routed experts of any source mlx-lm's model class loads, one record at a
    time (the converter asks for each layer's experts in order)."""

    def __init__(self, source: Source, model, units: Dict, switches: Dict[int, str],
                 num_experts: int, float_quant: dict, block: Optional[dict],
                 dtype: Optional[mx.Dtype], model_type: str):
        self.source, self.model, self.switches = source, model, switches
        self._holders = _arg_holders(model)
        self.paths = layer_paths(model)
        self.layer_of = LayerIndex(self.paths)
        # Some classes' sanitize reads global tensors whatever it is given
        # (qwen3_vl_moe's lm_head): every sanitize of a layer's tensors sees lazy
        # placeholders of the globals beside them, never evaluated.
        self.globals = {n: _placeholder(source.tensors[n]) for n in units["globals"]}
        self.units = units
        self._trunk = None  # every unit's trunk tensors as placeholders (sanitize_trunk)
        self.num_experts, self.dtype, self.model_type = num_experts, dtype, model_type
        self.linears = {}  # linear -> (out, in, has bias), from the built module
        for name, (e, o, i, b) in switch_linears(get_module(model, switches[
                next(iter(switches))])).items():
            self.linears[name] = (o, i, b)
        self.layers: Dict[int, LayerExperts] = {}
        specs, signatures = {}, {}
        for layer, sp in switches.items():
            names = units[layer]
            sig = tuple(sorted((self.layer_of.generic(n), source.tensors[n].dtype,
                                tuple(source.tensors[n].shape)) for n in names))
            if sig in signatures:  # same tensors as an earlier layer: same sorting
                earlier = signatures[sig]
                self.layers[layer], specs[layer] = self._like(earlier, specs[earlier], layer,
                                                              sp, names)
            else:
                self.layers[layer], specs[layer] = self._sort(layer, sp, names)
                signatures[sig] = layer
        self.quant, self.sections = self._layout(specs, float_quant, block)
        self._group = None  # (layer, e0, e1, sanitized rows by section)

    # -- sorting a layer's tensors, by dry runs ---------------------------------------

    def _sanitize(self, weights: Dict[str, mx.array], count: int,
                  rename: Optional[Tuple[str, str]]) -> Dict[str, mx.array]:
        """mlx-lm's sanitize of `weights` while the model says `count` experts (and,
        with `rename`, has them named as layer 0 of a one-layer model)."""
        if rename is not None:
            weights = {n.replace(rename[0], rename[1], 1): v for n, v in weights.items()}
        with _counts(self._holders, (self.num_experts, count), 1 if rename else None):
            out = self.model.sanitize({**self.globals, **weights})
        if rename is not None:
            out = {n.replace(rename[1], rename[0], 1): v for n, v in out.items()}
        return out

    def _dry(self, names, count: int, rename, rows: Optional[Dict[str, int]] = None):
        """Placeholders of `names` (never evaluated; `rows`: a first axis of that many
        for those named) and what sanitize makes of them."""
        weights = {}
        for n in names:
            t = self.source.tensors[n]
            a = _placeholder(t)
            if rows is not None and n in rows:
                a = mx.zeros((rows[n],) + tuple(t.shape[1:]), dtype=a.dtype)
            weights[n] = a
        return weights, self._sanitize(weights, count, rename)

    @staticmethod
    def _under(out: dict, sp: str) -> dict:
        return {n[len(sp) + 1:]: v for n, v in out.items() if n.startswith(sp + ".")}

    def _sort(self, layer: int, sp: str, names: List[str]):
        E, src = self.num_experts, self.source
        prefix_end = {n: self.layer_of.end(n) for n in names}
        stems: Dict[str, Dict[int, str]] = {}
        for n in names:
            m = EXPERT_INDEX.search(n, prefix_end[n] - 1)
            if m is not None:
                stem = n[:m.start()] + ".{}." + n[m.end():]
                stems.setdefault(stem, {})[int(m.group(1))] = n
        per_expert: Dict[int, List[str]] = {e: [] for e in range(E)}
        for stem, by_index in stems.items():
            if set(by_index) == set(range(E)):
                for e, n in by_index.items():
                    per_expert[e].append(n)
            elif len(by_index) > 1 and set(by_index) == set(range(len(by_index))) \
                    and ".experts." in stem:
                raise ConvertError(f"layer {layer}: source has {len(by_index)} routed "
                                   f"experts, config says {E}")
        own = {n for ns in per_expert.values() for n in ns}
        candidates = [n for n in names if n not in own and src.tensors[n].shape
                      and src.tensors[n].shape[0] == E]
        rename = None
        full = None
        failed = []  # why sanitize refused the layer's tensors, by variant
        for variant in (None, self.layer_of.rename(names, layer)):
            try:
                weights, out = self._dry(names, E, variant)
            except Exception as e:
                failed.append(e)
                continue
            got = self._under(out, sp)
            if got and all(v.shape and v.shape[0] == E for v in got.values()):
                rename, full = variant, (weights, out, got)
                break
        if full is None and failed:
            e = failed[0]
            raise ConvertError(f"layer {layer}: mlx-lm's {self.model_type} sanitize fails on the "
                               f"layer's tensors ({type(e).__name__}: {e}), so its experts "
                               "cannot be found") from None
        if full is None:
            self._no_experts(layer, sp, names, candidates)
        weights, out, got = full
        passed = {id(v) for n, v in out.items() if not n.startswith(sp + ".")}
        rest = [n for n in names if n not in own]
        experts = set()  # stacked expert tensors and their companions
        for n in candidates:
            if id(weights[n]) in passed:
                continue  # passed through to the trunk (a router's weight)
            family = {n, *companions(n, rest)}
            try:
                _, without = self._dry([m for m in names if m not in family], E, rename)
                changed = {k: (v.shape, v.dtype) for k, v in self._under(without, sp).items()} \
                    != {k: (v.shape, v.dtype) for k, v in got.items()}
            except Exception:
                changed = True
            if changed:
                experts |= family
        stacked = [n for n in rest if n in experts and src.tensors[n].shape
                   and src.tensors[n].shape[0] == E]
        whole = [n for n in rest if n in experts and n not in stacked]
        trunk = [n for n in rest if n not in experts]
        try:
            _, trunk_out = self._dry(trunk, E, rename)
        except Exception as e:
            raise ConvertError(f"layer {layer}: mlx-lm's {self.model_type} sanitize fails on "
                               f"the layer's tensors without its experts ({e})") from None
        leak = self._under(trunk_out, sp)
        if leak:
            self._no_experts(layer, sp, names, candidates)
        found = LayerExperts(sp, per_expert, stacked, rename, whole=whole)
        spec = {k: (name_of(v.dtype), tuple(v.shape[1:])) for k, v in got.items()}
        self._check_groups(layer, found, spec)
        return found, spec

    def _like(self, earlier: int, spec: dict, layer: int, sp: str, names: List[str]):
        """The sorting of a layer whose tensors match an earlier layer's."""
        old = self.layers[earlier]

        def moved(n):
            return self.layer_of.moved(n, layer)

        found = LayerExperts(sp, {e: [moved(n) for n in ns] for e, ns in old.per_expert.items()},
                             [moved(n) for n in old.stacked],
                             whole=[moved(n) for n in old.whole])
        if moved(old.switch) == sp and self.names_in(found) <= set(names):
            # Sanitize may take this layer's experts under their own names or only
            # as layer 0's (a class that looks for layer 0's names): a dry run says.
            for rename in (old.rename and self.layer_of.rename(names, layer),
                           None if old.rename else self.layer_of.rename(names, layer)):
                found.rename = rename
                try:
                    self._check_groups(layer, found, spec)
                    return found, spec
                except ConvertError:
                    pass
        return self._sort(layer, sp, names)

    @staticmethod
    def names_in(found: LayerExperts) -> set:
        return ({n for ns in found.per_expert.values() for n in ns} | set(found.stacked)
                | set(found.whole))

    def _no_experts(self, layer, sp, names, candidates):
        """One line for a layer whose source tensors give its expert module nothing."""
        order = [f"{sp}.{lin}.{k}" for lin in self.linears for k in KINDS]
        for n in sorted(names, key=lambda n: order.index(n) if n in order else len(order)):
            t = self.source.tensors[n]
            if n.startswith(sp + ".") and t.shape and t.shape[0] != self.num_experts:
                raise ConvertError(
                    f"{self.source.path / t.shard}: tensor {n} is {t.dtype} {list(t.shape)}, "
                    f"expected {t.dtype} {[self.num_experts, *t.shape[1:]]}")
        raise ConvertError(f"layer {layer}: mlx-lm's {self.model_type} sanitize gives {sp} "
                           f"(its {self.num_experts} routed experts) nothing from the source's "
                           "tensors: the source does not hold this model's experts")

    def group_size(self, layer: int) -> int:
        per = self.expert_nbytes(layer)
        return max(1, min(self.num_experts, GROUP_BYTES // max(per, 1)))

    def _check_groups(self, layer: int, found: LayerExperts, spec: dict):
        """Sanitize converts a group of experts alone as it converts them all (the
        same parameters, G rows each): else one line, never a whole layer in memory."""
        E = self.num_experts
        self.layers[layer] = found
        G = self.group_size(layer)
        for size in sorted({G, E % G} - {0}):
            names = ([n for e in range(size) for n in found.per_expert[e]] + found.stacked
                     + found.whole)
            try:
                _, out = self._dry(names, size, found.rename, rows={n: size for n in found.stacked})
                part = self._under(out, found.switch)
                ok = {k: (name_of(v.dtype), tuple(v.shape[1:])) for k, v in part.items()} == \
                    spec and all(v.shape[0] == size for v in part.values())
                why = "other parameters"
            except Exception as e:
                ok, why = False, f"{type(e).__name__}: {e}"
            if not ok:
                raise ConvertError(
                    f"layer {layer}: mlx-lm's {self.model_type} sanitize does not convert "
                    f"{size} of the {E} experts on their own ({why:.120}); Deltafin converts "
                    "experts in groups to bound memory and cannot convert this source")

    # -- the record layout --------------------------------------------------------------

    def _layout(self, specs: Dict[int, dict], float_quant: dict, block: Optional[dict]):
        """The experts' quantization (one per linear) and record sections of the first
        MoE layer, from what sanitize made of each layer's experts; a layer whose
        experts mlx-lm quantized otherwise (its mixed_* recipes) gets its own in
        `self.own` (layer -> (quantization, sections))."""
        per_layer: Dict[int, dict] = {}  # layer -> linear -> quantization (None: float)
        for layer, spec in specs.items():
            sp = self.switches[layer]
            for name, kinds in record_linears(spec).items():
                if name not in self.linears or "weight" not in kinds:
                    raise ConvertError(f"layer {layer}: mlx-lm's sanitize gives {sp}.{name}."
                                       f"{kinds[0]}, which its expert module does not hold")
                q = None
                if "scales" in kinds:
                    q = self._saved_quant(block, f"{sp}.{name}", spec, name)
                per_layer.setdefault(layer, {})[name] = q and tuple(sorted(q.items()))
        carried = {q is not None for found in per_layer.values() for q in found.values()}
        if len(carried) > 1:
            raise ConvertError("the source's experts are float in some layers and quantized "
                               "in others: convert the float release instead (--expert-bits)")
        first = specs[next(iter(specs))]
        biased = {n: (o, i, f"{n}.bias" in first) for n, (o, i, _) in self.linears.items()}
        # The float dtype sanitize gives the experts (what is quantized, or kept).
        self.source_dtype = (first[f"{next(iter(self.linears))}.weight"][0]
                             if carried == {False} else None)
        self.own = {}
        if carried == {False} and float_quant["mode"] == FLOAT_MODE:
            # Kept as mlx_lm.convert without -q keeps them: cast as it casts them.
            kept = name_of(self.dtype) if self.dtype is not None else self.source_dtype
            quant = float_experts(kept)
            return quant, expert_sections(biased, quant, kept, kept)
        if carried == {False}:
            sp = self.switches[next(iter(self.switches))]
            quant = one_quantization({n: expert_recipe(self.model, sp, n, float_quant)
                                      for n in self.linears})
            # Quantizing gives scales in the weights' dtype: the cast one, else the saved.
            cast = name_of(self.dtype) if self.dtype is not None else None
            scales = cast or first[f"{next(iter(self.linears))}.weight"][0]
            bias = cast or next((first[f"{n}.bias"][0] for n in biased if f"{n}.bias" in first),
                                scales)
            return quant, expert_sections(biased, quant, scales, bias)
        layouts = {}  # the linears' quantizations -> (quantization, sections)
        for layer, spec in specs.items():
            key = tuple(per_layer[layer].get(n) for n in self.linears)
            if key not in layouts:
                quant = one_quantization({n: carried_quantization(dict(q), "the source's experts")
                                          for n, q in zip(self.linears, key)})
                affine = [n for n in self.linears if linear_quant(quant, n)["mode"] == "affine"]
                scales = spec[f"{affine[0]}.scales"][0] if affine else "bfloat16"
                bias = next((spec[f"{n}.bias"][0] for n in biased if f"{n}.bias" in spec),
                            scales)
                layouts[key] = (quant, expert_sections(biased, quant, scales, bias))
            quant, sections = layouts[key]
            want = {s.name: (s.dtype, s.shape) for s in sections}
            if spec != want:
                bad = sorted(set(spec.items()) ^ set(want.items()))[0][0]
                raise ConvertError(f"layer {layer}: the experts' {bad} is "
                                   f"{spec.get(bad, 'missing')}, their record needs "
                                   f"{want.get(bad, 'none')}")
            if layouts[key] is not next(iter(layouts.values())):
                self.own[layer] = layouts[key]
        return next(iter(layouts.values()))

    def layout_of(self, layer: int) -> tuple:
        """(quantization, sections) of `layer`'s records (mixed_* recipes: per layer)."""
        return self.own.get(layer, (self.quant, self.sections))

    def _saved_quant(self, block, path, spec, name) -> dict:
        """How experts the source holds quantized were quantized: mlx-lm's
        quantization block entry where there is one, else from the shapes and the
        scales' dtype (mlx_lm.utils.infer_quant_config's rule)."""
        if block is not None and isinstance(block.get(path), dict):
            return module_quantization(block, path)
        in_dim = self.linears[name][1]
        packed, cols = spec[f"{name}.weight"][1][-1], spec[f"{name}.scales"][1][-1]
        bits, group = packed * 32 // in_dim, in_dim // max(cols, 1)
        if spec[f"{name}.scales"][0] != "uint8":
            return {"group_size": group, "bits": bits, "mode": "affine"}
        return {"group_size": group, "bits": bits, "mode": FP_MODES.get((bits, group), "unknown")}

    # -- what the converter asks ---------------------------------------------------------

    def sanitize_trunk(self, raw: Dict[str, mx.array], unit) -> Dict[str, mx.array]:
        """mlx-lm's sanitize of a unit's trunk tensors as it would be within the whole
        checkpoint. Classes decide from witnesses anywhere in it whether a checkpoint
        is a raw release that needs converting (qwen3_next shifts its norms by one
        only when it sees `mlp.experts.0.up_proj.weight`, qwen3_5 only when some
        linear-attention layer's conv1d is unconverted), so sanitize also sees lazy
        placeholders, never evaluated, of every other unit's trunk tensors (names and
        shapes only) and of this layer's and the first MoE layer's expert tensors (not
        every layer's: a large release has too many, docs/LEARNED.md). Only what
        sanitize puts in this unit and not in its expert module is kept. A class that
        cannot take them so (one that converts every layer's experts at once) gets
        the trunk placeholders alone, then the unit's tensors beside the globals'."""
        if self._trunk is None:
            self._trunk = {}
            for u, ns in self.units.items():
                experts = self.names(u)
                self._trunk.update((n, _placeholder(self.source.tensors[n]))
                                   for n in ns if n not in experts)
        first = next(iter(self.layers))
        experts = {n: _placeholder(self.source.tensors[n])
                   for n in self.names(unit) | self.names(first)}
        trunk = {n: v for n, v in self._trunk.items() if n not in raw}
        globals_ = {} if unit == "globals" else self.globals
        for i, holders in enumerate(({**trunk, **experts}, trunk, globals_)):
            try:
                out = self.model.sanitize({**holders, **raw})
                break
            except Exception as e:
                if i == 2:
                    where = "the globals" if unit == "globals" else f"layer {unit}"
                    raise ConvertError(f"{where}: mlx-lm's {self.model_type} sanitize fails on "
                                       f"its tensors ({type(e).__name__}: {e})") from None
        passed = {id(v) for v in holders.values()}
        switches = tuple(sp + "." for sp in self.switches.values())
        if unit == "globals":
            layers = tuple(p + "." for p in self.paths)

            def inside(n):
                return not n.startswith(layers)
        else:
            def inside(n):
                return n.startswith(self.paths[unit] + ".")
        return {n: v for n, v in out.items()
                if id(v) not in passed and not n.startswith(switches) and inside(n)}

    def names(self, layer) -> set:
        found = self.layers.get(layer)
        return set() if found is None else self.names_in(found)

    def expert_nbytes(self, layer: int, expert: int = 0) -> int:
        found = self.layers[layer]
        return (sum(self.source.nbytes(n) for n in found.per_expert[expert])
                + sum(self.source.nbytes(n) for n in found.stacked + found.whole)
                // self.num_experts)

    def _rows(self, name: str, e0: int, e1: int) -> mx.array:
        """Rows e0..e1-1 of a stacked source tensor: only their bytes are read."""
        t = self.source.tensors[name]
        row = t.nbytes // t.shape[0]
        buf = self._read(t.shard, t.offset + e0 * row, (e1 - e0) * row)
        dtype = _loaded_dtype(t)
        a = mx.array(buf.view(NUMPY[dtype]).reshape((e1 - e0,) + tuple(t.shape[1:])))
        return a.view(mx.bfloat16) if dtype == "bfloat16" else a

    def _read(self, shard: str, offset: int, size: int) -> np.ndarray:
        buf = np.empty(size, dtype=np.uint8)
        try:
            with open(self.source.path / shard, "rb") as f:
                f.seek(offset)
                got = f.readinto(memoryview(buf))
        except OSError as e:
            raise ConvertError(f"{self.source.path / shard}: cannot read ({e.strerror})") from None
        if got != size:
            raise ConvertError(f"{self.source.path / shard}: truncated (it shrank during "
                               "the conversion)")
        return buf

    def _convert_group(self, layer: int, e0: int, e1: int) -> Dict[str, mx.array]:
        found = self.layers[layer]
        weights = {}
        for e in range(e0, e1):
            for n in found.per_expert[e]:
                m = EXPERT_INDEX.search(n, self.layer_of.end(n) - 1)
                weights[f"{n[:m.start()]}.{e - e0}.{n[m.end():]}"] = self.source.load(n)
        for n in found.stacked:
            weights[n] = self._rows(n, e0, e1)
        for n in found.whole:
            weights[n] = self.source.load(n)
        rows = self._under(self._sanitize(weights, e1 - e0, found.rename), found.switch)
        mx.eval(rows)
        return rows

    def record(self, layer: int, expert: int) -> Dict[str, np.ndarray]:
        """One expert's record sections as numpy arrays (bf16 as its bits)."""
        g = self._group
        if g is None or g[0] != layer or not g[1] <= expert < g[2]:
            self._group = None  # its memory goes before the next group's comes
            G = self.group_size(layer)
            e0 = expert // G * G
            e1 = min(e0 + G, self.num_experts)
            self._group = g = (layer, e0, e1, self._convert_group(layer, e0, e1))
        rows, i = g[3], expert - g[1]
        out = {}
        if self.quant.get("carried_over"):
            for s in self.layout_of(layer)[1]:
                out[s.name] = to_numpy(rows[s.name][i])
            return out
        for name in self.linears:
            w = rows[f"{name}.weight"][i]
            if self.dtype is not None:
                w = w.astype(self.dtype)
            lq = linear_quant(self.quant, name)
            if lq["mode"] == FLOAT_MODE:
                out[f"{name}.weight"] = to_numpy(w)
            else:
                q = mx.quantize(w, lq["group_size"], lq["bits"], mode=lq["mode"])
                for kind, a in zip(("weight", "scales", "biases"), q):
                    out[f"{name}.{kind}"] = to_numpy(a)
            if f"{name}.bias" in rows:
                b = rows[f"{name}.bias"][i]
                out[f"{name}.bias"] = to_numpy(b.astype(self.dtype) if self.dtype else b)
        return out

    # -- linking -------------------------------------------------------------------------

    def _regions(self, layer: int, expert: int) -> Dict[str, Tuple[str, int, int]]:
        """Every source region holding one expert's tensor: its own tensors whole,
        and its row of each stacked tensor."""
        found = self.layers[layer]
        out = {}
        for n in found.per_expert[expert]:
            t = self.source.tensors[n]
            m = EXPERT_INDEX.search(n, self.layer_of.end(n) - 1)
            out[n[:m.start()] + ".{}." + n[m.end():]] = (t.shard, t.offset, t.nbytes)
        for n in found.stacked:
            t = self.source.tensors[n]
            row = t.nbytes // t.shape[0]
            out[n] = (t.shard, t.offset + expert * row, row)
        return out

    def locations(self, layer: int, expert: int) -> Dict[str, Tuple[str, int, int]]:
        """Record section -> (shard, offset, length) of the source bytes that are
        that section as they are (checked byte for byte); ConvertError where
        sanitize changes a section's bytes (it cannot be linked)."""
        found = self.layers[layer]
        record = self.record(layer, expert)
        regions = self._regions(layer, expert)
        out = {}
        for s in self.layout_of(layer)[1]:
            want = np.ascontiguousarray(record[s.name]).view(np.uint8).reshape(-1)
            stem = found.links.get(s.name)
            tries = [stem] if stem is not None else [k for k, r in regions.items()
                                                     if r[2] == want.nbytes]
            for k in tries:
                shard, off, size = regions[k]
                if size == want.nbytes and np.array_equal(self._read(shard, off, size), want):
                    found.links[s.name] = k
                    out[s.name] = regions[k]
                    break
            else:
                raise ConvertError(
                    f"--link-experts: layer {layer} expert {expert}: mlx-lm's sanitize "
                    f"changes the bytes of {s.name} (it is not a region of the source's "
                    "files): convert without --link-experts")
        return out


def linkable(quant: dict) -> bool:
    """Only experts carried over as the source has them can be linked (whether
    each section is the source's bytes is checked as they are linked)."""
    return bool(quant.get("carried_over"))
