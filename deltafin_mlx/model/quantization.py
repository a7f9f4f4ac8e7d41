"""How the converter quantizes: the options it takes and what routed experts become.

Stated here, not in the converter, because the planner applies the same rules to a
source it has not downloaded.
"""

from deltafin_mlx.errors import ConvertError
from deltafin_mlx.format.dtypes import FLOATS
from deltafin_mlx.format.record import FLOAT_MODE, float_experts
from deltafin_mlx.model.config import text_config

BITS = (2, 3, 4, 6, 8)
GROUP_SIZES = (32, 64, 128)
# `--expert-bits float`: float experts kept in their float dtype, not quantized.
KEEP_FLOAT = "float"
EXPERT_BITS = BITS + (KEEP_FLOAT,)


def check_quantization(bits, group_size: int, expert_bits: int, expert_group_size: int):
    """The conversion options' quantization, or one line naming the bad option."""
    if bits is not None and bits not in BITS:
        raise ConvertError(f"--bits must be one of {BITS} (got {bits})")
    if group_size not in GROUP_SIZES:
        raise ConvertError(f"--group-size must be one of {GROUP_SIZES}")
    if expert_bits not in EXPERT_BITS:
        raise ConvertError(f"--expert-bits must be one of {', '.join(map(str, EXPERT_BITS))}")
    if expert_group_size not in GROUP_SIZES:
        raise ConvertError(f"--expert-group-size must be one of {GROUP_SIZES}")


# The quantization modes a record can hold as mlx-lm wrote them (docs/FORMAT.md).
# mode -> (bits, group sizes) MLX runs; nvfp4 without a global scale.
CARRIED_MODES = {"affine": (BITS + (5,), GROUP_SIZES), "mxfp4": ((4,), (32,)),
                 "nvfp4": ((4,), (16,)), "mxfp8": ((8,), (32,))}


def mlx_lm_quantization(config: dict):
    """The `quantization` block mlx_lm.convert writes into config.json (a default
    group_size/bits/mode plus per-module overrides keyed by module path), or None.
    mlx-lm copies it to `quantization_config`, where it differs from a Hugging Face
    block by having no `quant_method`."""
    for c in (config, text_config(config)):
        q = c.get("quantization")
        if q is None:
            q = c.get("quantization_config")
            if not isinstance(q, dict) or "quant_method" in q:
                continue
        if not (isinstance(q, dict) and isinstance(q.get("bits"), int)
                and isinstance(q.get("group_size"), int)):
            raise ConvertError(f"config.json: quantization {str(q)[:80]} is not mlx-lm's "
                               "(group_size and bits expected)")
        return q
    return None


# MLX's defaults for a mode (group size, bits): what a per-module entry's null means
# (mlx_lm.convert's mixed recipes without --q-group-size save "group_size": null).
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


def module_quantization(block: dict, path: str):
    """mlx-lm's rule for one module of a model it wrote: the per-module entry
    where the block has one (a null in it is MLX's default for the mode, as
    `to_quantized` takes it), else the block's default."""
    own = block.get(path)
    if isinstance(own, dict):
        mode = own.get("mode", "affine")
        group, bits = MODE_DEFAULTS.get(mode, (None, None))
        return {"group_size": own.get("group_size", block["group_size"]) or group,
                "bits": own.get("bits", block["bits"]) or bits, "mode": mode}
    return {"group_size": block["group_size"], "bits": block["bits"],
            "mode": block.get("mode", "affine")}


def carried_quantization(quant: dict, where: str) -> dict:
    """Experts mlx-lm already quantized as `quant`: carried over byte for byte."""
    mode, bits, group = quant["mode"], quant["bits"], quant["group_size"]
    ok_bits, ok_groups = CARRIED_MODES.get(mode, ((), ()))
    if bits not in ok_bits or group not in ok_groups:
        raise ConvertError(f"{where}: experts quantized {mode} at {bits} bits, group size "
                           f"{group}, are not supported (supported: affine 2-8 bits with "
                           f"group size {'/'.join(map(str, GROUP_SIZES))}, mxfp4, nvfp4, "
                           "mxfp8)")
    return {"mode": mode, "bits": bits, "group_size": group, "carried_over": True}


def float_quantization(expert_bits, expert_group_size: int, dtype: str) -> dict:
    """What float experts become with the options: quantized (affine), or kept in
    `dtype` (the dtype mlx_lm.convert casts them to) with `--expert-bits float`."""
    if expert_bits == KEEP_FLOAT:
        return float_experts(dtype)
    return {"mode": "affine", "bits": expert_bits, "group_size": expert_group_size}


def describe_experts(quant: dict, source_dtype: str) -> str:
    """What the conversion made of the routed experts (whose float dtype before it
    was `source_dtype`), for its last line."""
    if quant["mode"] == FLOAT_MODE:
        return f"experts: {quant['dtype']}, kept"
    bits = f"{quant['bits']}-bit affine" if quant["mode"] == "affine" else quant["mode"]
    return (f"experts: {bits} (group size {quant['group_size']}), " + (
        "carried over as saved" if quant.get("carried_over") else f"quantized from {source_dtype}"))


def expert_quantization(config: dict, expert_bits, expert_group_size: int) -> dict:
    """What a source's routed experts become: K3's MXFP4 experts, K2-Thinking's INT4,
    and experts mlx-lm quantized (its config.json block) are carried over as they are;
    bf16/fp16/fp32 experts are quantized (affine) with the options, or kept in float
    (`--expert-bits float`). From config.json alone (the planner; the converter's first
    answer): the converter then decides from what mlx-lm's sanitize makes of the source."""
    block = mlx_lm_quantization(config)
    if block is not None:
        layers = saved_layer_quantization(block)
        return next(iter(layers.values()), carried_quantization(
            module_quantization(block, ""), "config.json"))
    float_dtype = cast_dtype(config) or "bfloat16"  # as the planner assumes for scales
    qc = config.get("quantization_config") or text_config(config).get("quantization_config")
    if qc:
        fmt, method = qc.get("format"), qc.get("quant_method")
        kind = fmt if method == "compressed-tensors" else method
        if kind in ("mxfp4", "mxfp4-pack-quantized", "pack-quantized"):  # as mlx_lm.utils reads
            # them (INT4 "pack-quantized": affine 4-bit after mlx-lm's sanitize): carried over
            return {"mode": "affine" if kind == "pack-quantized" else "mxfp4", "bits": 4,
                    "group_size": 32, "carried_over": True}
        if method == "fp8":  # mlx-lm's sanitize dequantizes them
            return float_quantization(expert_bits, expert_group_size, float_dtype)
        raise ConvertError(
            f"source quantization {method}/{fmt} is not supported (supported: bf16/fp16/"
            "fp32 weights, compressed-tensors mxfp4 or INT4 experts, fp8, mxfp4, or "
            "mlx-lm's own format as mlx_lm.convert writes it)"
        )
    return float_quantization(expert_bits, expert_group_size, float_dtype)


def one_quantization(quants: dict) -> dict:
    """One quantization for a record's linears (name -> quantization, in order): the
    first's, with `linears` for those quantized otherwise (granitemoe's down_proj)."""
    first = next(iter(quants.values()))
    own = {n: {k: q[k] for k in ("mode", "bits", "group_size")}
           for n, q in quants.items() if q != first}
    return {**first, **({"linears": own} if own else {})}


def saved_layer_quantization(block: dict) -> dict:
    """Each MoE layer's experts' quantization as mlx-lm's block says it (layer ->
    quantization, `linears` for a linear quantized otherwise than the first), for
    the layers with per-module entries (mlx-lm's mixed_* recipes: per layer)."""
    per_layer: dict = {}  # layer -> linear -> quantization
    for path in block:
        where, _, linear = path.rpartition(".")
        parts = where.split(".")
        layer = next((int(p) for p in parts if p.isascii() and p.isdecimal()), None)
        if (parts[-1] in ("switch_mlp", "switch_glu", "experts")  # mlx-lm's SwitchGLU names
                and layer is not None and isinstance(block[path], dict)):
            per_layer.setdefault(layer, {})[linear] = carried_quantization(
                module_quantization(block, path), "config.json")
    return {layer: one_quantization(per_layer[layer]) for layer in sorted(per_layer)}


def cast_dtype(config: dict):
    """The name of the dtype mlx_lm.convert casts floating weights to (None: they
    are left as they are)."""
    dtype = config.get("torch_dtype") or text_config(config).get("dtype")
    return dtype if dtype in FLOATS else None


def quantization_by_part(config: dict, manifest) -> dict:
    """What each part of a converted model is quantized as, from its config.json's
    quantization block (the default plus one entry per quantized module, as
    mlx_lm.convert and deltafin-convert write it): part -> sorted names ("affine
    4-bit/64", "mxfp4"). Parts: attention, router, experts (under the manifest's
    switch modules), embedding, head, other. gpt-oss's mlx-community form is attention
    affine 4-bit/64, router affine 8-bit/64, experts mxfp4: the block's default alone
    (mxfp4) says nothing of the first two. Experts kept in float are said by the
    manifest alone (config.json then lists them as not quantized)."""
    block = mlx_lm_quantization(config)
    expert_paths = [manifest.switch_path(layer) for layer in manifest.moe_layers]
    experts = manifest.quantization.get("experts")
    parts = {}
    for path, own in (block or {}).items():
        if isinstance(own, dict):
            q = module_quantization(block, path)
            name = (f"affine {q['bits']}-bit/{q['group_size']}" if q["mode"] == "affine"
                    else q["mode"])
            parts.setdefault(_part(path, expert_paths), set()).add(name)
    if (experts or {}).get("mode") == FLOAT_MODE:
        parts["experts"] = {f"{experts['dtype']}, kept unquantized"}
    order = ("attention", "router", "experts", "embedding", "head", "other")
    return {p: sorted(parts[p]) for p in order if p in parts}


def _part(path: str, expert_paths) -> str:
    last = path.rsplit(".", 1)[-1]
    if any(path.startswith(f"{e}.") for e in expert_paths):
        return "experts"
    if last in ("gate", "router"):
        return "router"
    if "attn" in path or "attention" in path:
        return "attention"
    if "embed" in last or "embed_tokens" in path:
        return "embedding"
    return "head" if last in ("lm_head", "output") else "other"


def quantization_summary(parts: dict) -> str:
    """quantization_by_part's `parts` in one line: what most parts are, then the
    parts that differ ("affine 4-bit/64 except router affine 8-bit/64, experts
    mxfp4"; "unquantized" for none)."""
    if not parts:
        return "unquantized"
    named = [" + ".join(names) for names in parts.values()]
    common = max(named, key=named.count)
    others = [f"{p} {n}" for p, n in zip(parts, named) if n != common]
    return common + (f" except {', '.join(others)}" if others else "")
