"""The rules for reading a model's config.json, each stated once.

mlx-lm's Kimi K3 and multimodal configs nest the language model's keys under
`text_config`; every other architecture keeps them at the top level.
"""

import math

from deltafin_mlx.errors import ModelError

# The model types Deltafin converts and runs, each held to mlx-lm's tokens by
# tests/convert/test_every_moe_type.py (which fails when this differs from what it
# runs): mlx-lm 0.32.2's MoE types. A model is named by its model_type, as mlx-lm
# and config.json name it, everywhere (info, list, plan, convert --help).
SUPPORTED_TYPES = (
    "Klear", "afmoe", "bailing_hybrid", "bailing_moe", "bailing_moe_linear", "bailing_moe_v3",
    "deepseek", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v41",
    "deepseek_v41_text", "dots1", "ernie4_5_moe", "exaone_moe", "gemma4", "gemma4_text",
    "gemma4_unified", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "granitemoe",
    "granitemoehybrid", "hunyuan", "jamba", "joyai_llm_flash", "kimi_k2", "kimi_k25", "kimi_k3",
    "kimi_linear", "kimi_vl", "laguna", "lfm2_moe", "llama4", "llava", "longcat_flash",
    "longcat_flash_ngram", "mellum", "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl",
    "mistral3", "mistral4", "mixtral", "nemotron_h", "olmoe", "phi-msft", "phimoe", "phixtral",
    "qwen2_moe", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "qwen3_next", "qwen3_vl_moe", "step3p5")


def text_config(config: dict) -> dict:
    """The language model's keys of a config.json."""
    tc = config.get("text_config", config)
    return tc if isinstance(tc, dict) else config


def _named_experts(tc: dict) -> int:
    """Routed experts as the usual keys name them (0 where none does): for bounds
    only. A model's shape comes from mlx-lm's built model (model/modules.py
    `moe_shape`), which knows every family's own key."""
    return int(tc.get("n_routed_experts") or tc.get("num_experts") or tc.get("num_local_experts")
               or tc.get("moe_num_experts") or 0)


def max_context(config: dict):
    """The longest context the model takes (None where config.json does not say)."""
    return text_config(config).get("max_position_embeddings") or config.get("max_position_embeddings")


def eos_token_ids(config: dict):
    """End-of-sequence ids as a list (None where config.json names none)."""
    eos = config.get("eos_token_id", text_config(config).get("eos_token_id"))
    return [eos] if isinstance(eos, int) else eos


def tied_embeddings(config: dict) -> bool:
    return bool(text_config(config).get("tie_word_embeddings",
                                         config.get("tie_word_embeddings", False)))


# key -> (least, most), as mlx-lm's ModelArgs name them: far above any released model,
# far below what building mlx-lm's model would exhaust (a layer is Python objects,
# built one by one), so a forged config.json is one line before any model is built.
MAX_LAYERS = 512
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
SIZES = {
    **{k: (1, MAX_LAYERS) for k in LAYER_KEYS},
    **{k: (0, 1 << 16) for k in ("n_routed_experts", "num_experts", "num_local_experts",
                                 "moe_num_experts", "num_experts_per_tok",
                                 "num_experts_per_token")},
    **{k: (1, 1 << 20) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                 "head_dim")},
    **{k: (0, 1 << 20) for k in ("moe_intermediate_size", "intermediate_size")},
    "first_k_dense_replace": (0, MAX_LAYERS),
    "vocab_size": (1, 1 << 24),
}
# Numbers mlx-lm computes with as floats (a string here fails only when the model runs).
FLOATS = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps",
          "routed_scaling_factor", "partial_rotary_factor")


def check_config(config: dict, where, error=ModelError):
    """config.json's shape, sizes and numbers, before `plan` or `deltafin-convert`
    builds a model from it: one line (raised as `error`), not a traceback or memory
    exhausted later."""
    if not isinstance(config, dict):
        raise error(f"{where}: not a JSON object")
    tc = config if config.get("text_config") is None else config["text_config"]
    if not isinstance(tc, dict):
        raise error(f"{where}: text_config must be an object")
    if not isinstance(config.get("model_type"), (str, type(None))):
        raise error(f"{where}: model_type must be a string")
    for c in (config, tc):
        for key, (least, most) in SIZES.items():
            v = c.get(key)
            listed = key == "moe_intermediate_size" and isinstance(v, list) and v  # hunyuan's
            if v is not None and not all(type(n) is int and least <= n <= most
                                         for n in (v if listed else [v])):
                raise error(f"{where}: {key} is {v!r:.60}, not an integer from {least} "
                            f"to {most:,}")
        for key in FLOATS:
            v = c.get(key)
            if v is not None and not (type(v) in (int, float) and math.isfinite(v)):
                raise error(f"{where}: {key} is {v!r:.60}, not a number")
        # mlx-lm takes an every-Nth-layer integer (deepseek_v3) or one flag per layer
        # (mimo_v2_flash, minimax_m3_vl).
        freq = c.get("moe_layer_freq")
        if freq is not None and not all(type(f) is int and 0 <= f <= MAX_LAYERS
                                        for f in (freq if isinstance(freq, list) else [freq])):
            raise error(f"{where}: moe_layer_freq is {freq!r:.60}, not a non-negative "
                        "integer or a list of them")
        if not isinstance(c.get("quantization_config") or {}, dict):
            raise error(f"{where}: quantization_config must be an object")
    experts, per_token = _named_experts(tc), tc.get("num_experts_per_tok",
                                                    tc.get("num_experts_per_token"))
    if experts and per_token is not None and not 0 < per_token <= experts:
        raise error(f"{where}: {per_token:,} experts per token, " + (
            "more than" if per_token else "not 1 to") + f" the {experts:,} routed experts")


def most_source_tensors(config: dict) -> int:
    """More tensors than any checkpoint of this (checked) config.json holds: per
    layer, every routed expert's linears with their companions (scales, shapes,
    biases) and the trunk's, with room to spare (K3 holds about a third of it)."""
    tc = text_config(config)  # where a count is named otherwise: the most allowed
    layers = next((tc[k] for k in LAYER_KEYS if tc.get(k)), MAX_LAYERS)
    experts = _named_experts(tc) or SIZES["num_experts"][1]
    return 16 * (layers + 8) * (experts + 16)
