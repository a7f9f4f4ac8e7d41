"""Dtype names, and what each is on disk, in safetensors, in numpy and in MLX: one
table, and the one way each moves between them.

Names are MLX's (`mx.bfloat16` is "bfloat16"). numpy has no bfloat16, so bf16
bytes move through numpy as raw uint16 bit patterns: `to_numpy` views an MLX array
so, `to_mlx` views the bits back, `widen` turns them into float32 exactly.

MLX is imported by the functions that take or make its arrays, not by this module:
format/ reads and checks files without loading MLX.
"""

import numpy as np

# The float dtypes a model's weights and activations come in.
FLOATS = ("bfloat16", "float16", "float32")
# What a model may compute in (--activation-dtype, ...): compute_dtype says each.
ACTIVATION_DTYPES = ("auto", "model", "float32", "bfloat16", "float16")

# safetensors' dtype codes -> names
SAFETENSORS = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "I64": "int64", "BOOL": "bool", "F8_E4M3": "float8_e4m3",
}
# names -> safetensors' codes (what a writer puts in a header)
SAFETENSORS_CODE = {name: code for code, name in SAFETENSORS.items()}

ITEMSIZE = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "uint8": 1, "int8": 1,
    "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "int64": 8, "bool": 1, "float8_e4m3": 1,
}

# How the bytes of each dtype that Deltafin reads itself are viewed in numpy.
NUMPY = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32,
         "uint8": np.uint8, "uint32": np.uint32, "int32": np.int32}


def name_of(dtype) -> str:
    """The name of an MLX dtype: "bfloat16" for mx.bfloat16."""
    return str(dtype).split(".")[-1]


def mlx_dtype(name: str):
    """The MLX dtype of a name: mx.bfloat16 for "bfloat16"."""
    import mlx.core as mx

    return getattr(mx, name)


def compute_dtype(choice="auto", saved: str = None):
    """The dtype `choice` (a name of ACTIVATION_DTYPES, an mx.Dtype; None: "model")
    casts a model's floats to. "model" casts none: each tensor keeps its saved dtype,
    as mlx_lm.load runs it (so mlx-lm's tokens); then None, or `saved` (the model's
    dtype, to plan for) when given. "auto": float32 on MLX's CPU backend (far faster
    there than bfloat16), "model" elsewhere."""
    import mlx.core as mx

    if choice == "auto":
        choice = "float32" if mx.default_device() == mx.cpu else "model"
    if choice is None or choice == "model":
        return mlx_dtype(saved) if saved else None
    return mlx_dtype(choice) if isinstance(choice, str) else choice


def in_memory(disk_dtype: str, activation_dtype):
    """The dtype a tensor stored as `disk_dtype` is held in: floats (weights, scales,
    biases) in the activation dtype, so no kernel converts them per call; the rest,
    and everything when `activation_dtype` is None, as stored."""
    if activation_dtype is not None and disk_dtype in FLOATS:
        return activation_dtype
    return mlx_dtype(disk_dtype)


def to_numpy(a) -> np.ndarray:
    """A numpy view of an MLX array (its buffer: writable once evaluated), bf16 as
    its uint16 bits."""
    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


def to_mlx(x: np.ndarray, dtype: str):
    """An MLX array of `x`, which holds dtype `dtype` as NUMPY views it (bf16 bits
    become bfloat16 again)."""
    import mlx.core as mx

    a = mx.array(x)
    return a.view(mx.bfloat16) if dtype == "bfloat16" else a


def widen(dst: np.ndarray, src: np.ndarray):
    """Copy `src` into `dst` of another dtype. bf16 bits (uint16, as NUMPY views
    them) become float32 exactly: they are the top half of the f32's bits; into
    another float dtype, through that float32."""
    if src.dtype == np.uint16 and dst.dtype.kind == "f":
        bits = src.astype(np.uint32) << 16
        if dst.dtype == np.float32:
            dst.view(np.uint32)[...] = bits
        else:
            dst[...] = bits.view(np.float32).astype(dst.dtype)
    else:
        dst[...] = src.astype(dst.dtype)
