"""A pass that gives the expert cache back gives the pinned trunk back too (issue
31): each trunk layer is used once per pass, so the pass streams the layers the
memory plan pins through buffers of their own and gets their memory
(plan/memory.py `pass_trunk_bytes`, engine/trunk_pass.py); decoding pins them
again. Tokens, logits and scores stay exactly mlx-lm's."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from deltafin_mlx import load, runtime
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.jobs.batch_lines import read_requests
from deltafin_mlx.jobs.score import ScoreOptions, iter_passes, prepare_all
from deltafin_mlx.testing.decode import greedy
from helpers import make_source, reference_model
from test_runtime import prompt_of

BUDGET = 60_000_000
SLOTS = 32  # of 256 experts: passes give the cache back


@pytest.fixture(scope="module")
def wide_trunk(tmp_path_factory):
    """Eight layers of one shape, each as big as four experts: the plan pins them."""
    root = tmp_path_factory.mktemp("wide_trunk")
    src = make_source(root / "src", "qwen3_moe", num_layers=8, hidden_size=256,
                      num_attention_heads=8, head_dim=64, num_experts=32)
    convert(str(src), root / "model", ConvertOptions(progress=False))
    return root / "model", reference_model(src)


def loaded(path, **options):
    return load(path, BUDGET, cache_slots=SLOTS, context=2048, tokenizer=False,
                warm_start=False, **options)


def long_prompt_run(wide_trunk, steps):
    """A 700-token prompt (beyond what fits beside the cache), mlx-lm's greedy tokens
    and logits for it, and the loaded model, its runtime and its PassTrunk."""
    path, reference = wide_trunk
    prompt = prompt_of(700)
    want = greedy(reference, prompt, steps)
    model, _ = loaded(path)
    state = runtime(model)
    return prompt, want, model, state, state.store.trunk_pass


def weights_of(model, layer):
    path = f"model.layers.{layer}.self_attn.q_proj.weight"
    return dict(tree_flatten(model.parameters()))[path]


def test_the_plan_gives_a_pass_the_pinned_layers_it_streams(wide_trunk):
    path, _ = wide_trunk
    model, _ = loaded(path)
    plan = runtime(model).plan
    runtime(model).close()
    held, _ = loaded(path, stream_trunk=False)
    pinned = runtime(held).plan
    runtime(held).close()
    assert plan.streamed == [] and plan.pass_slots > 0
    assert plan.pass_trunk == [str(i) for i in range(8)]
    assert pinned.pass_trunk == [] and pinned.pass_trunk_bytes == 0
    # Eight layers' memory less the two buffers they stream through.
    assert plan.pass_trunk_bytes > 0
    assert plan.prefill_pass > pinned.prefill_pass
    # A pass beside the cache keeps the trunk pinned: it gets neither.
    assert plan.pass_room(keep_cache=True) == (plan.pass_room() - plan.pass_released_bytes
                                               - plan.pass_trunk_bytes)
    assert plan.pass_kept_tokens < plan.prefill_pass


def test_a_long_prompt_streams_the_trunk_then_decoding_pins_it_again(wide_trunk):
    prompt, (want_tokens, want_logits), model, state, trunk = long_prompt_run(wide_trunk, 4)
    before = [weights_of(model, i) for i in range(8)]
    during = []

    def layer_done(done, layers):
        held = {id(weights_of(model, i)) for i in range(8)}
        during.append((trunk.streamer is not None, len(held)))

    cache = make_prompt_cache(model)
    with state.observe(on_pass_layer=layer_done):
        logits = [model(prompt, cache=cache)[:, -1]]
    # The first MoE layer gives them back; from the next layer on the modules hold
    # the pass's two buffers, not eight pinned arrays.
    assert during[0][0] is False and all(s and n <= 3 for s, n in during[1:]), during
    tokens = []
    for step in range(4):
        y = mx.argmax(logits[-1], axis=-1)
        tokens.append(y)
        logits.append(model(y[:, None], cache=cache)[:, -1])
        mx.eval(logits[-1])
        if step == 0:
            read = trunk.bytes_read
    # Decoding pinned them again, as loaded: no more trunk reads.
    assert trunk.streamer is None and trunk.passes == 1
    assert read > 6 * 200_000 and trunk.bytes_read == read
    after = [weights_of(model, i) for i in range(8)]
    assert len({id(w) for w in after}) == 8
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after))
    assert (np.array(mx.stack(tokens, axis=1)) == want_tokens).all()
    assert mx.array_equal(mx.stack(logits, axis=1), want_logits).item()
    state.close()


def test_a_prompt_that_fits_beside_the_cache_keeps_the_trunk(wide_trunk):
    path, reference = wide_trunk
    model, _ = loaded(path)
    state = runtime(model)
    prompt = prompt_of(state.plan.pass_kept_tokens)
    tokens, logits = greedy(model, prompt, 2)
    want_tokens, want_logits = greedy(reference, prompt, 2)
    assert state.store.trunk_pass.passes == 0 and state.store.trunk_pass.bytes_read == 0
    assert (tokens == want_tokens).all() and mx.array_equal(logits, want_logits).item()
    state.close()


def scores(model, tokens):
    requests = read_requests([json.dumps({"id": 0, "tokens": tokens})], spec_of=dict)
    items, _ = prepare_all(requests, None, ScoreOptions())
    return [r for results, _ in iter_passes(model, items, ScoreOptions()) for r in results][0]


def test_scoring_passes_stream_the_trunk_and_score_as_with_it_pinned(wide_trunk):
    path, reference = wide_trunk
    tokens = np.random.default_rng(3).integers(1, 380, 900).tolist()
    model, _ = loaded(path)
    streamed = scores(model, tokens)
    assert runtime(model).store.trunk_pass.passes >= 1
    runtime(model).close()
    held, _ = loaded(path, stream_trunk=False)
    pinned = scores(held, tokens)
    runtime(held).close()
    np.testing.assert_array_equal(streamed.token_logprobs, pinned.token_logprobs)
    logits = reference(mx.array([tokens]))[0].astype(mx.float32)
    ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    np.testing.assert_allclose(streamed.token_logprobs[1:],
                               ref[np.arange(len(tokens) - 1), tokens[1:]], atol=1e-4)


def test_a_stop_while_the_trunk_is_read_back_leaves_the_model_right(wide_trunk, monkeypatch):
    """A Ctrl-C while decoding reads the trunk back (seconds on K3) leaves the
    layers streamed and the store resuming; the next call finishes the job."""
    prompt, (want_tokens, want_logits), model, state, trunk = long_prompt_run(wide_trunk, 3)
    reference = wide_trunk[1]
    cache = make_prompt_cache(model)
    mx.eval(model(prompt[:, :-1], cache=cache))

    def stopped():
        raise KeyboardInterrupt

    monkeypatch.setattr(trunk, "_pinned_weights", stopped)
    with pytest.raises(KeyboardInterrupt):
        mx.eval(model(prompt[:, -1:], cache=cache))
    assert state.store.resuming and trunk.streamer is not None
    monkeypatch.undo()
    short = prompt[:, :10]  # a prompt that keeps the cache finishes the job first
    tokens, logits = greedy(model, short, 3)
    assert not state.store.resuming and trunk.streamer is None and trunk.passes == 1
    want_short = greedy(reference, short, 3)
    assert (tokens == want_short[0]).all() and mx.array_equal(logits, want_short[1]).item()
    tokens, logits = greedy(model, prompt, 3)
    assert trunk.passes == 2 and trunk.streamer is None
    assert (tokens == want_tokens).all() and mx.array_equal(logits, want_logits).item()
    state.close()
