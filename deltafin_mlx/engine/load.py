"""`deltafin_mlx.load`: build mlx-lm's own model for a converted directory, with the
trunk resident and every MoE layer's experts streamed through the cache."""

from dataclasses import dataclass, fields, replace
from difflib import get_close_matches
from functools import partial
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from deltafin_mlx.compat import embedding_path
from deltafin_mlx.engine.allocator import tune_malloc
from deltafin_mlx.engine.cache import CacheStats, ExpertCache, switch_over_slots
from deltafin_mlx.engine.chunked_attention import chunk_attention, chunkable
from deltafin_mlx.engine.hot_set import HotSet, hot_key
from deltafin_mlx.engine.linked_reader import LinkedSources
from deltafin_mlx.engine.reader import RECORD_CHECKS, Reader, open_bank
from deltafin_mlx.engine.runtime import Runtime, attach
from deltafin_mlx.engine.streaming_moe import (ExpertStore, StoreConfig, StreamingSwitchGLU,
                                               tap_moe_input)
from deltafin_mlx.engine.trunk_pass import PassTrunk
from deltafin_mlx.engine.trunk_stream import RowEmbedding, TrunkStreamer
from deltafin_mlx.engine.wired import wire
from deltafin_mlx.errors import LoadOptionError, TokenIdError
from deltafin_mlx.format.bank import BankError, read_layout
from deltafin_mlx.format.dtypes import ACTIVATION_DTYPES, compute_dtype
from deltafin_mlx.format.manifest import ModelError
from deltafin_mlx.format.model_dir import open_model_dir
from deltafin_mlx.model.build import build_model, quantize_like_config
from deltafin_mlx.model.modules import get_module, layer_paths, set_module
from deltafin_mlx.model.shard import (check_same_model, detect_group, expert_layout, rank_view,
                                      shard_model, sharded_inventory)
from deltafin_mlx.plan.footprint import inventory_from_manifest
from deltafin_mlx.plan.memory import MAX_SEQUENCES, plan_memory
from deltafin_mlx.units import is_int, parse_size

READ_MODES = ("direct", "mmap")


def check_against_manifest(model: nn.Module, manifest, switches: dict):
    """The model config.json builds is the one the manifest and banks describe:
    layer count, expert count and shapes (experts per token: `switch_shapes`), every trunk
    tensor (so vocabulary, tied embeddings, widths) by name and shape. A config
    edited and resealed is refused here instead of running different math."""
    where = manifest.path / "config.json"
    n = len(layer_paths(model))
    if n != manifest.num_layers:
        raise ModelError(f"{where}: builds {n} layers, the manifest has {manifest.num_layers}")
    ex = manifest.experts
    from deltafin_mlx.format.bank import slice_axis
    from deltafin_mlx.format.record import input_size, linear_quant
    from deltafin_mlx.model.modules import switch_classes

    inside = tuple(sp + "." for sp in switches)
    built = {p for p, m in model.named_modules()
             if isinstance(m, switch_classes()) and p not in switches and not p.startswith(inside)}
    if built:
        raise ModelError(f"{where}: builds routed experts at {sorted(built)[0]}, "
                         "which have no bank")
    layer_of = {manifest.switch_path(layer): layer for layer in manifest.moe_layers}
    for sp, linears in switches.items():
        layer = layer_of.get(sp, manifest.moe_layers[0])
        sections = {s["name"]: s for s in manifest.layer_experts(layer)["sections"]}
        held = {name.rpartition(".")[0] for name in sections}
        if set(linears) != held:
            raise ModelError(f"{where}: {sp} has expert linears {sorted(linears)}, the banks "
                             f"hold {sorted(held)}")
        for proj, (e, out, inp, bias) in linears.items():
            q = linear_quant(manifest.expert_quant(layer), proj)
            shape = list(sections[f"{proj}.weight"]["shape"])
            shape[slice_axis(f"{proj}.weight")] *= manifest.slices  # a whole expert
            out_b, in_b = shape[0], input_size(q, shape)
            if (e, out, inp) != (ex["num_experts"], out_b, in_b):
                raise ModelError(
                    f"{where}: {sp}.{proj} is {e} experts of {out}x{inp}, the banks hold "
                    f"{ex['num_experts']} of {out_b}x{in_b}")
            if bias != (f"{proj}.bias" in sections):
                raise ModelError(f"{where}: {sp}.{proj} {'has' if bias else 'has no'} "
                                 "per-expert bias, the banks differ")
    prefixes = tuple(sp + "." for sp in switches)
    params = {k: v.shape for k, v in tree_flatten(model.parameters()) if not k.startswith(prefixes)}
    for name, shape in params.items():
        info = manifest.tensors.get(name)
        if info is None:
            raise ModelError(f"{where}: the model has {name}, which the trunk lacks")
        if tuple(info["shape"]) != tuple(shape):
            raise ModelError(f"{where}: {name} is {tuple(shape)} in the model, "
                             f"{tuple(info['shape'])} in the trunk")
    extra = sorted(set(manifest.tensors) - set(params))
    if extra:
        raise ModelError(f"{where}: the trunk has {extra[0]}, which the model does not use "
                         "(tied embeddings or layers differ)")


def check_token_ids(x: mx.array, vocab: int):
    """Raise TokenIdError unless every id of `x` is in 0..vocab-1. One small
    evaluation per call: Deltafin's MoE layers evaluate the router anyway, so
    the ids are needed on the host soon after (docs/PERFORMANCE.md measures it)."""
    if not mx.issubdtype(x.dtype, mx.integer):
        raise TokenIdError(f"token ids must be integers, not {x.dtype}")
    if x.size == 0:
        return
    lo, hi = mx.min(x), mx.max(x)
    mx.eval(lo, hi)
    lo, hi = lo.item(), hi.item()
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise TokenIdError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")


def guard_token_ids(model: nn.Module):
    """Check ids where they enter the model, at its embedding table, before any
    gather could read outside it (an out-of-range id crashes MLX's gather or, for
    rows read from disk, would read another tensor's bytes)."""
    path = embedding_path(model)
    if path is None:
        return
    module = get_module(model, path)
    if isinstance(module, RowEmbedding):
        vocab = module.num_rows
    else:
        vocab = module.weight.shape[0]
    cls = type(module)

    def __call__(self, x):
        check_token_ids(x, vocab)
        return cls.__call__(self, x)

    # Swapping the class keeps the module's parameters and paths as they are.
    module.__class__ = type(cls.__name__, (cls,), {"__call__": __call__, "vocab_size": vocab})


def load_trunk(model: nn.Module, manifest, dtype: Optional[mx.Dtype], skip=lambda name: False,
               shard=None):
    """Load the trunk files into the model, all but the tensors `skip` accepts
    (streamed layers, an embedding read on demand), cast floats to `dtype`;
    `shard(model)`, if given, slices the loaded (still lazy) weights first, so
    that only the rank's slices are ever evaluated and held."""
    weights = []
    for rel in sorted(set(manifest.trunk_files.values())):
        try:
            weights.extend((k, v) for k, v in mx.load(str(manifest.path / rel)).items()
                           if not skip(k))
        except Exception as e:
            raise ModelError(f"{manifest.path / rel}: unreadable trunk file ({e})") from None
    expected = {k for k, _ in tree_flatten(model.parameters()) if not skip(k)}
    missing = expected - {k for k, _ in weights}
    if missing:
        raise ModelError(f"{manifest.path}: trunk lacks {sorted(missing)[0]}")
    try:
        model.load_weights(weights, strict=False)
    except ValueError as e:
        raise ModelError(f"{manifest.path}: trunk does not fit the model ({e})") from None
    if shard is not None:
        shard(model)
    params = [(k, v) for k, v in tree_flatten(model.parameters()) if not skip(k)]
    if dtype is not None:
        params = [(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v)
                  for k, v in params]
        model.update(tree_unflatten(params))
    mx.eval([v for _, v in params])


@dataclass(frozen=True)
class LoadOptions:
    """How `load` builds the runtime: every option in one place, each value checked
    once, here, when the options are made (LoadOptionError naming the option, or
    BudgetError for a budget that is not a size). The command line
    (cli/options.py), the server, the mlx-lm drop-in and the bench workers build one
    and pass it; `load(path, **kwargs)` builds one from its keyword arguments.

    memory_budget: bytes or a string like "8GB" for trunk + KV/state + expert cache
        + working buffers (kept as bytes); None: from available memory
        (cgroup-aware), with headroom.
    activation_dtype: "auto" (float32 on MLX's CPU backend), "model" (or None: each
        tensor in its saved dtype, mlx_lm.load's tokens), a float's name or an
        mx.Dtype (format/dtypes.py compute_dtype).
    reader_threads: background threads reading experts (0: read in the caller).
    lookahead: queue the next MoE layer's predicted experts as speculative reads.
    pipeline: compute resident experts while missing ones are read ("auto": on
        MLX's CPU backend, where it is bit-identical).
    verify: check every record's CRC-32 each time it is read, and every other
        file's checksum at load (without it, files up to 64 MB are checked at load).
    record_checks: without `verify`, when a record's CRC-32 is checked: "first"
        (its first read in this process), "every" read, or "off" (benchmarks).
    read_mode: "direct" (O_DIRECT / F_NOCACHE) or "mmap".
    context: tokens of KV cache and recurrent state to reserve in the budget
        (prompt + generated tokens); beyond the model's max_position_embeddings is
        refused (plan/memory.py check_context, the one context rule). Prompts
        longer than this are refused, never overrun silently.
    cache_slots: cap on the expert cache's slots, shared by all MoE layers
        (tests and benchmarks).
    stream_trunk: allow the plan to stream trunk layers and embedding rows when
        the budget is below the whole trunk.
    tokenizer: True to load the model's tokenizer, False for none, or a tokenizer
        already loaded (e.g. with `open_tokenizer`, to size `context` to a prompt).
    progress: show a progress bar while experts are loaded (when they all fit).
    sequences: sequences decoded together (batch jobs), each with its KV/recurrent
        state at `context` tokens in the budget; "auto" lets the planner choose,
        at most `max_sequences`.
    group: a mx.distributed.Group to shard the model over (tensor parallel, as
        mlx-lm's shard(); see model/shard.py), None for the whole model in this process,
        or "auto": the global group when mlx.launch started more than one rank.
        The budget is per rank.
    warm_start: save the expert cache's hot set when the runtime closes (in
        ~/.cache/deltafin/hot/, keyed by the model) and read it back in the
        background at the next load, behind every demand read (engine/hot_set.py).
        Nothing to do when every expert fits.
    """

    memory_budget: object = None
    activation_dtype: object = "auto"
    reader_threads: int = 1
    lookahead: bool = True
    pipeline: object = "auto"
    verify: bool = False
    record_checks: str = "first"
    read_mode: str = "direct"
    context: int = 4096
    cache_slots: Optional[int] = None
    stream_trunk: bool = True
    tokenizer: object = True
    progress: bool = False
    sequences: object = 1
    max_sequences: int = MAX_SEQUENCES
    group: object = "auto"
    warm_start: bool = True

    @classmethod
    def of(cls, options: Optional["LoadOptions"] = None, **changes) -> "LoadOptions":
        """`options` (default: the defaults) with `changes`; an unknown name is a
        TypeError naming it, as a function's unknown keyword argument is."""
        names = {f.name for f in fields(cls)}
        for name in changes:
            if name not in names:
                close = get_close_matches(name, names, 1)
                raise TypeError(f"load() has no option {name!r}"
                                + (f" (did you mean {close[0]!r}?)" if close else ""))
        return replace(options or cls(), **changes)

    def __post_init__(self):
        def need(ok: bool, name: str, what: str):
            if not ok:
                raise LoadOptionError(f"load option {name} must be {what}, "
                                      f"not {getattr(self, name)!r:.60}")

        if self.memory_budget is not None:
            object.__setattr__(self, "memory_budget", parse_size(self.memory_budget))
        for name in ("lookahead", "verify", "stream_trunk", "progress", "warm_start"):
            need(isinstance(getattr(self, name), bool), name, "True or False")
        dt = self.activation_dtype  # an mx.Dtype compared with None raises TypeError
        need(dt is None or isinstance(dt, mx.Dtype)
             or isinstance(dt, str) and dt in ACTIVATION_DTYPES,
             "activation_dtype", f"one of {', '.join(ACTIVATION_DTYPES)}, None or an mx.Dtype")
        need(is_int(self.reader_threads) and self.reader_threads >= 0, "reader_threads",
             "0 or more")
        need(isinstance(self.pipeline, bool) or self.pipeline == "auto", "pipeline",
             "True, False or 'auto'")
        need(self.record_checks in RECORD_CHECKS, "record_checks", f"one of {RECORD_CHECKS}")
        need(self.read_mode in READ_MODES, "read_mode", f"one of {READ_MODES}")
        need(self.cache_slots is None or (is_int(self.cache_slots) and self.cache_slots >= 1),
             "cache_slots", "None or 1 or more")
        need(is_int(self.sequences) and self.sequences >= 1 or self.sequences == "auto",
             "sequences", "1 or more, or 'auto'")
        need(is_int(self.max_sequences) and self.max_sequences >= 1, "max_sequences", "1 or more")
        need(self.group is None or isinstance(self.group, str) and self.group == "auto"
             or hasattr(self.group, "rank"), "group", "'auto', None or an mx.distributed.Group")


def load(path, memory_budget=None, *, options: Optional[LoadOptions] = None,
         **kwargs) -> Tuple[nn.Module, object]:
    """Load a Deltafin model directory (a path, or a ModelDir already opened with
    `open_model_dir`). Returns (model, tokenizer).

    The options are a LoadOptions (its docstring says what each does), or its
    fields as keyword arguments (`load(path, "8GB", context=8192)`), or both: the
    keyword arguments then change `options`.
    """
    if memory_budget is not None:
        kwargs["memory_budget"] = memory_budget
    o = LoadOptions.of(options, **kwargs)
    tune_malloc()  # before the reader threads: RSS stays with MLX's allocations
    reader_threads, verify, stream_trunk = o.reader_threads, o.verify, o.stream_trunk
    model_dir = open_model_dir(path)
    path, manifest, config = model_dir.path, model_dir.manifest, model_dir.config
    group = detect_group(o.group)
    ranks, rank = (group.size(), group.rank()) if group is not None else (1, 0)
    if group is not None:
        check_same_model(manifest, group)
    if group is not None and manifest.mixed:
        raise ModelError(f"{path}: experts quantized differently from layer to layer (mlx-lm's "
                         "mixed_* recipes) run in one process")
    if verify:
        # Every file but the banks (their records are checked as they are read).
        from deltafin_mlx.format.integrity import bank_files, check_all_files

        check_all_files(manifest, skip=bank_files(manifest))
    activation_dtype = compute_dtype(o.activation_dtype)  # None: each tensor as saved
    act = compute_dtype(o.activation_dtype, manifest.dtype)  # what the plan is made for
    inventory = inventory_from_manifest(manifest, config, act)
    if group is not None:
        # Streamed trunk layers would need sliced reads of their own: a rank
        # pins its (1/ranks) slice of the trunk.
        inventory = sharded_inventory(inventory, config, ranks, rank, expert_layout(manifest),
                                      manifest.path)
        stream_trunk = False
    plan = plan_memory(inventory, o.memory_budget, context=o.context,
                       reader_threads=reader_threads, max_slots=o.cache_slots,
                       stream_trunk=stream_trunk, sequences=o.sequences,
                       max_sequences=o.max_sequences)
    mx.set_cache_limit(plan.buffer_cache_bytes)

    # Banks (or linked sources) are checked before anything big is allocated.
    layouts = {}
    linked = None
    if manifest.linked is not None:
        if ranks > 1:
            raise ModelError(f"{path}: linked experts are read whole from the source: run "
                             "them in one process (convert without --link-experts for ranks)")
        linked = LinkedSources(manifest, o.read_mode)
    for layer in manifest.moe_layers if linked is None else ():
        entry, own = manifest.experts["layers"][str(layer)], manifest.layer_experts(layer)
        try:
            layouts[layer] = read_layout(manifest.bank_path(layer),
                                         expect={
                                             "layer": layer,
                                             "num_experts": manifest.experts["num_experts"],
                                             "record_size": own["record_size"],
                                             "header_size": entry["header_size"],
                                             "sections": own["sections"],
                                             "slices": manifest.slices,
                                         })
        except BankError as e:
            raise ModelError(str(e)) from None
        # What this rank reads of each record (all of it in one process).
        layouts[layer] = rank_view(layouts[layer], rank, ranks, manifest.bank_path(layer))
        if verify and layouts[layer].checksums is None:
            raise ModelError(f"{path}: --verify needs a rank count equal to the model's "
                             f"{manifest.slices} slices, 1, or a multiple of it")
    if linked is not None:
        banks = {layer: linked.bank(manifest, layer) for layer in manifest.moe_layers}
        read_size = max(manifest.layer_experts(layer)["record_size"]
                        for layer in manifest.moe_layers)
    else:
        read_size = max(layout.record_size for layout in layouts.values())

    model = build_model(config, path)
    switches = switch_shapes(model, manifest)
    stats = CacheStats()
    if linked is None:
        banks = {layer: open_bank(manifest.bank_path(layer), layouts[layer], o.read_mode)
                 for layer in manifest.moe_layers}
    reader = Reader(read_size, threads=reader_threads,
                    checks="every" if verify else o.record_checks,
                    staging_bytes=max(b.staging_bytes for b in banks.values()))
    cache = ExpertCache(banks, plan.slots, manifest.experts["num_experts"],
                        manifest.experts["experts_per_token"], act, reader, stats)
    pipeline = o.pipeline
    if pipeline == "auto":
        # Exact on MLX's CPU backend (a pair's result does not depend on the rest
        # of the call); on a GPU, kernels chosen by batch size could differ.
        pipeline = mx.default_device() == mx.cpu
    originals = {}  # layer -> mlx-lm's own expert module, whose class and settings run

    def make_inner(layer, arrays, slots):
        return switch_over_slots(arrays, slots, manifest.expert_quant(layer), originals[layer])

    streaming_switches, moe_blocks = {}, {}
    for layer in manifest.moe_layers:
        sp = manifest.switch_path(layer)
        originals[layer] = get_module(model, sp)
        streaming = StreamingSwitchGLU(layer, make_inner(layer, *cache.arrays_of(layer)))
        streaming_switches[layer] = streaming
        set_module(model, sp, streaming)
        moe = get_module(model, sp.rpartition(".")[0])
        moe_blocks[layer] = moe
        tap_moe_input(moe, streaming)

    # The quantized classes, minus the experts (their config entries now point at
    # streaming modules, which nn.quantize leaves alone).
    quantize_like_config(model, config)
    check_against_manifest(model, manifest, switches)
    paths = layer_paths(model)
    streamed = sorted(int(k) for k in plan.streamed)
    prefixes = tuple(paths[i] + "." for i in streamed)
    embed = embedding_path(model) if plan.embed_on_demand else None
    if embed is not None:
        prefixes += (embed + ".",)
        set_module(model, embed, RowEmbedding(get_module(model, embed),
                                              path / manifest.trunk_files["globals"], embed,
                                              activation_dtype))
    shard = None
    if group is not None:
        shard = partial(shard_model, group=group, switch_paths=list(switches), path=path)
    load_trunk(model, manifest, activation_dtype, skip=lambda k: k.startswith(prefixes),
               shard=shard)
    trunk = None
    if streamed:
        trunk = TrunkStreamer(model, manifest, dict(enumerate(paths)), streamed, activation_dtype)
    trunk_pass = None
    if plan.pass_trunk:
        trunk_pass = PassTrunk(model, manifest, dict(enumerate(paths)),
                               [int(k) for k in plan.pass_trunk], activation_dtype)
    store_config = StoreConfig(manifest.experts["experts_per_token"], o.lookahead, pipeline,
                               pass_piece_tokens=plan.prefill_step, pass_slots=plan.pass_slots,
                               release_above=plan.pass_kept_tokens, final_layer=len(paths) - 1)
    store = ExpertStore(cache, store_config, streaming_switches, moe_blocks, make_inner, trunk_pass)
    # A prefill pass goes through each layer whole; attention takes it in chunks.
    for p in paths:
        layer = get_module(model, p)
        attention = getattr(layer, "self_attn", None)
        # A layer may hold several attention modules (longcat_flash: a list of two,
        # each with its own cache): each takes its calls in chunks.
        for module in attention if isinstance(attention, (list, tuple)) else [attention]:
            if chunkable(module):
                chunk_attention(module, plan.prefill_step,
                                linear=bool(getattr(layer, "is_linear", False)))
    if plan.slots >= plan.num_experts * plan.moe_layers:
        cache.preload_all(_progress("loading experts") if o.progress else None)
    model.eval()
    guard_token_ids(model)
    hot = None
    key = hot_key(manifest, act, rank, ranks) if o.warm_start and not cache.all_resident else None
    if key is not None:
        hot = HotSet(cache, key)
        if reader_threads:  # without reader threads a read would hold up the load
            hot.preload()
    state = Runtime(model_dir, plan, store, trunk, group, hot, inventory=inventory,
                    reader_threads=reader_threads, activation_dtype=act)
    state.wired_previous = wire(plan.budget)
    attach(model, state)

    tok = o.tokenizer if not isinstance(o.tokenizer, bool) else None
    if o.tokenizer is True:
        tok = open_tokenizer(model_dir)
    return model, tok


def open_tokenizer(model):
    """A converted model's tokenizer alone (cheap: no weights are read), loaded
    once per opened directory (`model`: a path or a ModelDir)."""
    model_dir = open_model_dir(model)
    if model_dir.tokenizer is None:
        model_dir.tokenizer = load_tokenizer(model_dir.path, model_dir.manifest, model_dir.config)
    return model_dir.tokenizer


def switch_shapes(model: nn.Module, manifest) -> dict:
    """Each MoE layer's expert linears (`switch_linears`: experts, out, in, bias), as
    the model config.json builds has them (before any module is replaced); refused
    if the manifest names a layer without a routed-expert module, or the model routes
    another number of experts per token."""
    from deltafin_mlx.model.modules import moe_shape, switch_classes, switch_linears

    shapes = {}
    paths = layer_paths(model)
    for layer in manifest.moe_layers:
        sp = manifest.switch_path(layer)
        try:
            switch = get_module(model, sp)
        except (KeyError, IndexError, ValueError, AttributeError, TypeError):
            switch = None
        inside = layer < len(paths) and sp.startswith(paths[layer] + ".")
        if not inside or not isinstance(switch, switch_classes()):
            raise ModelError(f"{manifest.path / 'config.json'}: layer {layer} of the model it "
                             f"builds has no routed experts at {sp}, the manifest has a bank")
        shapes[sp] = switch_linears(switch)
    k = moe_shape(model, {layer: manifest.switch_path(layer) for layer in manifest.moe_layers},
                  manifest.model_type).experts_per_token
    if k != manifest.experts["experts_per_token"]:
        raise ModelError(f"{manifest.path / 'config.json'}: {k} experts per token, the "
                         f"manifest and banks have {manifest.experts['experts_per_token']}")
    return shapes


def _progress(desc):
    from tqdm import tqdm

    bar = {}

    def update(done, total):
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, desc=desc, unit="expert", leave=False)
        bar["bar"].update(done - bar["bar"].n)
        if done == total:
            bar["bar"].close()

    return update


def load_tokenizer(path: Path, manifest, config: dict):
    """The model's tokenizer. Every tokenizer file a loader may open by fixed name
    is checked first (inside the directory, a regular file, bounded), then the
    tokenizer is read as `read_tokenizer` reads it."""
    from deltafin_mlx.format.integrity import TOKENIZER_FILE_NAMES, TOKENIZER_MAX_BYTES, check_if_present

    for name in TOKENIZER_FILE_NAMES:
        check_if_present(manifest, name, TOKENIZER_MAX_BYTES)
    from deltafin_mlx.tokenizer.read import read_tokenizer

    return read_tokenizer(path, manifest.tokenizer.get("kind"), config)
