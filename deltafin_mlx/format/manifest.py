"""The manifest (`deltafin.json`): what a converted model directory holds.

See docs/FORMAT.md. Reading a manifest checks the format version and that every
file it lists exists with its recorded size, so damage is found at load time, not
in the middle of a generation.
"""

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict

from deltafin_mlx.format.bank import (ALIGN, FORMAT_VERSION, FORMAT_VERSIONS, SLICED_VERSION,
                                     MAX_EXPERTS, Section, record_size_of,
                                     sections_from_dicts)
from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.dtypes import FLOATS
from deltafin_mlx.format.integrity import (MANIFEST_MAX_BYTES, check_small_files, parse_checksum,
                                          read_inside, resolve_inside, write_json)
from deltafin_mlx.format.links import LINKED_VERSION
from deltafin_mlx.format.record import (FLOAT_MODE, PROJECTIONS, float_experts, linear_quant,
                                        record_linears)
from deltafin_mlx.units import is_int

# Every manifest version this Deltafin reads: 1, 2 (rank slices), 3 (linked experts).
MANIFEST_VERSIONS = FORMAT_VERSIONS + (LINKED_VERSION,)

MANIFEST_NAME = "deltafin.json"
PARTIAL_NAME = "deltafin.partial.json"
# The fields every manifest has, in the order the dataclass declares them.
REQUIRED = ("model_type", "dtype", "num_layers", "quantization", "trunk_files", "tensors",
            "experts", "tokenizer", "files")


@dataclass
class Manifest:
    path: Path  # the model directory
    model_type: str
    dtype: str
    num_layers: int
    quantization: dict
    trunk_files: Dict[str, str]
    tensors: Dict[str, dict]
    experts: dict
    tokenizer: dict
    files: Dict[str, int]
    source: dict = field(default_factory=dict)
    # relative path -> "crc32:xxxxxxxx"; empty for manifests written before it
    checksums: Dict[str, str] = field(default_factory=dict)
    # SHA-256 of deltafin.json as read (hex): what names this exact model without
    # reading the file again; empty for a manifest built in memory (the converter)
    digest: str = ""

    @property
    def moe_layers(self):
        return sorted(int(k) for k in self.experts["layers"])

    def layer_experts(self, layer: int) -> dict:
        """`experts` as `layer`'s records have them: a layer whose experts are
        quantized otherwise (mlx-lm's mixed_* recipes) has its own `sections` and
        `record_size` in its entry."""
        entry = self.experts["layers"][str(layer)]
        return {**self.experts, **{k: entry[k] for k in ("sections", "record_size")
                                   if k in entry}}

    def expert_quant(self, layer: int) -> dict:
        """How `layer`'s experts are quantized: its entry's own `quantization`,
        else `quantization.experts`."""
        return self.experts["layers"][str(layer)].get("quantization",
                                                      self.quantization["experts"])

    @property
    def mixed(self) -> bool:
        """Are the experts quantized differently from layer to layer?"""
        return any("quantization" in e for e in self.experts["layers"].values())

    def bank_path(self, layer: int) -> Path:
        return self.path / self.experts["layers"][str(layer)]["bank"]

    @property
    def linked(self):
        """`experts.linked` (format version 3: experts read where they lie in the
        source checkpoint, docs/FORMAT.md), or None for banks."""
        return self.experts.get("linked")

    def links_path(self, layer: int) -> Path:
        return self.path / self.experts["layers"][str(layer)]["links"]

    def switch_path(self, layer: int) -> str:
        return self.experts["layers"][str(layer)]["switch_path"]

    @property
    def slices(self) -> int:
        """Rank slices per expert record (deltafin-convert --ranks; 1: unsliced)."""
        return self.experts.get("slices", 1)

    def to_dict(self) -> dict:
        version = (LINKED_VERSION if self.linked else
                   SLICED_VERSION if self.slices > 1 else FORMAT_VERSION)
        return {"format": "deltafin", "format_version": version,
                **{k: getattr(self, k) for k in REQUIRED + ("source", "checksums")}}

    def write(self):
        write_json(self.path / MANIFEST_NAME, self.to_dict())


def is_hf_checkpoint(path: Path) -> bool:
    """A Hugging Face checkpoint's directory (config.json and safetensors shards)."""
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def read_manifest(path, check_files: bool = True) -> Manifest:
    """The manifest of the model directory `path`, its fields checked; with
    `check_files`, also every file it lists (inside the directory, a regular file
    of its recorded size, small ones with their recorded checksum)."""
    from deltafin_mlx.format.hub import looks_like_hub_id

    given = str(path)
    path = Path(path).expanduser()
    if not path.exists():
        if looks_like_hub_id(given):
            raise ModelError(
                f"{path}: no such model directory (to run the hub model {given}, convert it "
                f"first: deltafin-convert {given} ~/models/{given.split('/')[1]})"
            )
        raise ModelError(f"{path}: no such model directory")
    if not path.is_dir():
        raise ModelError(f"{path}: not a directory")
    mpath = path / MANIFEST_NAME
    if not os.path.lexists(mpath):
        if (path / PARTIAL_NAME).exists():
            raise ModelError(
                f"{path}: conversion not finished (rerun deltafin-convert to resume it)"
            )
        if is_hf_checkpoint(path):
            raise ModelError(
                f"{path}: a Hugging Face checkpoint, not yet converted; convert it first: "
                f"deltafin-convert {path} {path}-deltafin"
            )
        raise ModelError(f"{path}: not a Deltafin model (no {MANIFEST_NAME})")
    raw = read_inside(path, MANIFEST_NAME, MANIFEST_MAX_BYTES)
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise ModelError(f"{mpath}: unreadable manifest ({e})") from None
    if not isinstance(d, dict) or d.get("format") != "deltafin":
        raise ModelError(f"{mpath}: not a Deltafin manifest")
    version = d.get("format_version")
    if not is_int(version) or version not in MANIFEST_VERSIONS:  # true == 1 in Python
        raise ModelError(f"{mpath}: format version {version!r} is not supported "
                         f"(this Deltafin reads versions {MANIFEST_VERSIONS})")
    try:
        _check_fields(d)
        m = Manifest(path=path, **{k: d[k] for k in REQUIRED}, source=d.get("source", {}),
                     checksums=d["checksums"], digest=hashlib.sha256(raw).hexdigest())
    except _Leaves as e:
        raise ModelError(f"{mpath}: corrupt manifest ({e})") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModelError(f"{mpath}: corrupt manifest ({type(e).__name__}: {e})") from None
    if check_files:
        check_model_files(m)
        check_small_files(m)
    return m


class _Leaves(ValueError):
    """A path in the manifest that does not name a file inside the model."""


_NAME = r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+"
# mode -> (bits, group sizes) that MLX's quantized matmuls take
QUANT_MODES = {"affine": ((2, 3, 4, 5, 6, 8), (32, 64, 128)),
               "mxfp4": ((4,), (32,)),
               "mxfp8": ((8,), (32,)),
               "nvfp4": ((4,), (16,))}


def _need(ok: bool, what: str):
    if not ok:
        raise ValueError(what)


def _rel_path(rel, what: str, files: dict) -> str:
    """A relative path inside the model directory that `files` lists."""
    if (not isinstance(rel, str) or not rel or "\x00" in rel or os.path.isabs(rel)
            or ".." in Path(rel).parts or not Path(rel).parts):
        raise _Leaves(f"{what} {rel!r:.200} leaves the model directory or is not a file path")
    if files is not None and rel not in files:
        raise ValueError(f"{what} {rel!r:.200} is not in the manifest's file list")
    return rel


def _check_fields(d: dict):
    """Every field the runtime uses has the type, range and cross-references the
    format promises, so damage is refused here instead of failing somewhere later
    (or reading outside the model directory). Raises ValueError saying what."""
    for key in REQUIRED:
        _need(key in d, f"no {key!r}")
    files = d["files"]
    _need(isinstance(files, dict) and files, "files must be a non-empty object")
    for rel, size in files.items():
        _rel_path(rel, "file path", None)
        _need(is_int(size) and 0 <= size < 1 << 56, f"size of {rel!r} is {size!r:.40}")
    _need(isinstance(d["model_type"], str), "model_type must be a string")
    _need(d["dtype"] in FLOATS, f"dtype {d['dtype']!r:.40} is not one of {FLOATS}")
    num_layers = d["num_layers"]
    _need(is_int(num_layers) and 0 < num_layers <= 1 << 16, f"num_layers {num_layers!r:.40}")
    _need(isinstance(d.get("source", {}), dict), "source must be an object")
    # Every file's checksum is part of the format: without them nothing but sizes
    # would be checked, so a manifest that drops them is refused, not trusted.
    _need("checksums" in d, "no checksums (every listed file's CRC-32 is required)")
    checksums = d["checksums"]
    _need(isinstance(checksums, dict), "checksums must be an object")
    _need(set(checksums) == set(files), "checksums must name exactly the listed files")
    for rel, value in checksums.items():
        _need(parse_checksum(value) is not None,
              f"checksum of {rel!r:.200} is {value!r:.40}, not crc32:<8 hex digits>")

    trunk_files = d["trunk_files"]
    _need(isinstance(trunk_files, dict), "trunk_files must be an object")
    units = {"globals"} | {str(i) for i in range(num_layers)}
    _need(set(trunk_files) == units,
          f"trunk_files must name \"globals\" and layers 0..{num_layers - 1}, one file each")
    for key, rel in trunk_files.items():
        _rel_path(rel, f"trunk file {key!r}", files)
    _need(len(set(trunk_files.values())) == len(trunk_files), "trunk_files repeats a file")
    tensors = d["tensors"]
    _need(isinstance(tensors, dict), "tensors must be an object")
    trunk_set = set(trunk_files.values())
    for name, info in tensors.items():
        _need(isinstance(info, dict), f"tensor {name!r} is not an object")
        shape, dtype, rel = info.get("shape"), info.get("dtype"), info.get("file")
        _need(isinstance(dtype, str), f"tensor {name!r} has dtype {dtype!r:.40}")
        _need(isinstance(shape, list) and all(is_int(s) and s >= 0 for s in shape),
              f"tensor {name!r} has shape {shape!r:.80}")
        _need(rel in trunk_set, f"tensor {name!r} is in {rel!r:.200}, not a trunk file")
        q = info.get("quantization")
        _need(q is None or (isinstance(q, dict) and is_int(q.get("bits")) and 1 <= q["bits"] <= 8
                            and is_int(q.get("group_size")) and q["group_size"] > 0),
              f"tensor {name!r} has quantization {q!r:.80}")
        # Every element takes at least a byte: a tensor never outgrows its file.
        _need(math.prod(shape) <= files[rel],
              f"tensor {name!r} of shape {shape} does not fit in {rel}")

    quant = d["quantization"]
    _need(isinstance(quant, dict), "quantization must be an object")
    _need(quant.get("trunk") is None or isinstance(quant["trunk"], dict),
          "quantization.trunk must be an object or null")
    eq = quant.get("experts")
    _check_expert_quant(eq, "quantization.experts")

    ex = d["experts"]
    _need(isinstance(ex, dict), "experts must be an object")
    n, k, record_size = ex.get("num_experts"), ex.get("experts_per_token"), ex.get("record_size")
    _need(is_int(n) and 0 < n <= MAX_EXPERTS, f"experts.num_experts {n!r:.40}")
    _need(is_int(k) and 0 < k <= n, f"experts.experts_per_token {k!r:.40}")
    _need(is_int(record_size) and record_size > 0 and record_size % ALIGN == 0,
          f"experts.record_size {record_size!r:.40}")
    sections = sections_from_dicts(ex.get("sections"))
    slices = ex.get("slices", 1)
    _need(is_int(slices) and 1 <= slices <= 1024
          and (slices > 1) == (d.get("format_version") == SLICED_VERSION),
          f"experts.slices {slices!r:.40} (format version {d.get('format_version')})")
    _need(record_size == record_size_of(sections) * slices,
          "experts.record_size does not match the sections")
    _check_expert_sections({s.name: s for s in sections}, eq)
    linked = ex.get("linked")
    _need((linked is not None) == (d.get("format_version") == LINKED_VERSION),
          f"experts.linked is present exactly in format version {LINKED_VERSION}")
    if linked is not None:
        _check_linked(linked)

    layers = ex.get("layers")
    _need(isinstance(layers, dict) and layers, "experts.layers must be a non-empty object")
    prefixes = {name.rsplit(".", 1)[0] for name in tensors}
    for key, entry in layers.items():
        _need(re.fullmatch(r"0|[1-9][0-9]*", key) is not None and int(key) < num_layers,
              f"experts.layers key {key!r:.40}")
        _need(isinstance(entry, dict), f"experts.layers[{key}] is not an object")
        layer_size = record_size
        if "quantization" in entry:  # mlx-lm's mixed_* recipes: this layer's own layout
            _need(slices == 1, f"experts.layers[{key}]: per-layer quantization with slices")
            _check_expert_quant(entry["quantization"], f"experts.layers[{key}].quantization")
            own = sections_from_dicts(entry.get("sections"))
            layer_size = entry.get("record_size")
            _need(is_int(layer_size) and layer_size == record_size_of(own),
                  f"experts.layers[{key}].record_size does not match its sections")
            _check_expert_sections({s.name: s for s in own}, entry["quantization"])
        else:
            _need("sections" not in entry and "record_size" not in entry,
                  f"experts.layers[{key}]: sections without quantization")
        if linked is not None:
            _rel_path(entry.get("links"), f"link table of layer {key}", files)
        else:
            bank = _rel_path(entry.get("bank"), f"bank of layer {key}", files)
            header_size = entry.get("header_size")
            _need(is_int(header_size) and header_size > 0 and header_size % ALIGN == 0,
                  f"header_size {header_size!r:.40} of layer {key}")
            _need(files[bank] == header_size + n * layer_size,
                  f"{bank} is listed as {files[bank]} bytes, its layout needs "
                  f"{header_size + n * layer_size}")
        sp = entry.get("switch_path")
        _need(isinstance(sp, str)
              and re.fullmatch(rf"(?:(?:{_NAME})\.)+{key}\.(?:(?:{_NAME})\.)*(?:{_NAME})", sp)
              is not None,
              f"switch_path {sp!r:.200} of layer {key}")
        # The routed-expert module's parameters are the bank's records, never trunk
        # tensors (its parent may be a wrapper holding nothing else, or the MoE block
        # with its router).
        _need(not any(p == sp or p.startswith(sp + ".") for p in prefixes),
              f"switch_path {sp!r} of layer {key}: the trunk holds tensors under it")

    tok = d["tokenizer"]
    _need(isinstance(tok, dict) and isinstance(tok.get("kind"), str)
          and isinstance(tok.get("files", []), list), "tokenizer must be an object with a kind")
    for rel in tok.get("files", []):
        _rel_path(rel, "tokenizer file", files)


def _check_expert_quant(eq, where: str):
    _need(isinstance(eq, dict) and (
        eq == float_experts(eq.get("dtype")) and eq["dtype"] in FLOATS
        or isinstance(eq.get("mode"), str) and eq["mode"] != FLOAT_MODE
        and is_int(eq.get("bits")) and 1 <= eq["bits"] <= 8
        and is_int(eq.get("group_size")) and 1 <= eq["group_size"] <= 1 << 16),
          f"{where} {eq!r:.200}")


def _check_linked(linked):
    """`experts.linked`: an absolute source root and, per linked file (a path
    relative to it that stays inside it), its size, mtime and header hash."""
    _need(isinstance(linked, dict) and isinstance(linked.get("root"), str)
          and os.path.isabs(linked["root"]) and isinstance(linked.get("files"), dict)
          and linked["files"], "experts.linked must name an absolute root and its files")
    _need("\x00" not in linked["root"],  # no path holds one: os calls refuse it
          f"experts.linked root {linked['root']!r:.200} holds a NUL byte, so it names no folder")
    for rel, rec in linked["files"].items():
        if (not isinstance(rel, str) or not rel or "\x00" in rel or os.path.isabs(rel)
                or ".." in Path(rel).parts):
            raise _Leaves(f"linked file {rel!r:.200} leaves the source root")
        _need(isinstance(rec, dict) and is_int(rec.get("size")) and rec["size"] >= 0
              and is_int(rec.get("mtime_ns")) and isinstance(rec.get("header_sha256"), str),
              f"linked file {rel!r:.200}: size, mtime_ns and header_sha256 expected")


def _check_expert_sections(by_name: Dict[str, Section], quant: dict):
    """The sections are a routed-expert module's quantized linears at the experts'
    quantization (format/record.py): per linear a uint32 weight, its scales, biases
    exactly when affine (or, kept in float, the float weight alone), and optionally
    a per-expert float bias of its outputs."""
    own = quant.get("linears", {})
    _need(isinstance(own, dict) and all(isinstance(v, dict) for v in own.values()),
          "quantization.experts.linears must map linear names to objects")
    linears = record_linears(by_name)
    _need(bool(linears), "no expert sections")
    dims = {}
    _need(set(own) <= set(linears), f"quantization.experts.linears names {sorted(own)}, "
          f"the sections hold {sorted(linears)}")
    for p, kinds_of in linears.items():
        have = {k: by_name[f"{p}.{k}"] for k in kinds_of}
        if quant["mode"] == FLOAT_MODE:
            w = have["weight"] if set(have) <= {"weight", "bias"} else None
            _need(re.fullmatch(_NAME, p) is not None and w is not None
                  and w.dtype == quant["dtype"] and len(w.shape) == 2,
                  f"expert sections of {p!r:.40} are {sorted(have)}, not a "
                  f"{quant['dtype']} weight (and optionally bias)")
            dims[p] = w.shape
            _check_bias(p, have, w.shape[0])
            continue
        q = linear_quant(quant, p)
        mode, bits, group = q["mode"], q["bits"], q["group_size"]
        _need(mode in QUANT_MODES and bits in QUANT_MODES[mode][0]
              and group in QUANT_MODES[mode][1],
              f"expert quantization {mode!r:.40} at {bits!r:.10} bits, group size {group!r:.10} "
              "is not one MLX has")
        affine = mode == "affine"
        kinds = ("weight", "scales", "biases") if affine else ("weight", "scales")
        _need(re.fullmatch(_NAME, p) is not None and set(kinds) <= set(have)
              and set(have) <= set(kinds) | {"bias"},
              f"expert sections of {p!r:.40} are {sorted(have)}, not {list(kinds)} "
              "(and optionally bias)")
        w, sc = have["weight"], have["scales"]
        _need(w.dtype == "uint32" and len(w.shape) == 2 and len(sc.shape) == 2
              and (sc.dtype != "uint8") == affine,
              f"expert section {p}.weight/scales dtypes or ranks")
        out, packed = w.shape
        _need(packed * 32 % bits == 0, f"{p}.weight: {packed} words at {bits} bits")
        in_dim = packed * 32 // bits
        _need(sc.shape == (out, in_dim // group) and in_dim % group == 0,
              f"{p}.scales shape {sc.shape} does not fit {p}.weight {w.shape} "
              f"at {bits} bits, group size {group}")
        if affine:
            _need(have["biases"].shape == sc.shape, f"{p}.biases shape")
        _check_bias(p, have, out)
        dims[p] = (out, in_dim)
    if set(dims) & set(PROJECTIONS):
        _need(set(dims) == set(PROJECTIONS) and dims["up_proj"] == dims["gate_proj"]
              and dims["down_proj"] == dims["gate_proj"][::-1],
              f"expert projections {dims} do not form a SwitchGLU")


def _check_bias(p: str, have: dict, out: int):
    if "bias" in have:
        _need(have["bias"].shape == (out,) and have["bias"].dtype in FLOATS,
              f"{p}.bias is {have['bias'].dtype} {have['bias'].shape}, not a float "
              f"vector of {out}")


def check_model_files(m: Manifest):
    """Every listed file resolves inside the model directory (after symlinks), is
    a regular file, and has its recorded size."""

    for rel, size in m.files.items():
        p = m.path / rel
        if not os.path.lexists(p):
            raise ModelError(f"{p}: missing (the manifest lists it)")
        _, st = resolve_inside(m.path, rel)
        actual = st.st_size
        if actual != size:
            raise ModelError(
                f"{p}: {actual} bytes, the manifest says {size} (truncated or modified file)"
            )
