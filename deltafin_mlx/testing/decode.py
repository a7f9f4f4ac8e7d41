"""The one greedy decode the tests and benchmarks compare models with: mlx-lm's
prompt cache, the whole prompt in one call, then one token at a time."""

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache


def greedy(model, prompt: mx.array, steps: int):
    """Greedy tokens (batch, steps) and every step's logits (batch, steps + 1, vocab)."""
    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)[:, -1]
    all_logits, tokens = [logits], []
    for _ in range(steps):
        y = mx.argmax(logits, axis=-1)
        tokens.append(y)
        logits = model(y[:, None], cache=cache)[:, -1]
        all_logits.append(logits)
    mx.eval(tokens, all_logits)
    return np.array(mx.stack(tokens, axis=1)), mx.stack(all_logits, axis=1)


def greedy_streamed(directory, prompt: mx.array, steps: int):
    """`greedy` of the converted model at `directory`, loaded with an expert cache
    of a quarter of its experts; fails unless experts were read while decoding."""
    from deltafin_mlx.engine.load import load
    from deltafin_mlx.engine.runtime import runtime
    from deltafin_mlx.format.manifest import read_manifest

    m = read_manifest(directory)
    slots = max(m.experts["num_experts"] * len(m.moe_layers) // 4, 1)
    model, _ = load(directory, cache_slots=slots, tokenizer=False)
    try:
        tokens, logits = greedy(model, prompt, steps)
        assert runtime(model).stats.misses > 0, "no expert was read: nothing streamed"
    finally:
        runtime(model).close()
    return tokens, logits
