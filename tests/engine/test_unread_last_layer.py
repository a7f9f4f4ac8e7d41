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
from deltafin_mlx.engine.load import load
from deltafin_mlx.testing.decode import load_resident
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


def batch_run(model, prompts, step, steps=3):
    """mlx-lm's BatchGenerator over `prompts` together: each one's tokens and
    log-probabilities."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=steps, prefill_step_size=step,
                         prefill_batch_size=len(prompts), completion_batch_size=len(prompts))
    uids = gen.insert(prompts, [steps] * len(prompts))
    out = {u: ([], []) for u in uids}
    done = set()
    while len(done) < len(uids):
        _, responses = gen.next()
        for r in responses:
            out[r.uid][0].append(r.token)
            out[r.uid][1].append(np.array(r.logprobs.astype(mx.float32)))
            if r.finish_reason is not None:
                done.add(r.uid)
    gen.close()
    return [out[u] for u in uids]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral"])
def test_mlx_lms_batch_generator_never_reads_its_prompt_chunks_logits(model_type, monkeypatch):
    """The same rule for batch and serve: every call PromptProcessingBatch.prompt
    makes is a prompt chunk (prompts of different lengths, right-padded) whose
    last layer's output reaches nothing that is read."""
    from mlx_lm.generate import PromptProcessingBatch

    from deltafin_mlx.compat import unread_logits_in_prompt_batches

    own = PromptProcessingBatch.prompt  # mlx-lm's own, without Deltafin's hint if installed
    monkeypatch.setattr(PromptProcessingBatch, "prompt", getattr(own, "__wrapped__", own))
    model = zoo.build(zoo.config(model_type, 300))
    model.set_dtype(mx.float32)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 290, n).tolist() for n in (14, 9)]
    want = batch_run(model, prompts, 4)
    unread = [False, 0]
    assert poison_the_last_layer(model, unread)
    unread_logits_in_prompt_batches(lambda m, on: unread.__setitem__(0, on))
    got = batch_run(model, prompts, 4)
    assert unread[1] >= 3
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        assert all(np.array_equal(a, b) for a, b in zip(gl, wl))


def test_deltafin_batches_skip_the_last_layer_of_their_prompt_chunks(converted):
    from deltafin_mlx.generation.engine import generate
    from deltafin_mlx.jobs.batch import batch_generate

    path = converted("kimi_k3")
    model, tok = load(path, "200MB", cache_slots=16)
    try:
        store = runtime(model).store
        switch = store.switches[store.config.final_layer]
        calls = []
        unread = switch._unread
        switch._unread = lambda *a: calls.append(1) or unread(*a)
        texts = [tok.decode(np.random.default_rng(i).integers(1, 200, 120 + 30 * i).tolist())
                 for i in range(2)]
        results = batch_generate(model, tok, [{"id": i, "prompt": t} for i, t in
                                              enumerate(texts)], raw=True, max_tokens=4,
                                 batch_size=2, prefill_step_size=32)
        assert calls  # the prompt chunks' last layer was skipped
        assert not store.logits_unread
        for text, r in zip(texts, results):
            alone = generate(model, tok, tok.encode(text), 4).tokens
            assert r["tokens"] == alone[: len(r["tokens"])]
    finally:
        runtime(model).close()


def test_serves_single_sequence_path_skips_the_last_layer_of_its_prompt_chunks(
        converted, monkeypatch):
    """mlx_lm.server streams a model whose caches cannot be batched with mlx-lm's
    own stream_generate: serve wraps it (compat.use_server_stream_generate) with
    the same hint, and the tokens and log-probabilities stay mlx-lm's."""
    import mlx_lm.server as server
    from mlx_lm.generate import stream_generate

    from deltafin_mlx.compat import use_server_stream_generate
    from deltafin_mlx.generation.stream import hinted_stream_generate

    monkeypatch.setattr(server, "stream_generate", stream_generate)  # undone after the test
    use_server_stream_generate(hinted_stream_generate)
    assert server.stream_generate is not stream_generate
    path = converted("kimi_k3")
    prompt = np.random.default_rng(1).integers(1, 200, 300).tolist()
    want = run(load_resident(path), prompt, 64, steps=4)
    model, tok = load(path, "200MB", cache_slots=16)
    try:
        store = runtime(model).store
        switch = store.switches[store.config.final_layer]
        calls, progress = [], []
        unread = switch._unread
        switch._unread = lambda *a: calls.append(1) or unread(*a)
        got = [(r.token, np.array(r.logprobs.astype(mx.float32)))
               for r in server.stream_generate(
                   model=model, tokenizer=tok, prompt=prompt, max_tokens=4,
                   sampler=make_sampler(0.0), prompt_cache=make_prompt_cache(model),
                   prefill_step_size=64,
                   prompt_progress_callback=lambda done, total: progress.append(done))]
        assert len(calls) == 5 and progress  # chunks of 64 (four) and 43; the 300th is the step's
        assert not store.logits_unread
        assert [t for t, _ in got] == want[0]
        assert all(np.array_equal(a, b) for (_, a), b in zip(got, want[1]))
    finally:
        runtime(model).close()
