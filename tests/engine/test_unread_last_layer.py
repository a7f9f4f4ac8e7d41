"""A prefill chunk's logits are never read by mlx-lm's generate_step, and the last
decoder layer's MoE output reaches only the logits: so Deltafin neither reads nor
computes that layer's experts for such a chunk (ExpertStore.logits_unread, set by
generation/stream.unread_logits_hint), as mlx-lm's lazy prefill never computes it.

Both halves of that rule are checked against mlx-lm itself, for every MoE type
the installed mlx-lm runs: its own model, its own generate_step in chunks of 4
tokens, with the last layer's expert output replaced by NaN exactly when the hint
says the logits go unread, gives the same tokens and log-probabilities bit for bit
as the plain run (a NaN that reached a cache, or logits mlx-lm read, would not).
Then Deltafin's streaming model: tokens and log-probabilities equal mlx-lm's with
the hint, and the layer really is skipped (fewer experts read)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from deltafin_mlx import runtime
from deltafin_mlx.compat import prefill_chunk_follows
from deltafin_mlx.engine.load import load, load_resident
from deltafin_mlx.generation.stream import unread_logits_hint
from deltafin_mlx.model.modules import LayerIndex, layer_paths
from deltafin_mlx.testing import zoo

SKIPPED_TYPES = ("prism_hadamard_qwen35", "muse_spark")  # test_every_moe_type's CANNOT_PASS


def run(model, prompt, step, callback=None, steps=3):
    out = [(int(y), np.array(lp.astype(mx.float32)))
           for y, lp in generate_step(mx.array(prompt), model, max_tokens=steps,
                                      sampler=make_sampler(0.0),
                                      prompt_cache=make_prompt_cache(model),
                                      prefill_step_size=step,
                                      prompt_progress_callback=callback)]
    return [t for t, _ in out], [lp for _, lp in out]


def poison_the_last_layer(model, unread):
    """Replace the last decoder layer's expert outputs with NaN while `unread[0]`:
    how many calls were poisoned is counted in `unread[1]`."""
    paths = layer_paths(model)
    index = LayerIndex(paths)
    last = [n for n in zoo.switch_modules(model) if index.index(n + ".") == len(paths) - 1]
    for name in last:
        module = model
        for part in name.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        base = type(module)

        class Poisoned(base):
            def __call__(self, x, *args, **kwargs):
                y = base.__call__(self, x, *args, **kwargs)
                if not unread[0]:
                    return y
                unread[1] += 1
                return mx.full(y.shape, float("nan"), dtype=y.dtype)

        module.__class__ = Poisoned
    return bool(last)


@pytest.mark.parametrize("model_type", [t for t in zoo.moe_types() if t not in SKIPPED_TYPES])
def test_mlx_lm_never_reads_what_the_last_layer_gives_a_prefill_chunk(model_type):
    model = zoo.build(zoo.config(model_type, 300))
    model.set_dtype(mx.float32)
    prompt = np.random.default_rng(0).integers(1, 290, 14).tolist()
    want = run(model, prompt, 4)
    unread = [False, 0]

    def hint(processed, total):
        unread[0] = prefill_chunk_follows(processed, total)

    if not poison_the_last_layer(model, unread):
        pytest.skip("no expert module in the last decoder layer: nothing is skipped")
    got = run(model, prompt, 4, hint)
    assert unread[1] == 4  # chunks of 4, 4, 4 and 1 tokens; the 14th goes through the step
    assert got[0] == want[0]
    assert all(np.array_equal(a, b) for a, b in zip(got[1], want[1]))


def test_the_poison_shows_where_the_output_is_read():
    """The check above can fail: poisoned in the call whose logits are sampled too,
    the last layer's output reaches the log-probabilities."""
    model = zoo.build(zoo.config("qwen3_moe", 300))
    model.set_dtype(mx.float32)
    prompt = np.random.default_rng(0).integers(1, 290, 14).tolist()
    unread = [False, 0]
    poison_the_last_layer(model, unread)

    def too_late(processed, total):
        unread[0] = not prefill_chunk_follows(processed, total)

    assert np.isnan(run(model, prompt, 4, too_late)[1][0]).all()


def test_deltafin_skips_the_last_layer_of_a_prefill_chunk_and_matches_mlx_lm(converted):
    path = converted("kimi_k3")
    prompt = np.random.default_rng(1).integers(1, 200, 300).tolist()
    want = run(load_resident(path), prompt, 64, steps=4)
    model, _ = load(path, "200MB", tokenizer=False, cache_slots=16)
    try:
        store = runtime(model).store
        read = {}
        for hinted in (False, True):
            before = store.bytes_read
            got = run(model, prompt, 64, unread_logits_hint(model) if hinted else None, 4)
            read[hinted] = store.bytes_read - before
            assert got[0] == want[0], hinted
            assert all(np.array_equal(a, b) for a, b in zip(got[1], want[1])), hinted
            assert not store.logits_unread  # nothing is left set for later calls
        assert read[True] < read[False]
    finally:
        runtime(model).close()
