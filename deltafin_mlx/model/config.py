"""The rules for reading a model's config.json, each stated once.

mlx-lm's Kimi K3 and multimodal configs nest the language model's keys under
`text_config`; every other architecture keeps them at the top level.
"""

from deltafin_mlx.errors import ModelError

# model_type -> the name users know; what the converter accepts and `info` prints.
ARCHITECTURES = {"kimi_k3": "Kimi K3",
                 "kimi_k2": "Kimi K2",
                 "deepseek_v3": "DeepSeek-V3",
                 "qwen3_moe": "Qwen3-MoE",
                 "mixtral": "Mixtral"}

def text_config(config: dict) -> dict:
    """The language model's keys of a config.json."""
    tc = config.get("text_config", config)
    return tc if isinstance(tc, dict) else config


def architecture_name(model_type: str) -> str:
    return ARCHITECTURES.get(model_type, model_type)


def experts_per_token(config: dict) -> int:
    tc = text_config(config)
    for key in ("num_experts_per_tok", "num_experts_per_token"):
        if key in tc:
            return int(tc[key])
    raise ModelError("config.json does not say how many experts each token uses")


def routed_experts(config: dict) -> int:
    """Routed experts per MoE layer (0 where config.json names none)."""
    tc = text_config(config)
    return int(tc.get("n_routed_experts") or tc.get("num_experts") or tc.get("num_local_experts")
               or 0)


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
