"""A prompt is prefilled in passes the memory plan sizes: each pass goes through every
decoder layer whole (attention in the plan's chunks), so each expert its tokens route
to is read at most once per pass, and the tokens and logits stay mlx-lm's."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from deltafin_mlx import batch_generate, generate, load, runtime
from deltafin_mlx.engine.chunked_attention import chunk_bounds, chunk_mask
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.testing.synthetic import ARCHITECTURES

BUDGET = "60MB"  # a plan whose attention chunk is shorter than the prompt


def prompt_of(length, seed=0):
    return mx.array(np.random.default_rng(seed).integers(1, 380, (1, length)).astype(np.int32))


def streamed(path, **options):
    """A model whose cache holds only a few experts, at a budget whose plan makes
    passes longer than its attention chunk."""
    k = read_manifest(path).experts["experts_per_token"]
    model, tok = load(path, BUDGET, cache_slots=k + 1, context=1024, warm_start=False,
                      **options)
    plan = runtime(model).plan
    assert plan.prefill_pass > plan.prefill_step
    return model, tok


def prefill(model, prompt, step, cache=None):
    """mlx-lm's prefill: the prompt but its last token in calls of `step` tokens."""
    cache = cache if cache is not None else make_prompt_cache(model)
    n = prompt.shape[1]
    for start in range(0, n - 1, step):
        model(prompt[:, start : min(start + step, n - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def greedy_after(model, prompt, cache, steps=8):
    logits = model(prompt[:, -1:], cache=cache)[:, -1]
    all_logits, tokens = [logits], []
    for _ in range(steps):
        y = mx.argmax(logits, axis=-1)
        tokens.append(int(y.item()))
        logits = model(y[:, None], cache=cache)[:, -1]
        all_logits.append(logits)
    mx.eval(all_logits)
    return tokens, mx.stack(all_logits)


def test_chunks_cover_the_call_in_order_and_never_end_on_one_token():
    for tokens in range(2, 200):
        for step in (2, 3, 16, 64):
            bounds = chunk_bounds(tokens, step)
            assert bounds[0][0] == 0 and bounds[-1][1] == tokens
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert all(1 < e - s <= step + 1 for s, e in bounds)


def test_a_chunk_gets_the_rows_and_keys_of_the_whole_calls_mask():
    from mlx_lm.models.base import create_causal_mask

    offset, tokens = 37, 50
    whole = create_causal_mask(tokens, offset)
    for start, end in chunk_bounds(tokens, 16):
        want = create_causal_mask(end - start, offset + start)
        assert mx.array_equal(chunk_mask(whole, start, end, tokens, linear=False), want).item()
    assert chunk_mask("causal", 0, 16, tokens, linear=False) == "causal"
    assert chunk_mask(None, 0, 16, tokens, linear=False) is None
    padding = mx.arange(tokens)[None] >= 5
    assert chunk_mask(padding, 16, 32, tokens, linear=True).shape == (1, 16)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_pass_reads_each_expert_its_tokens_route_to_at_most_once(arch, converted):
    model, _ = streamed(converted(arch), tokenizer=False, lookahead=False)
    state = runtime(model)
    plan, record = state.plan, state.manifest.experts["record_size"]
    routed = set()
    prompt = prompt_of(min(plan.prefill_pass, 300) + 1)
    before = state.store.bytes_read
    with state.observe(on_route=lambda layer, idx: routed.update(
            (layer, int(e)) for e in np.unique(idx))):
        prefill(model, prompt, plan.prefill_pass)  # one pass: every prompt token but the last
    read = state.store.bytes_read - before
    assert 0 < read <= len(routed) * record
    state.close()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_and_logits_equal_mlx_lm_prefilling_in_the_plans_chunks(
        arch, converted, references):
    model, _ = streamed(converted(arch), tokenizer=False)
    plan = runtime(model).plan
    prompt = prompt_of(2 * plan.prefill_pass + 37)  # three passes, the last one short
    tokens, logits = greedy_after(model, prompt, prefill(model, prompt, plan.prefill_pass))
    reference = references(arch)
    ref_tokens, ref_logits = greedy_after(reference, prompt,
                                          prefill(reference, prompt, plan.prefill_step))
    assert tokens == ref_tokens
    assert mx.array_equal(logits, ref_logits).item()  # bit-identical on the CPU
    runtime(model).close()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tokens_equal_mlx_lms_own_generate(arch, converted, references):
    """Against mlx-lm's own prefill (2048 tokens per call) the tokens are the same;
    K3's KDA layers round a different chunking differently in the last bits."""
    import mlx_lm

    model, tok = streamed(converted(arch))
    prompt = prompt_of(400).tolist()[0]
    ours = generate(model, tok, prompt, 12).tokens
    theirs = [r.token for r in mlx_lm.stream_generate(references(arch), tok, prompt,
                                                      max_tokens=12)]
    assert ours == theirs
    runtime(model).close()


def test_a_batch_of_long_prompts_equals_each_prompt_alone(converted):
    model, tok = streamed(converted("kimi_k3"))
    texts = [tok.decode(prompt_of(150 + 40 * i, seed=i).tolist()[0]) for i in range(3)]
    results = batch_generate(model, tok, [{"id": i, "prompt": t} for i, t in enumerate(texts)],
                             raw=True, max_tokens=6, batch_size=3)
    for text, r in zip(texts, results):
        alone = generate(model, tok, tok.encode(text), 6).tokens
        assert r["tokens"] == alone[: len(r["tokens"])]
    runtime(model).close()


def test_progress_shows_the_pass_and_the_layer_it_is_at(converted):
    import io

    from deltafin_mlx.generation.stream import PrefillProgress

    model, tok = streamed(converted("qwen3_moe"))
    shown = io.StringIO()
    prompt = prompt_of(2 * 100 + 10).tolist()[0]  # passes of 100 tokens: 100, 100, 9
    generate(model, tok, prompt, 2, prefill_step_size=100,
             prompt_progress_callback=PrefillProgress(shown, min_tokens=1))
    layers = len(runtime(model).manifest.moe_layers)
    assert f"(pass 1/3, layer 1/{layers})" in shown.getvalue()
    assert f"(pass 3/3, layer {layers}/{layers})" in shown.getvalue()
    assert shown.getvalue().endswith("\r\033[K")  # the line is cleared when the prompt is done
    runtime(model).close()


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    """K3's layout with many experts per layer for the experts a token uses, as K3
    has (896 for 16): the prompt's last token then adds little to what it reads."""
    from helpers import make_source
    from deltafin_mlx.convert.convert import ConvertOptions, convert

    root = tmp_path_factory.mktemp("many_experts")
    src = make_source(root / "src", "kimi_k3", num_experts=128, experts_per_token=4)
    convert(str(src), root / "model", ConvertOptions(progress=False))
    return root / "model"


@pytest.mark.parametrize("share", [0.1, 0.25, 0.5])
def test_a_prompts_prefill_reads_at_most_1_1x_the_union_of_its_routing(share, many_experts):
    """The passes and the prompt's last token, with the default settings (reads
    ahead on), at caches holding at least one token's experts in every layer."""
    m = read_manifest(many_experts)
    total = m.experts["num_experts"] * len(m.moe_layers)
    model, _ = load(many_experts, "200MB", cache_slots=int(share * total), context=1024,
                    tokenizer=False, warm_start=False)
    state = runtime(model)
    routed = set()
    prompt = prompt_of(600)
    before = state.store.bytes_read
    with state.observe(on_route=lambda layer, idx: routed.update(
            (layer, int(e)) for e in np.unique(idx))):
        cache = prefill(model, prompt, state.plan.prefill_pass)
        mx.eval(model(prompt[:, -1:], cache=cache))  # the last token: the first token's logits
    read = state.store.bytes_read - before
    assert read <= 1.10 * len(routed) * m.experts["record_size"]
    state.close()
