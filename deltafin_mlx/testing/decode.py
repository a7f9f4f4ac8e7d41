"""The one greedy decode the tests and benchmarks compare models with: mlx-lm's
prompt cache, the whole prompt in one call, then one token at a time; and the model
they compare Deltafin's with, `load_resident`: mlx-lm's, wholly in memory."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from deltafin_mlx.engine.linked_reader import LinkedSources
from deltafin_mlx.engine.load import check_against_manifest, guard_token_ids, switch_shapes
from deltafin_mlx.format.aligned import aligned_empty
from deltafin_mlx.format.bank import read_layout
from deltafin_mlx.format.dtypes import NUMPY, compute_dtype, to_mlx
from deltafin_mlx.format.model_dir import open_model_dir
from deltafin_mlx.model.build import build_model, quantize_like_config


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


def greedy_streamed(directory, prompt: mx.array, steps: int, activation_dtype="auto"):
    """`greedy` of the converted model at `directory`, loaded with an expert cache
    of a quarter of its experts; fails unless experts were read while decoding."""
    from deltafin_mlx.engine.load import load
    from deltafin_mlx.engine.runtime import runtime
    from deltafin_mlx.format.manifest import read_manifest

    m = read_manifest(directory)
    slots = max(m.experts["num_experts"] * len(m.moe_layers) // 4, 1)
    model, _ = load(directory, cache_slots=slots, tokenizer=False,
                    activation_dtype=activation_dtype)
    try:
        tokens, logits = greedy(model, prompt, steps)
        assert runtime(model).stats.misses > 0, "no expert was read: nothing streamed"
    finally:
        runtime(model).close()
    return tokens, logits


def _gather_linked(manifest) -> list:
    """Every linked expert read from its source and stacked per section."""
    sources = LinkedSources(manifest, "buffered")
    weights = []
    try:
        for layer in manifest.moe_layers:
            bank = sources.bank(manifest, layer)
            staging = aligned_empty(bank.staging_bytes)
            stacked = {s.name: np.empty((bank.layout.num_experts, *s.shape), NUMPY[s.dtype])
                       for s in bank.layout.sections}
            for e in range(bank.layout.num_experts):
                bank.read_into(e, {k: v[e] for k, v in stacked.items()}, staging, True)
            for s in bank.layout.sections:
                weights.append((f"{manifest.switch_path(layer)}.{s.name}",
                                to_mlx(stacked[s.name], s.dtype)))
    finally:
        sources.close()
    return weights


def load_resident(path, activation_dtype="auto") -> nn.Module:
    """The whole model in memory: mlx-lm's model class with every bank gathered
    back into its stacked `switch_mlp` tensors. For checks and comparisons."""
    model_dir = open_model_dir(path)
    path, manifest, config = model_dir.path, model_dir.manifest, model_dir.config
    model = build_model(config, path)
    switches = switch_shapes(model, manifest)
    quantize_like_config(model, config)
    check_against_manifest(model, manifest, switches)
    weights = []
    if manifest.linked is not None:
        weights = _gather_linked(manifest)
    for layer in manifest.moe_layers if manifest.linked is None else ():
        layout = read_layout(manifest.bank_path(layer)).for_rank(0, 1)
        data = np.memmap(manifest.bank_path(layer), dtype=np.uint8, mode="r")
        records = data[layout.header_size:].reshape(layout.num_experts, layout.record_size)
        experts = [layout.split_record(records[e]) for e in range(layout.num_experts)]
        for s in layout.held_sections:
            arr = np.stack([np.ascontiguousarray(x[s.name]) for x in experts])
            weights.append((f"{manifest.switch_path(layer)}.{s.name}", to_mlx(arr, s.dtype)))
    for rel in sorted(set(manifest.trunk_files.values())):
        weights.extend(mx.load(str(path / rel)).items())
    model.load_weights(weights, strict=True)
    activation_dtype = compute_dtype(activation_dtype)
    if activation_dtype is not None:
        model.set_dtype(activation_dtype)
    mx.eval(model.parameters())
    model.eval()
    guard_token_ids(model)
    return model
