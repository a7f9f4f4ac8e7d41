"""Attention is taken in chunks module by module: a layer holding several attention
modules (longcat_flash: a list of two, each with its own cache) has each chunked,
exactly as mlx-lm's chunked prefill computes, a sliding window's too (each chunk
attends the keys its cache kept); a module not called as mlx-lm's usual
`(x, mask, cache)` alone (deepseek_v41's keyword-only positions and its own layer
cache, the keys gemma4 and hunyuan share between layers) runs whole, as mlx-lm runs it."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import deepseek_v41
from mlx_lm.models.cache import make_prompt_cache

from deltafin_mlx.engine.chunked_attention import chunk_attention, chunk_bounds, chunkable
from deltafin_mlx.testing import zoo

STEP = 4


def test_only_modules_called_with_mask_and_cache_are_chunked():
    assert chunkable(zoo.build(zoo.config("qwen3_moe", 64)).layers[0].self_attn)
    attention = zoo.build(zoo.config("deepseek_v41", 64)).layers[0].self_attn
    assert isinstance(attention, deepseek_v41.Attention) and not chunkable(attention)
    assert not chunkable([attention])


@pytest.mark.parametrize("model_type", ["gemma4_text", "hunyuan"])
def test_attention_that_hands_its_keys_to_other_layers_runs_whole(model_type):
    """gemma4's and hunyuan's attention take and hand back the keys later layers
    share: those are the whole call's, so the call is never split."""
    layers = zoo.build(zoo.config(model_type, 64)).model.layers
    assert layers and not any(chunkable(layer.self_attn) for layer in layers)


def _build(model_type="longcat_flash"):
    cfg = zoo.config(model_type, 64)  # (its first call may draw: before the seed)
    mx.random.seed(0)  # mlx-lm's own initialisation draws too: two equal models
    model = zoo.build(cfg)
    model.set_dtype(mx.float32)
    return model


def _longcat():
    return _build("longcat_flash")


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


def test_a_sliding_windows_chunks_attend_the_keys_its_cache_kept():
    """afmoe (the zoo's window: 8 tokens) taken in chunks gives mlx-lm's chunked
    prefill exactly: a first call longer than the window, then a second one that
    starts with the window full (a chat's next turn)."""
    reference, chunked = _build("afmoe"), _build("afmoe")
    assert chunked.args.sliding_window == 8 > STEP
    for layer in chunked.model.layers:
        chunk_attention(layer.self_attn, STEP)
    x = mx.array(np.random.default_rng(0).integers(1, 60, (1, 32)).astype(np.int32))
    want_cache, got_cache = make_prompt_cache(reference), make_prompt_cache(chunked)
    assert any(hasattr(c, "max_size") for c in got_cache)  # a rotating cache
    for part in (x[:, :14], x[:, 14:]):
        for start, end in chunk_bounds(part.shape[1], STEP):  # mlx-lm's chunked prefill
            want = reference(part[:, start:end], cache=want_cache)
        got = chunked(part, cache=got_cache)  # one call, chunked inside
        assert mx.array_equal(got[:, -1], want[:, -1]).item()
