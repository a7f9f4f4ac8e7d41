"""The one dtype table (format/dtypes.py): names, safetensors codes, numpy views and
MLX dtypes agree, and bf16 moves through numpy as its bits and back unchanged."""

import mlx.core as mx
import numpy as np
import pytest

from deltafin_mlx.format.dtypes import (FLOATS, ITEMSIZE, NUMPY, SAFETENSORS, SAFETENSORS_CODE,
                                        in_memory, mlx_dtype, name_of, to_mlx, to_numpy, widen)


def test_every_dtype_deltafin_holds_is_an_mlx_dtype_of_its_itemsize():
    for name, view in NUMPY.items():
        assert name_of(mlx_dtype(name)) == name and mlx_dtype(name).size == ITEMSIZE[name]
        assert np.dtype(view).itemsize == ITEMSIZE[name]
    assert all(SAFETENSORS[SAFETENSORS_CODE[n]] == n for n in SAFETENSORS.values())


@pytest.mark.parametrize("name", sorted(NUMPY))
def test_an_array_goes_to_numpy_and_back_unchanged(name):
    a = (mx.arange(-6, 6) * 3).astype(mlx_dtype(name)).reshape(3, 4)
    x = to_numpy(a)
    assert x.dtype == NUMPY[name] and x.shape == (3, 4)
    back = to_mlx(x.copy(), name)
    assert back.dtype == a.dtype and mx.array_equal(back, a).item()


def test_bf16_bits_widen_exactly_as_mlx_casts_them():
    a = mx.random.normal((257,)).astype(mx.bfloat16)
    bits = to_numpy(a)
    for dtype in (np.float32, np.float16):
        out = np.empty(bits.shape, dtype)
        widen(out, bits)
        want = np.array(a.astype(mx.float32 if dtype == np.float32 else mx.float16))
        assert np.array_equal(out, want), dtype


def test_floats_are_held_in_the_activation_dtype_the_rest_as_stored():
    for name in FLOATS:
        assert in_memory(name, mx.float32) == mx.float32
        assert in_memory(name, None) == mlx_dtype(name)
    assert in_memory("uint32", mx.float32) == mx.uint32
