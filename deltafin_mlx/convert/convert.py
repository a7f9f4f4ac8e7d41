"""deltafin-convert: a Hugging Face MoE checkpoint -> a Deltafin model directory.

One decoder layer at a time: its trunk tensors go through mlx-lm's own sanitize,
cast and quantization (convert/trunk.py) into `trunk/layer-L.safetensors`; its routed
experts are written one record at a time into `experts/layer-L.bank`
(convert/experts.py). Every file is written under a temporary name and renamed when
complete; `deltafin.partial.json` records what is finished, so an interrupted run
resumes at the first unfinished layer; the manifest is written last.
"""

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx
from tqdm import tqdm

from deltafin_mlx._version import __version__ as deltafin_version
from deltafin_mlx.errors import DeltafinError, ModelError
from deltafin_mlx.format.bank import BankWriter, bank_header_size, record_size_of, slice_sections
from deltafin_mlx.format.dtypes import name_of
from deltafin_mlx.format.hub import fetch_config, looks_like_hub_id
from deltafin_mlx.format.integrity import (MANIFEST_MAX_BYTES, file_checksum, format_checksum,
                                          write_json)
from deltafin_mlx.format.manifest import MANIFEST_NAME, PARTIAL_NAME, Manifest
from deltafin_mlx.format.model_dir import (PLACEHOLDER_WEIGHTS, SHIM_FILE, SHIM_SOURCE,
                                          open_model_dir, read_source_config)
from deltafin_mlx.format.record import FLOAT_MODE, linear_quant, record_linears
from deltafin_mlx.model.build import build_moe, source_dtype
from deltafin_mlx.model.config import check_config
from deltafin_mlx.model.modules import LayerIndex, MoeShape, get_module
from deltafin_mlx.model.quantization import (KEEP_FLOAT, check_quantization, expert_quantization,
                                             float_quantization, mlx_lm_quantization,
                                             module_quantization)
from deltafin_mlx.model.shard import check_glu_sections
from deltafin_mlx.units import human_bytes

from .experts import SanitizedExperts, linkable
from .linked import LinkWriter, linked_manifest_entry
from .scratch import SCRATCH_NAME, check_scratch_limit, disk_in_use, open_hub_scratch, plan_scratch
from .source import (ConvertError, Source, copy_tokenizer_file, free_bytes, open_source, read_source,
                     tokenizer_files, without_code)
from .trunk import convert_unit, release

SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.", "vision_model.", "multi_modal_projector.")


@dataclass
class ConvertOptions:
    bits: Optional[int] = 4  # trunk; None keeps the trunk unquantized
    group_size: int = 64
    expert_bits: Union[int, str] = 4  # for bf16/fp16 experts ("float": kept); K3's MXFP4 kept
    expert_group_size: int = 64
    ranks: int = 1  # rank slices per expert record (tensor parallel, see FORMAT.md)
    link_experts: bool = False  # record where experts lie in SRC instead of copying them
    force: bool = False
    progress: bool = True
    revision: Optional[str] = None  # of a hub id (the source fingerprint covers its content)
    scratch: bool = False  # a hub id converted shard by shard (convert/scratch.py)
    scratch_limit: Optional[int] = None  # bytes of shards on disk at once; None: what is free

    def check(self):
        check_quantization(self.bits, self.group_size, self.expert_bits, self.expert_group_size)
        if not 1 <= self.ranks <= 1024:
            raise ConvertError(f"--ranks must be between 1 and 1024 (got {self.ranks})")
        if self.scratch and self.link_experts:
            raise ConvertError("--link-experts with a hub id keeps the whole snapshot in the hub "
                               "cache and links into it: it does not take --scratch-limit")
        if self.expert_bits == KEEP_FLOAT and self.ranks > 1:
            raise ConvertError("--ranks cuts quantized expert records into rank slices: it "
                               "does not take --expert-bits float")
        if self.link_experts and self.expert_bits == KEEP_FLOAT:
            raise ConvertError("--link-experts with --expert-bits float: only experts carried "
                               "over quantized (Kimi K3's, mlx-lm's) are linked; float experts "
                               "are copied: drop one of the two options")
        if self.link_experts and self.ranks > 1:
            raise ConvertError("--link-experts reads each expert whole from the source: it "
                               "does not take --ranks")

    def recorded(self) -> dict:
        # What changes the output (resume and rerun compare it), not how it is fetched.
        how = ("force", "progress", "revision", "scratch", "scratch_limit")
        return {k: v for k, v in asdict(self).items() if k not in how}


def _save_safetensors(path: Path, arrays: dict):
    tmp = path.with_name(path.name + ".tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays)
    except RuntimeError as e:  # MLX reports a failed write (e.g. a full disk) this way
        tmp.unlink(missing_ok=True)
        raise ConvertError(
            f"writing {path} failed ({e}); is the disk full? Free space and rerun to resume"
        ) from None
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _tensor_info(name, a, rel, quantized):
    module = name.rsplit(".", 1)[0]
    return {"file": rel,
            "dtype": name_of(a.dtype),
            "shape": list(a.shape),
            "quantization": quantized.get(module)}


def check_out_apart(src: Path, out: Path):
    """OUT must not be SRC, nor hold it: converting writes config.json and removes
    OUT's trunk/ and experts/ (with --force), which would destroy the source. No
    option overrides this. OUT inside SRC is allowed: nothing of SRC is touched."""
    s, o = os.path.realpath(src), os.path.realpath(out)
    if s == o:
        raise ConvertError(f"{out}: is the source directory; choose another output directory")
    if os.path.commonpath([s, o]) == o:
        raise ConvertError(f"{out}: holds the source directory {src}; choose an output "
                           "directory outside it")


def prepare_output(out: Path, source: Source, options: ConvertOptions) -> dict:
    """Check OUT (creating nothing), and return the state of the conversion to run:
    fresh, or the finished units of an interrupted run of the same conversion."""
    fresh = {"fingerprint": source.fingerprint, "options": options.recorded(), "done": {}}
    if not out.exists():
        return fresh
    if not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory")
    partial = out / PARTIAL_NAME
    manifest = out / MANIFEST_NAME
    state = None
    if partial.is_file() and partial.stat().st_size <= MANIFEST_MAX_BYTES:
        try:
            state = json.loads(partial.read_text())
            state["done"]
        except (OSError, ValueError, KeyError, TypeError):
            state = None
    same = (state is not None
            and state.get("fingerprint") == source.fingerprint
            and state.get("options") == options.recorded())
    if not (partial.is_file() or _deltafin_manifest(manifest) or _only_our_leftovers(out)):
        # No option overrides this: --force replaces a Deltafin output, never the
        # user's files (a directory that merely has trunk/ or config.json in it).
        raise ConvertError(f"{out}: exists, is not empty and holds no Deltafin model or "
                           "conversion; nothing was changed: choose a new or empty directory")
    if options.force:
        for name in ("trunk", "experts"):
            shutil.rmtree(out / name, ignore_errors=True)
        for name in (MANIFEST_NAME, PARTIAL_NAME, "config.json"):
            (out / name).unlink(missing_ok=True)
        return fresh
    if manifest.exists() and state is None and finished_conversion(out, source, options):
        return {**fresh, "finished": True}
    if manifest.exists() and not same:
        raise ConvertError(
            f"{out}: already holds a converted model of another source or with other options "
            "(use --force to overwrite)"
        )
    if same:
        return state  # (with a manifest: stopped just before its last step, rerun it)
    if state is not None:
        raise ConvertError(f"{out}: holds an unfinished conversion of another source or with other "
                           "options (use --force to start over)")
    return fresh


def _deltafin_manifest(path: Path) -> bool:
    """`path` is a manifest Deltafin wrote (of any version): a small JSON object
    whose "format" is "deltafin", read only within a size bound."""
    try:
        if not path.is_file() or path.stat().st_size > MANIFEST_MAX_BYTES:
            return False
        d = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(d, dict) and d.get("format") == "deltafin"


def finished_conversion(out: Path, source: Source, options: ConvertOptions) -> bool:
    """OUT holds a finished conversion of this very source with these options."""
    try:
        recorded = json.loads((out / MANIFEST_NAME).read_text()).get("source", {})
    except (OSError, ValueError, AttributeError):
        return False
    return (recorded.get("fingerprint") == source.fingerprint
            and recorded.get("options") == options.recorded())


def _only_our_leftovers(out: Path) -> bool:
    """Empty, or what a run stopped before its first state file can leave behind."""
    for p in out.iterdir():
        if p.name in ("trunk", "experts") and p.is_dir():
            if any(not q.name.endswith((".tmp", ".tmp.safetensors")) for q in p.iterdir()):
                return False
        elif not p.name.endswith(".tmp") and p.name != SCRATCH_NAME:
            return False
    return True


def tokenizer_kind(tok_files) -> str:
    return "kimi_tiktoken" if "tiktoken.model" in tok_files else "huggingface"


def check_source_tokenizer(path: Path, tok_files, config: dict):
    """Read the source's tokenizer as `deltafin-run` will (validated, every byte
    encodable, no id beyond the embedding table): a tokenizer the model could not
    run with is refused before hours of converting, not after. A source without
    tokenizer files converts (the model is usable without one, `tokenizer=False`)."""
    if not tok_files:
        return
    import tempfile

    from deltafin_mlx.tokenizer.read import read_tokenizer

    # Read from a copy: a hub cache's files are links into its blobs, which the
    # model directory's reader rightly refuses (tokenizer_files checked them).
    with tempfile.TemporaryDirectory(prefix="deltafin-tokenizer-") as copy:
        for name in tok_files:
            copy_tokenizer_file(path / name, Path(copy) / name)
        try:
            read_tokenizer(Path(copy), tokenizer_kind(tok_files), config)
        except ModelError as e:
            raise ConvertError(f"the source's tokenizer: {str(e).replace(copy, str(path))}"
                               ) from None


def convert(src: str, out, options: Optional[ConvertOptions] = None) -> Manifest:
    options = options or ConvertOptions()
    out = Path(out).expanduser()
    existed = out.exists(), (out / SCRATCH_NAME).exists()
    try:
        return _convert(src, out, options)
    except DeltafinError:
        # Refused before the conversion started: a scratch this run made goes, and
        # an OUT it made and left empty, so OUT is as it was.
        if options.scratch and not existed[1] and not (out / PARTIAL_NAME).exists():
            shutil.rmtree(out / SCRATCH_NAME, ignore_errors=True)
            if not existed[0] and out.is_dir() and not any(out.iterdir()):
                out.rmdir()
        raise


@dataclass
class Layout:
    """What a conversion writes, decided from the source before anything is written:
    mlx-lm's model built from config.json, the source tensors sorted into units (one
    per decoder layer, then "globals"), the routed-expert modules and their records."""

    source: Source
    config: dict
    model: object
    paths: list  # each decoder layer's module path in mlx-lm's model
    units: dict  # unit -> its source tensor names
    moe_layers: dict  # layer -> its SwitchGLU/SwitchMLP module path
    moe: MoeShape
    experts: SanitizedExperts
    sections: list
    record_size: int
    trunk_quant: Optional[dict]
    saved_quant: Optional[dict]  # the source's, where mlx_lm.convert quantized it
    dtype: object
    notes: list

    @property
    def num_layers(self) -> int:
        return len(self.paths)

    def sections_of(self, layer) -> list:
        """`layer`'s record sections (mlx-lm's mixed_* recipes: per layer; never sliced)."""
        return self.experts.own.get(layer, (None, self.sections))[1]

    def __post_init__(self):
        # Source bytes of each unit's trunk tensors (a unit's experts are apart).
        self.trunk_bytes = {
            u: sum(self.source.nbytes(n) for n in names if n not in self.experts.names(u))
            for u, names in self.units.items()}

    def source_bytes(self, unit) -> int:
        """Source bytes a unit reads: its trunk tensors and, for a layer, its experts."""
        if unit == "globals":
            return self.trunk_bytes[unit]
        return self.trunk_bytes[unit] + sum(self.source.nbytes(n) for n in self.experts.names(unit))


def _convert(src: str, out: Path, options: ConvertOptions) -> Manifest:
    options.check()
    source, hub = _open(src, out, options)
    layout = _layout(src, source, options)
    state = prepare_output(out, source, options)
    if state.get("finished"):
        if hub is not None:
            hub.remove()
        # Opened as every command opens it: an edited config.json is not "this conversion".
        return open_model_dir(out).manifest
    scratch_plan = _check_disk(out, layout, state, hub, options)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / PARTIAL_NAME, state)
    (out / "trunk").mkdir(exist_ok=True)
    (out / "experts").mkdir(exist_ok=True)
    if options.progress:
        for n in layout.notes + _resume_notes(out, layout, state):
            print(f"note: {n}", file=sys.stderr, flush=True)

    bar = ConvertProgress({u: layout.source_bytes(u) for u in layout.units}, state["done"],
                          options.progress)
    if hub is not None:
        bar.status = lambda: (f"download {human_bytes(hub.download_rate)}/s "
                              f"({human_bytes(hub.downloaded)} so far), disk in use "
                              f"{human_bytes(disk_in_use(out))}")
        hub.on_download = lambda n: bar.show_status(every=0.5)  # a shard takes minutes
    try:
        _convert_units(out, layout, state, bar, hub, scratch_plan)
    except BaseException:
        bar.close(failed=True)
        raise
    bar.close()
    manifest = _finish(out, layout, state, options)
    if hub is not None:
        hub.remove()
    return manifest


def _open(src: str, out: Path, options: ConvertOptions):
    """The source, checked, and the hub scratch it is read through (None but with
    --scratch-limit). From the hub, config.json comes alone first: what it settles is
    refused before any weight is downloaded."""
    if looks_like_hub_id(src) and not Path(src).expanduser().exists():
        path = fetch_config(src, options.revision).resolve()
        config = read_source_config(path)
        check_config(config, path, ConvertError)
        config_settled(src, config, options)
    if not options.scratch:
        source = open_source(src, options.revision, options.progress)
        check_out_apart(source.path, out)
        return source, None
    if Path(src).expanduser().exists() or not looks_like_hub_id(src):
        raise ConvertError(f"--scratch-limit: {src} is not a hub id (a local source is "
                           "read where it is, with no scratch)")
    if out.exists() and not out.is_dir():
        raise ConvertError(f"{out}: exists and is not a directory")
    hub = open_hub_scratch(src, options.revision, out, options.progress)
    return read_source(src, hub.dir, Path(os.path.realpath(hub.dir)), remote=hub), hub


def config_settled(src: str, config: dict, options: ConvertOptions):
    """Every refusal config.json and the options settle, each in one line: a model
    mlx-lm builds without routed experts (mlx-lm runs it), quantization options on a
    checkpoint mlx-lm quantized or experts carried over (kept as saved). Said for a
    hub id before anything but config.json is downloaded (`_open`). Returns
    `build_moe`'s four, the source's saved quantization block and the trunk's."""
    built = build_moe(config)
    saved_quant = mlx_lm_quantization(config)  # mlx_lm.convert's trunk is kept as saved
    if saved_quant is not None:
        if (options.bits, options.group_size) != (ConvertOptions.bits, ConvertOptions.group_size):
            raise ConvertError(
                f"--bits/--group-size/--no-trunk-quant: {src} was quantized by mlx-lm and its "
                "trunk is kept as it was saved: drop the option")
        trunk_quant = module_quantization(saved_quant, "")
    elif options.bits is not None:
        trunk_quant = {"group_size": options.group_size, "bits": options.bits, "mode": "affine"}
    else:
        trunk_quant = None
    check_expert_options(src, expert_quantization(config, options.expert_bits,
                                                  options.expert_group_size), options)
    return built, saved_quant, trunk_quant


def _layout(src: str, source: Source, options: ConvertOptions) -> Layout:
    """Everything about the output that the source and the options settle, each
    refusal said before any work."""
    config = dict(source.config)
    check_source_tokenizer(source.path, tokenizer_files(source.path, source.root), config)
    (model, paths, moe_layers, moe), saved_quant, trunk_quant = config_settled(src, config,
                                                                               options)
    dtype = source_dtype(config)
    units, notes = _sort_units(source, paths)
    float_quant = float_quantization(options.expert_bits, options.expert_group_size,
                                     name_of(dtype) if dtype is not None else None)
    experts = SanitizedExperts(source, model, units, moe_layers, moe.num_experts,
                               float_quant, saved_quant, dtype, config.get("model_type"))
    _check_experts(src, experts, moe_layers, options)
    sections = _sections(experts, options.ranks)
    return Layout(source, config, model, paths, units, moe_layers, moe, experts,
                  sections, record_size_of(sections) * options.ranks, trunk_quant,
                  saved_quant, dtype, notes)


def _sort_units(source: Source, paths: list):
    """The source tensors sorted into units, one per decoder layer, then "globals";
    and notes on what is left out."""
    num_layers = len(paths)
    layer_of = LayerIndex(paths)
    units = {i: [] for i in range(num_layers)}
    units["globals"] = []
    skipped, dropped = 0, 0
    for name in source.tensors:
        if name.startswith(SKIPPED_PREFIXES):
            skipped += 1
            continue
        i = layer_of.index(name)
        if i is None:
            units["globals"].append(name)
        elif i < num_layers:
            units[i].append(name)
        else:
            dropped += 1  # e.g. multi-token-prediction layers mlx-lm drops
    notes = []
    if skipped:
        notes.append(f"skipping {skipped} vision/projector tensors (text model only)")
    if dropped:
        notes.append(f"skipping {dropped} tensors of layers beyond num_hidden_layers")
    return units, notes


def check_expert_options(src: str, expert_quant: dict, options: ConvertOptions):
    """Expert options are for float experts: refused for experts carried over."""
    if expert_quant.get("carried_over") and (options.expert_bits, options.expert_group_size) \
            != (ConvertOptions.expert_bits, ConvertOptions.expert_group_size):
        raise ConvertError(
            f"--expert-bits/--expert-group-size: the experts of {src} are "
            f"{expert_quant['mode'].upper()} and are carried over as they are (only bf16/fp16/"
            "fp32 experts are quantized): drop the option")


def _check_experts(src: str, experts: SanitizedExperts, moe_layers: dict,
                   options: ConvertOptions):
    expert_quant = experts.quant
    check_expert_options(src, expert_quant, options)
    if options.link_experts and not linkable(expert_quant):
        raise ConvertError(
            f"--link-experts: the experts of {src} are {expert_quant['mode']} after "
            "quantizing them, not the source's bytes; only experts carried over byte for byte "
            "(Kimi K3's MXFP4 ones, or those mlx-lm quantized) can be linked (convert without "
            "--link-experts)")
    if options.link_experts:  # a section sanitize changes cannot be linked: said now
        experts.locations(next(iter(moe_layers)), 0)


def _sections(experts: SanitizedExperts, slices: int) -> list:
    """A record's sections, cut into `slices` rank slices where asked."""
    sections = experts.sections
    if slices == 1:
        return sections
    if experts.own:
        raise ConvertError(f"--ranks {slices}: the experts are quantized differently from "
                           "layer to layer (mlx-lm's mixed_* recipes); run them in one process "
                           "(convert without --ranks)")
    try:
        check_glu_sections(sections)
    except ModelError as e:
        raise ConvertError(f"--ranks {slices}: {e}") from None
    # Each rank's slice of the intermediate dimension is whole quantization
    # groups of down_proj's input (mlx-lm's sharded-to-all split).
    hidden = experts.linears["gate_proj"][0]
    group = linear_quant(experts.quant, "down_proj")["group_size"]
    if hidden % (slices * group):
        raise ConvertError(
            f"--ranks {slices}: the experts' intermediate size {hidden} does not split "
            f"into {slices} slices of whole quantization groups of {group}")
    return slice_sections(sections, slices)


def _check_disk(out: Path, layout: Layout, state: dict, hub, options: ConvertOptions):
    """Disk, checked before anything is written: banks are exact; the trunk needs at
    most its source size. With a hub scratch, the plan of which shards to hold when."""
    n = layout.moe.num_experts
    bank_bytes = {
        layer: (LinkWriter.size(n, layout.sections_of(layer)) if options.link_experts
                else bank_header_size(layer, n, layout.sections_of(layer), options.ranks)
                + n * (record_size_of(layout.sections_of(layer))
                       if layer in layout.experts.own else layout.record_size))
        for layer in layout.moe_layers
    }
    needed = sum(layout.trunk_bytes[u] + bank_bytes.get(u, 0)
                 for u in layout.units if str(u) not in state["done"])
    free = free_bytes(_existing_parent(out))
    if hub is None:
        if needed > free:
            raise ConvertError(
                f"not enough free disk space in {out}: the conversion needs up to {needed} "
                f"bytes ({needed / 1e9:.2f} GB), {free} bytes ({free / 1e9:.2f} GB) are free")
        return None
    source = layout.source
    order = [u for u in list(range(layout.num_layers)) + ["globals"] if str(u) not in state["done"]]
    needs = {u: {source.tensors[n].shard for n in layout.units[u]} for u in order}
    scratch_plan = plan_scratch(order, needs, hub.shard_sizes)
    held = sum(hub.shard_sizes[s] for s in hub.shards if hub.present(s))
    check_scratch_limit(scratch_plan, options.scratch_limit, free + held, needed, hub.small_bytes)
    for s in hub.shards:  # what a killed run left that no unit left to do reads
        if s not in scratch_plan.last_use:
            hub.release(s)
    return scratch_plan


def _resume_notes(out: Path, layout: Layout, state: dict) -> list:
    if not state["done"]:
        return []
    n = layout.num_layers
    done = sum(1 for k in state["done"] if k != "globals")
    todo = [i for i in range(n) if str(i) not in state["done"]]
    return [f"resuming {out}: {done} of {n} layers already converted, "
            + (f"picking up at layer {todo[0]} (layers are numbered 0-{n - 1})" if todo
               else "only the embeddings/head and the manifest are left")]


def _convert_units(out: Path, layout: Layout, state: dict, bar, hub=None, scratch_plan=None):
    partial_path = out / PARTIAL_NAME
    write_json(partial_path, state)
    source = layout.source
    for unit in list(range(layout.num_layers)) + ["globals"]:
        key = str(unit)
        fingerprint = _unit_fingerprint(layout, unit, state, bar, hub, partial_path)
        if key in state["done"]:
            stale = _stale_unit(out, state["done"][key], fingerprint)
            if stale is None:
                if unit != "globals":
                    release(get_module(layout.model, layout.paths[unit]))
                continue
            bar.redo(unit, f"note: redoing {'layer ' + key if unit != 'globals' else 'the globals'}: "
                     f"{stale}")
            del state["done"][key]
            write_json(partial_path, state)
        bar.start_unit(unit)
        result = _write_trunk(out, layout, unit)
        result["source_fingerprint"] = fingerprint
        bar.update(layout.trunk_bytes[unit])
        if unit in layout.moe_layers:
            result.update(_write_experts(out, layout, unit, state["options"], bar,
                                         result["files"], result["checksums"]))
        if unit != "globals":
            release(get_module(layout.model, layout.paths[unit]))
        state["done"][key] = result
        write_json(partial_path, state)
        if hub is not None:  # durably recorded: the shards no later unit reads can go
            at = scratch_plan.order.index(unit)
            for s in hub.shards:
                if scratch_plan.last_use.get(s, -1) <= at and hub.present(s):
                    source.forget(s)
                    hub.release(s)
        bar.end_unit(unit)


def _unit_fingerprint(layout: Layout, unit, state: dict, bar, hub, partial_path: Path):
    """The content fingerprint of a unit's source tensors, its hub shards fetched and
    their sha256 checked first where they are needed."""
    source = layout.source
    key = str(unit)
    needed = {source.tensors[n].shard for n in layout.units[unit]}
    if hub is not None and key in state["done"] and not all(map(hub.present, needed)):
        # Its shards were deleted once it was durably written: its files are
        # checked, its source is the pinned commit's (sha256-checked) bytes.
        return state["done"][key].get("source_fingerprint")
    if hub is not None:
        hub.ensure(needed)
        bar.show_status()
    verified = state.setdefault("verified_blobs", {})
    for shard in sorted(needed):
        if shard in source.blob_sha256 and verified.get(shard) != source.blob_sha256[shard]:
            source.check_blob(shard)  # hub downloads are not checked by the hub client
            verified[shard] = source.blob_sha256[shard]
            write_json(partial_path, state)
    return source.content_fingerprint(layout.units[unit])


def _write_trunk(out: Path, layout: Layout, unit) -> dict:
    """A unit's trunk tensors (all but its routed experts), sanitized, cast and
    quantized, in one safetensors file: its part of the conversion's record."""
    experts = layout.experts
    expert_names = experts.names(unit)
    raw = {n: layout.source.load(n) for n in layout.units[unit] if n not in expert_names}
    weights = experts.sanitize_trunk(raw, unit)
    if unit == "globals":
        prefix, module = "", layout.model
        layer_prefixes = tuple(p + "." for p in layout.paths)
        rel = "trunk/globals.safetensors"

        def skip(p):
            return p.startswith(layer_prefixes)

    else:
        prefix, module = layout.paths[unit], get_module(layout.model, layout.paths[unit])
        rel = f"trunk/layer-{unit:05d}.safetensors"
        switch = layout.moe_layers.get(unit)

        def skip(p):
            return switch is not None and (p == switch or p.startswith(switch + "."))

    params, quantized = convert_unit(layout.model, prefix, module, weights, skip,
                                     layout.trunk_quant, layout.dtype, layout.saved_quant)
    _save_safetensors(out / rel, params)
    return {"files": {rel: (out / rel).stat().st_size},
            "checksums": {rel: format_checksum(file_checksum(out / rel))},
            "tensors": {k: _tensor_info(k, v, rel, quantized) for k, v in params.items()},
            "quantized": quantized}


def _write_experts(out: Path, layout: Layout, unit, recorded: dict, bar, files: dict,
                   checksums: dict) -> dict:
    """A MoE layer's experts: a bank of records, or with --link-experts the table of
    where each lies in the source. Adds its file to `files`/`checksums`."""
    experts, n = layout.experts, layout.moe.num_experts
    if recorded.get("link_experts"):
        rel = f"experts/layer-{unit:05d}.links"
        writer = LinkWriter(layout.source, unit, n, layout.sections_of(unit))
        for e in range(n):
            writer.add(e, experts.record(unit, e), experts.locations(unit, e))
            bar.update(experts.expert_nbytes(unit, e))
        writer.write(out / rel)
        entry = {"bank": {"links": rel, "switch_path": layout.moe_layers[unit]},
                 "linked_files": writer.files}
    else:
        rel = f"experts/layer-{unit:05d}.bank"
        tmp = out / (rel + ".tmp")
        writer = BankWriter(tmp, unit, n, layout.sections_of(unit), recorded.get("ranks", 1))
        try:
            for e in range(n):
                writer.write_record(experts.record(unit, e))
                bar.update(experts.expert_nbytes(unit, e))
            writer.close()
        except BaseException:
            writer.abort()
            raise
        os.replace(tmp, out / rel)
        entry = {"bank": {"bank": rel, "switch_path": layout.moe_layers[unit],
                          "header_size": writer.header_size}}
    files[rel] = (out / rel).stat().st_size
    checksums[rel] = format_checksum(file_checksum(out / rel))
    return entry


class ConvertProgress:
    """The progress bar on stderr: source bytes converted (so MB/s is the real
    rate, not counting what a resumed run had already done) and layers per second;
    it ends at 100% because its total is the sum of exactly what is counted."""

    def __init__(self, unit_bytes: dict, done: dict, enabled: bool):
        self.unit_bytes = unit_bytes
        self.layers = sum(1 for u in unit_bytes if u != "globals")
        self.start = time.perf_counter()
        self.finished = 0
        self.status = None  # more to show after the rates (the scratch's download, disk)
        self._shown = 0.0
        self.bar = tqdm(total=sum(unit_bytes.values()),
                        initial=sum(b for u, b in unit_bytes.items() if str(u) in done),
                        unit="B", unit_scale=True, desc="converting", disable=not enabled,
                        dynamic_ncols=True, leave=True, file=sys.stderr)

    def update(self, nbytes: int):
        if self.bar.n + nbytes >= self.bar.total:  # complete: close() draws the last line
            self.bar.n += nbytes
        else:
            self.bar.update(nbytes)

    def redo(self, unit, note: str):
        """A unit counted as done at the start turned out stale: it is converted again."""
        self.bar.write(note, file=sys.stderr)
        self.bar.update(-self.unit_bytes[unit])

    def start_unit(self, unit):
        self.bar.set_description(f"layer {unit} (0-{self.layers - 1})" if unit != "globals"
                                 else "embeddings/head")

    def end_unit(self, unit):
        self.finished += unit != "globals"
        self.show_status()

    def show_status(self, every: float = 0.0):
        now = time.perf_counter()
        if every and now - self._shown < every:
            return
        self._shown = now
        rate = self.finished / max(now - self.start, 1e-9)
        extra = f", {self.status()}" if self.status else ""
        self.bar.set_postfix_str(f"{rate:.2f} layers/s{extra}", refresh=self.bar.n < self.bar.total)

    def close(self, failed: bool = False):
        if failed:
            self.bar.leave = False  # the error line follows, alone
        else:
            # No refresh here: close() draws the bar once more, its last line.
            self.bar.set_description("converted", refresh=False)
        self.bar.close()


def _stale_unit(out: Path, done: dict, fingerprint: str):
    """Why a unit recorded as finished cannot be trusted (None if it can): a file
    of it missing, resized or changed (checksum), or its source tensors' content
    changed since it was converted."""
    checksums = done.get("checksums")
    if not isinstance(checksums, dict) or done.get("source_fingerprint") is None:
        return "recorded without checksums"
    if done["source_fingerprint"] != fingerprint:
        return "its source tensors changed since it was converted"
    for rel, size in done.get("files", {}).items():
        p = out / rel
        if not p.is_file() or p.is_symlink() or p.stat().st_size != size:
            return f"{rel} is missing or has another size"
        if format_checksum(file_checksum(p)) != checksums.get(rel):
            return f"{rel} was modified (checksum differs)"
    return None


def _existing_parent(p: Path) -> Path:
    while not p.exists():
        p = p.parent
    return p


def _own_layout(layout: Layout, layer) -> dict:
    """A layer's manifest entry's own quantization, sections and record size, where
    mlx-lm's mixed_* recipes quantized its experts otherwise than the first layer's."""
    if layer not in layout.experts.own:
        return {}
    quant, sections = layout.experts.own[layer]
    return {"quantization": quant, "sections": [s.to_dict() for s in sections],
            "record_size": record_size_of(sections)}


def _finish(out: Path, layout: Layout, state: dict, options: ConvertOptions) -> Manifest:
    """config.json in mlx-lm's form, the drop-in, the tokenizer files and, last, the
    manifest: the conversion is finished when the manifest is written."""
    source, config, dtype = layout.source, layout.config, layout.dtype
    trunk_quant, expert_quant = layout.trunk_quant, layout.experts.quant
    num_layers, sections = layout.num_layers, layout.sections
    done = state["done"]
    files, tensors, quantized, checksums = {}, {}, {}, {}
    for unit in done.values():
        files.update(unit["files"])
        checksums.update(unit["checksums"])
        tensors.update(unit["tensors"])
        quantized.update(unit["quantized"])

    # config.json in mlx-lm's form: the default quantization plus one entry per
    # quantized module, as mlx_lm.convert writes a fine-grained model.
    # Float experts are listed as mlx-lm lists a module it left in float: false.
    float_kept = expert_quant["mode"] == FLOAT_MODE
    default = trunk_quant or (None if float_kept else
                              {k: expert_quant[k] for k in ("group_size", "bits", "mode")})
    quantization = dict(default or {})
    quantization.update(quantized)
    for layer, path in layout.moe_layers.items():
        for p in record_linears(s.name for s in sections):
            quantization[f"{path}.{p}"] = False if float_kept else linear_quant(
                layout.experts.layout_of(layer)[0], p)
    mlx_config = without_code(config)  # nothing a model carries runs (tokenizer files too)
    if default is None:  # nothing quantized: a float model, as mlx_lm.convert writes one
        mlx_config.pop("quantization", None)
        mlx_config.pop("quantization_config", None)
    else:
        mlx_config["quantization"] = quantization
        mlx_config["quantization_config"] = quantization
    # The mlx-lm drop-in (deltafin_mlx/dropin/shim.py): mlx-lm imports this file
    # with --trust-remote-code; Deltafin itself builds mlx-lm's class from model_type.
    mlx_config["model_file"] = SHIM_FILE
    write_json(out / "config.json", mlx_config)
    (out / SHIM_FILE).write_text(SHIM_SOURCE)
    mx.save_safetensors(str(out / PLACEHOLDER_WEIGHTS), {})
    for name in (SHIM_FILE, PLACEHOLDER_WEIGHTS):
        files[name] = (out / name).stat().st_size

    tok_files = tokenizer_files(source.path, source.root)
    for name in tok_files:
        copy_tokenizer_file(source.path / name, out / (name + ".tmp"))
        os.replace(out / (name + ".tmp"), out / name)
        files[name] = (out / name).stat().st_size
    files["config.json"] = (out / "config.json").stat().st_size
    for name in files:
        if name not in checksums:
            checksums[name] = format_checksum(file_checksum(out / name))
    kind = tokenizer_kind(tok_files)

    manifest = Manifest(
        path=out,
        model_type=config["model_type"],
        dtype=name_of(dtype) if dtype is not None else "float32",
        num_layers=num_layers,
        quantization={"trunk": trunk_quant, "experts": expert_quant},
        trunk_files={**{str(i): f"trunk/layer-{i:05d}.safetensors" for i in range(num_layers)},
                     "globals": "trunk/globals.safetensors"},
        tensors=tensors,
        experts={
            "num_experts": layout.moe.num_experts,
            "experts_per_token": layout.moe.experts_per_token,
            "record_size": layout.record_size,
            "sections": [s.to_dict() for s in sections],
            "layers": {str(u): {**done[str(u)]["bank"], **_own_layout(layout, u)}
                       for u in layout.moe_layers},
            **({"slices": options.ranks} if options.ranks > 1 else {}),
            **({"linked": linked_manifest_entry(source, done)} if options.link_experts else {}),
        },
        tokenizer={"kind": kind, "files": tok_files},
        files=files,
        source={"id": source.id,
                "fingerprint": source.fingerprint,
                "converted": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "deltafin_version": deltafin_version,
                "options": options.recorded(),
                "experts_from": layout.experts.source_dtype,  # what was quantized or kept
                "config_sha256": hashlib.sha256((out / "config.json").read_bytes()).hexdigest()},
        checksums=checksums,
    )
    manifest.write()
    (out / PARTIAL_NAME).unlink(missing_ok=True)
    return manifest
