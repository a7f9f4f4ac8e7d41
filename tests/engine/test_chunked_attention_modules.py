"""Attention is taken in chunks module by module: a layer holding several attention
modules (longcat_flash: a list of two, each with its own cache) has each chunked,
exactly as mlx-lm's chunked prefill computes; a module not called as mlx-lm's usual
`(x, mask, cache)` (deepseek_v41's keyword-only positions and its own layer cache)
runs whole, as mlx-lm runs it."""

import mlx.core as mx
import numpy as np
from mlx_lm.models import deepseek_v41
from mlx_lm.models.cache import make_prompt_cache

from deltafin_mlx.engine.chunked_attention import chunk_attention, chunkable
from deltafin_mlx.testing import zoo

STEP = 4


def test_only_modules_called_with_mask_and_cache_are_chunked():
    assert chunkable(zoo.build(zoo.config("qwen3_moe", 64)).layers[0].self_attn)
    attention = zoo.build(zoo.config("deepseek_v41", 64)).layers[0].self_attn
    assert isinstance(attention, deepseek_v41.Attention) and not chunkable(attention)
    assert not chunkable([attention])


def _longcat():
    mx.random.seed(0)  # mlx-lm's own initialisation draws too: two equal models
    model = zoo.build(zoo.config("longcat_flash", 64))
    model.set_dtype(mx.float32)
    return model


def test_each_of_a_layers_attention_modules_is_chunked_exactly():
    reference, chunked = _longcat(), _longcat()
    for layer in chunked.layers:
        assert isinstance(layer.self_attn, list) and len(layer.self_attn) == 2
        for module in layer.self_attn:
            assert chunkable(module)
            chunk_attention(module, STEP)
    x = mx.array(np.random.default_rng(0).integers(1, 60, (1, 3 * STEP + 2)).astype(np.int32))
    cache = make_prompt_cache(reference)
    for start in range(0, x.shape[1], STEP):  # mlx-lm's chunked prefill
        want = reference(x[:, start:start + STEP], cache=cache)
    got = chunked(x, cache=make_prompt_cache(chunked))  # one call, chunked inside
    assert mx.array_equal(got[:, -1], want[:, -1]).item()
