"""Dtype names, and what each is on disk, in safetensors and in numpy: one table.

Names are MLX's (`mx.bfloat16` is "bfloat16"). numpy has no bfloat16, so bf16
bytes move through numpy as raw uint16 bit patterns.
"""

import numpy as np

# The float dtypes a model's weights and activations come in.
FLOATS = ("bfloat16", "float16", "float32")

# safetensors' dtype codes -> names
SAFETENSORS = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16",
    "U32": "uint32", "I32": "int32", "I64": "int64", "BOOL": "bool", "F8_E4M3": "float8_e4m3",
}

ITEMSIZE = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "uint8": 1, "int8": 1,
    "uint16": 2, "int16": 2, "uint32": 4, "int32": 4, "int64": 8, "bool": 1, "float8_e4m3": 1,
}

# How the bytes of each dtype that Deltafin reads itself are viewed in numpy.
NUMPY = {
    "bfloat16": np.uint16, "float16": np.float16, "float32": np.float32,
    "uint8": np.uint8, "uint32": np.uint32, "int32": np.int32,
}


def nbytes(dtype: str, shape) -> int:
    n = ITEMSIZE[dtype]
    for s in shape:
        n *= s
    return n
