"""Tiny checkpoints in the layouts their publishers release them in.

`write_original(out, source)` builds a small random model with mlx-lm's own class
for the source's architecture and writes it as the Hugging Face release lays it
out: the tensors that mlx-lm's `sanitize` for that class reads (one tensor per
expert, or experts stacked and fused as Qwen3.5, Llama 4 and Mistral 4 release
them; fused projections where the release fuses them; DeepSeek-V3's whole
`kv_b_proj`; Qwen3-Next's zero-centred norms and [C, 1, K] convolutions; vision
towers and multi-token-prediction layers that sanitize drops), in the release's
number formats (FP8 e4m3 with 128x128 block `weight_scale_inv`, or one scale per
tensor as Mistral's; gpt-oss's MXFP4 `_blocks`/`_scales`; Kimi-K2-Thinking's INT4
compressed-tensors), with the release's config.json keys and tokenizer files. Each
writer is the inverse of that sanitize: loading the directory with `mlx_lm.load`
gives back the built weights up to the release's number format
(tests/convert/test_original_layouts.py checks it).

The weights are scaled as `synthetic.py`'s are: matrices N(0, 1/fan_in), norms
near 1, routers and their correction biases random (several mlx-lm classes start
routers and biases at zero, which would make routing constant), so activations stay
O(1), routing varies over tokens and layers, and the experts decide the tokens.
"""

import json
import re
import struct
from pathlib import Path
from typing import Dict, Iterable, List, Tuple

import mlx.core as mx
import numpy as np

from deltafin_mlx.testing.tokenizers import (
    KIMI_BOS,
    KIMI_EOS,
    write_bpe_tokenizer_files,
    write_kimi_tokenizer_files,
)

FP8_QUANTIZATION = {  # DeepSeek-V3's, Kimi K2's and MiniMax-M2's config.json
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}

INT4_QUANTIZATION = {  # Kimi-K2-Thinking's: INT4 routed experts, the rest bf16
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

MXFP4_QUANTIZATION = {  # gpt-oss's
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


# --- configs: the release's config.json keys, sizes scaled down ----------------------
# Widths are multiples of 64 (the default group size divides every matrix, so mlx-lm
# and Deltafin quantize the same modules); several are not multiples of 128, so FP8
# block scales cover partial blocks as the releases' kv_a_proj_with_mqa (576 rows) does.


def _deepseek_v3_config(model_type="deepseek_v3", **ids) -> dict:
    kimi = model_type == "kimi_k2"
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        "aux_loss_alpha": 0.001,
        **ids,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "hidden_size": 192,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "kv_lora_rank": 64,
        "max_position_embeddings": 131072 if kimi else 163840,
        "model_type": model_type,
        "moe_intermediate_size": 128,
        "moe_layer_freq": 1,
        # DeepSeek-V3 routes within groups (8 of 256 experts, 4 groups of 8 kept);
        # Kimi K2 has one group.
        "n_group": 1 if kimi else 4,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 2,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        # The releases carry one multi-token-prediction layer as model.layers.61,
        # which mlx-lm's sanitize drops by that number: a 3-layer model cannot.
        "num_nextn_predict_layers": 0,
        "q_lora_rank": 128,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "beta_fast": 1.0 if kimi else 32,
            "beta_slow": 1.0 if kimi else 1,
            "factor": 32.0 if kimi else 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "rope_theta": 50000.0 if kimi else 10000,
        "routed_scaling_factor": 2.827 if kimi else 2.5,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1 if kimi else 2,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.48.3" if kimi else "4.33.1",
        "use_cache": True,
        "v_head_dim": 64,
        "vocab_size": 1024 if kimi else 512,
    }


def _deepseek_v32_config(**ids) -> dict:
    return {
        **_deepseek_v3_config(**ids),
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "index_head_dim": 64,
        "index_n_heads": 4,
        # Fewer keys than the tests' prompts hold: the sparse attention selects.
        "index_topk": 8,
        "num_nextn_predict_layers": 1,  # its MTP layer is model.layers.3 here
        "transformers_version": "4.44.2",
    }


def _glm_moe_dsa_config(**ids) -> dict:
    """GLM-5's: DeepSeek-V3.2's layers (MLA with an indexer), GLM's rope keys."""
    c = _deepseek_v32_config(**ids)
    for k in ("auto_map", "rope_scaling", "rope_theta", "seq_aux", "aux_loss_alpha", "ep_size"):
        c.pop(k)
    return {
        **c,
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "dtype": "bfloat16",
        "hidden_act": "silu",
        "indexer_rope_interleave": True,
        "n_group": 1,
        "topk_group": 1,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "torch_dtype": "bfloat16",
        "transformers_version": "5.0.0.dev0",
    }


def _kimi_k25_config(**ids) -> dict:
    text = _deepseek_v3_config("kimi_k2", **ids)
    for k in ("architectures", "auto_map"):
        text.pop(k)
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        **ids,
        "media_placeholder_token_id": 1020,
        "model_type": "kimi_k25",
        "pad_token_id": 1021,
        "quantization_config": {
            **INT4_QUANTIZATION,
            "ignore": INT4_QUANTIZATION["ignore"] + ["re:.*vision_tower.*", "re:.*mm_projector.*"],
        },
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.1",
        # Nobody here runs the vision tower: converters skip it as sanitize does.
        "vision_config": {"mm_hidden_size": 32, "model_type": "kimi_k25_vision",
                          "vt_hidden_size": 32, "vt_num_hidden_layers": 1},
    }


def _mistral4_config(**ids) -> dict:
    c = _deepseek_v3_config(**ids)
    for k in ("auto_map", "aux_loss_alpha", "ep_size", "num_nextn_predict_layers",
              "scoring_func", "seq_aux", "topk_method", "rope_scaling", "rope_theta"):
        c.pop(k)
    return {
        **c,
        "architectures": ["Mistral4ForCausalLM"],
        "model_type": "mistral4",
        "n_group": 1,
        "topk_group": 1,
        "rope_interleave": True,
        "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 128.0,
                            "llama_4_scaling_beta": 0.1, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 8192, "rope_theta": 10000.0,
                            "rope_type": "yarn"},
        "quantization_config": {"activation_scheme": "static", "quant_method": "fp8"},
        "transformers_version": "5.0.0.dev0",
    }


def _gpt_oss_config(**ids) -> dict:
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        **ids,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        # Sliding-window layers alternate with full ones; a window shorter than the
        # tests' prompts makes the rotating cache wrap.
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 4,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_local_experts": 16,
        "output_router_logits": False,
        "quantization_config": MXFP4_QUANTIZATION,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 8,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": 512,
    }


def _glm4_moe_config(**ids) -> dict:
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        **ids,
        "first_k_dense_replace": 1,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "max_position_embeddings": 131072,
        "model_type": "glm4_moe",
        "moe_intermediate_size": 64,
        "n_group": 1,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        # The release's model.layers.92 (here model.layers.3): sanitize drops it.
        "num_nextn_predict_layers": 1,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.54.0",
        "use_cache": True,
        "use_qk_norm": True,
        "vocab_size": 512,
    }


def _qwen3_next_config(**ids) -> dict:
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        **ids,
        "decoder_sparse_step": 1,
        "full_attention_interval": 4,  # layers 0-2 gated delta, layer 3 attention
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "intermediate_size": 256,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 32,
        "max_position_embeddings": 262144,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 64,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0.dev0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 512,
    }


def _minimax_config(**ids) -> dict:
    return {
        "architectures": ["MiniMaxM2ForCausalLM"],
        "attention_dropout": 0.0,
        "attn_type_list": [1, 1],
        **ids,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 196608,
        "model_type": "minimax",
        "num_attention_heads": 4,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_local_experts": 16,
        "output_router_logits": False,
        "qk_norm_type": "per_layer",
        "quantization_config": {**FP8_QUANTIZATION, "fmt": "float8_e4m3fn"},
        "rms_norm_eps": 1e-06,
        "rope_theta": 5000000,
        "rotary_dim": 32,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "scoring_func": "sigmoid",
        "shared_intermediate_size": 0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.1",
        "use_cache": True,
        "use_qk_norm": True,
        "use_routing_bias": True,
        "vocab_size": 512,
    }


def _qwen3_5_moe_config(**ids) -> dict:
    text = {
        "attention_bias": False,
        "attn_output_gate": True,
        **ids,
        "dtype": "bfloat16",
        "full_attention_interval": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 32,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 64,
        "mtp_num_hidden_layers": 1,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "shared_expert_intermediate_size": 64,
        "tie_word_embeddings": False,
        "vocab_size": 512,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "image_token_id": 500,
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": 501,
        # Nobody here runs the vision tower: converters skip it as sanitize does.
        "vision_config": {"depth": 1, "hidden_size": 32, "model_type": "qwen3_5_moe",
                          "num_heads": 2, "out_hidden_size": 128, "patch_size": 16},
        "vision_end_token_id": 502,
        "vision_start_token_id": 503,
    }


def _llama4_config(**ids) -> dict:
    text = {
        "attention_bias": False,
        # Chunked attention over fewer tokens than the tests' prompts hold.
        "attention_chunk_size": 8,
        "attention_dropout": 0.0,
        "attn_scale": 0.1,
        "attn_temperature_tuning": True,
        **ids,
        "floor_scale": 8192,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 128,
        "initializer_range": 0.02,
        "interleave_moe_layer_step": 1,
        "intermediate_size": 64,
        "intermediate_size_mlp": 256,
        "max_position_embeddings": 10485760,
        "model_type": "llama4_text",
        "moe_layers": [0, 1, 2, 3],
        "no_rope_layers": [1, 1, 1, 0],
        "num_attention_heads": 4,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 16,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0,
        "router_aux_loss_coef": 0.001,
        "torch_dtype": "bfloat16",
        "use_qk_norm": True,
        "vocab_size": 512,
    }
    return {
        "architectures": ["Llama4ForConditionalGeneration"],
        "boi_token_index": 500,
        "eoi_token_index": 501,
        "image_token_index": 502,
        "model_type": "llama4",
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0.dev0",
        # Nobody here runs the vision model: converters skip it as sanitize does.
        "vision_config": {"hidden_size": 32, "model_type": "llama4_vision_model",
                          "num_hidden_layers": 1, "patch_size": 14},
    }


# --- random weights for the built model ------------------------------------------


def _random_weights(model, seed: int) -> Dict[str, mx.array]:
    """Every parameter of `model` (mlx-lm's names), random as the module says."""
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    out = {}
    for name, p in tree_flatten(model.parameters()):
        shape = tuple(p.shape)
        last = name.rsplit(".", 1)[-1]
        if name.endswith("embed_tokens.weight"):
            x = rng.standard_normal(shape)  # the first norm sees O(1) inputs
        elif last == "A_log":
            x = np.log(rng.uniform(1.0, 16.0, size=shape))  # decay rates in [1, 16]
        elif "conv1d" in name:
            x = rng.standard_normal(shape) * 0.5
        elif last == "sinks":
            x = rng.standard_normal(shape)
        elif len(shape) == 1 and ("norm" in name):
            # Near 1 but not exactly, so a norm swapped with another one shows.
            x = 1.0 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1 or last in ("bias", "dt_bias", "e_score_correction_bias"):
            # Routers' correction biases, linear and expert biases: small against
            # the O(1) scores, so they shift routing without pinning it.
            x = 0.1 * rng.standard_normal(shape)
        else:
            # A matrix (or a stack of them): 1/sqrt(fan_in) keeps outputs O(1),
            # routers included, whose scores then vary over tokens.
            x = rng.standard_normal(shape) * shape[-1] ** -0.5
        out[name] = mx.array(x.astype(np.float32))
    return out


# --- the inverses of each class's sanitize ---------------------------------------


def _unstack(w, prefix, switch, experts, names):
    """`{prefix}.{switch}.{gate,up,down}_proj.weight` [E, ...] as one tensor per
    expert, `{prefix}.experts.{e}.{name}.weight`, names mapping mlx-lm's to the
    release's (w1/w3/w2 or gate/up/down)."""
    for mlx_name, release in names.items():
        stacked = w.pop(f"{prefix}.{switch}.{mlx_name}.weight")
        for e in range(experts):
            w[f"{prefix}.experts.{e}.{release}.weight"] = stacked[e]


GLU = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
W123 = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _release_deepseek_v3(w, c, lm=""):
    for layer in range(c["num_hidden_layers"]):
        p = f"{lm}model.layers.{layer}"
        if f"{p}.mlp.switch_mlp.gate_proj.weight" in w:
            _unstack(w, f"{p}.mlp", "switch_mlp", c["n_routed_experts"], GLU)
        # mlx-lm splits kv_b_proj per head into embed_q (transposed) and unembed_out.
        a = f"{p}.self_attn"
        wk = w.pop(f"{a}.embed_q.weight")  # [heads, kv_lora, nope]
        wv = w.pop(f"{a}.unembed_out.weight")  # [heads, v_head, kv_lora]
        kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)
        w[f"{a}.kv_b_proj.weight"] = kv_b.reshape(-1, c["kv_lora_rank"])
    return w


def _release_gpt_oss(w, c):
    raw = {}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        gate, up = w.pop(f"{p}.gate_proj.weight"), w.pop(f"{p}.up_proj.weight")
        # gate_up_proj interleaves gate and up rows: sanitize splits [::2] and [1::2].
        gate_up = mx.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[-1])
        gb, ub = w.pop(f"{p}.gate_proj.bias"), w.pop(f"{p}.up_proj.bias")
        w[f"{p}.gate_up_proj_bias"] = mx.stack([gb, ub], axis=2).reshape(gb.shape[0], -1)
        w[f"{p}.down_proj_bias"] = w.pop(f"{p}.down_proj.bias")
        for name, x in (("gate_up_proj", gate_up), ("down_proj", w.pop(f"{p}.down_proj.weight"))):
            q, scales = mx.quantize(x, group_size=32, bits=4, mode="mxfp4")
            # [E, out, in/32, 16] bytes of E2M1 pairs; sanitize views them as uint32.
            blocks = q.view(mx.uint8).reshape(*x.shape[:-1], x.shape[-1] // 32, 16)
            raw[f"{p}.{name}_blocks"] = ("U8", blocks)
            raw[f"{p}.{name}_scales"] = ("U8", scales)
    return w, raw


def _append_mtp_layer(w, n, h):
    """The multi-token-prediction layer GLM-4.5's and DeepSeek-V3.2's releases append
    as model.layers.{n} (sanitize drops it): a decoder layer like the last, its
    experts included, and its own projections."""
    last = f"model.layers.{n - 1}."
    for k in [k for k in w if k.startswith(last)]:
        w[f"model.layers.{n}." + k[len(last):]] = w[k]
    mtp = f"model.layers.{n}"
    w[f"{mtp}.eh_proj.weight"] = mx.zeros((h, 2 * h))
    for k in ("enorm", "hnorm", "shared_head.norm"):
        w[f"{mtp}.{k}.weight"] = mx.ones((h,))


def _release_kimi_k25(w, c):
    """Kimi K2.5's release: K2's layers under `language_model.`, its INT4 experts as
    K2-Thinking's, and a vision tower and projector beside (sanitize drops them)."""
    _release_deepseek_v3(w, c["text_config"], lm="language_model.")
    w["vision_tower.encoder.blocks.0.wqkv.weight"] = mx.zeros((96, 32))
    w["mm_projector.proj.0.weight"] = mx.zeros((128, 128))
    return w


def _release_mistral4(w, c):
    """Mistral 4's release: DeepSeek-V3's layers with each layer's experts stacked and
    fused, `experts.gate_up_proj` [E, 2I, H] (gate rows, then up) and
    `experts.down_proj` [E, H, I]; every matrix FP8 with one scale per tensor (per
    expert for the stacked ones) and a static activation scale (see _encode)."""
    _release_deepseek_v3(w, c)
    for layer in range(c["first_k_dense_replace"], c["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp"
        gate = mx.stack([w.pop(f"{p}.experts.{e}.gate_proj.weight") for e in range(c["n_routed_experts"])])
        up = mx.stack([w.pop(f"{p}.experts.{e}.up_proj.weight") for e in range(c["n_routed_experts"])])
        down = mx.stack([w.pop(f"{p}.experts.{e}.down_proj.weight") for e in range(c["n_routed_experts"])])
        w[f"{p}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        w[f"{p}.experts.down_proj"] = down
    return w


def _release_deepseek_v32(w, c):
    _release_deepseek_v3(w, c)
    _append_mtp_layer(w, c["num_hidden_layers"], c["hidden_size"])
    return w


def _release_glm4_moe(w, c):
    n = c["num_hidden_layers"]
    for layer in range(n):
        p = f"model.layers.{layer}.mlp"
        if f"{p}.switch_mlp.gate_proj.weight" in w:
            _unstack(w, p, "switch_mlp", c["n_routed_experts"], GLU)
    _append_mtp_layer(w, n, c["hidden_size"])
    return w


_QWEN3_NEXT_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                       "model.norm.weight", ".q_norm.weight", ".k_norm.weight")


def _release_qwen3_next(w, c):
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp"
        if f"{p}.switch_mlp.gate_proj.weight" in w:
            _unstack(w, p, "switch_mlp", c["num_experts"], GLU)
    for k in list(w):
        if k.endswith("conv1d.weight"):  # the release's Conv1d is [C, 1, K]
            w[k] = w[k].swapaxes(1, 2)
        if k.endswith(_QWEN3_NEXT_CENTRED):  # stored as weight - 1; sanitize adds 1
            w[k] = w[k] - 1.0
    # The release's multi-token-prediction module, which sanitize drops ("mtp.").
    h, e = c["hidden_size"], c["num_experts"]
    w["mtp.fc.weight"] = mx.zeros((h, 2 * h))
    for k in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        w[f"mtp.{k}.weight"] = mx.zeros((h,))
    for x in range(e):
        for name in ("gate_proj", "up_proj"):
            w[f"mtp.layers.0.mlp.experts.{x}.{name}.weight"] = mx.zeros((c["moe_intermediate_size"], h))
        w[f"mtp.layers.0.mlp.experts.{x}.down_proj.weight"] = mx.zeros((h, c["moe_intermediate_size"]))
    return w


def _release_qwen3_5_moe(w, c):
    """Qwen3.5's release stacks each layer's experts already, as two tensors without
    a `.weight`: `experts.gate_up_proj` [E, 2I, H] (gate rows, then up rows) and
    `experts.down_proj` [E, H, I], under `model.language_model.`; its vision tower
    (`model.visual.`) and multi-token-prediction module (`mtp.`) sanitize drops."""
    t = c["text_config"]
    out = {}
    for k, v in w.items():
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model."):]
        elif k.startswith("language_model."):
            k = k[len("language_model."):]
        if k.endswith("conv1d.weight"):
            v = v.swapaxes(1, 2)
        if k.endswith(_QWEN3_NEXT_CENTRED):
            v = v - 1.0
        out[k] = v
    for layer in range(t["num_hidden_layers"]):
        p = f"model.language_model.layers.{layer}.mlp"
        gate = out.pop(f"{p}.switch_mlp.gate_proj.weight")
        up = out.pop(f"{p}.switch_mlp.up_proj.weight")
        out[f"{p}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
        out[f"{p}.experts.down_proj"] = out.pop(f"{p}.switch_mlp.down_proj.weight")
    h, v = t["hidden_size"], c["vision_config"]["hidden_size"]
    out["model.visual.patch_embed.proj.weight"] = mx.zeros((v, 3, 2, 16, 16))
    out["model.visual.blocks.0.norm1.weight"] = mx.ones((v,))
    out["model.visual.merger.linear_fc2.weight"] = mx.zeros((h, 4 * v))
    out["mtp.fc.weight"] = mx.zeros((h, 2 * h))
    out["mtp.layers.0.mlp.experts.down_proj"] = mx.zeros((t["num_experts"], h, t["moe_intermediate_size"]))
    return out


def _release_llama4(w, c):
    """Llama 4's release stacks each layer's experts transposed, [E, in, out]:
    `experts.gate_up_proj` [E, H, 2I] (gate columns, then up) and `experts.down_proj`
    [E, I, H], without `.weight`; its vision model and projector sanitize drops."""
    for layer in range(c["text_config"]["num_hidden_layers"]):
        p = f"language_model.model.layers.{layer}.feed_forward.experts"
        gate, up = w.pop(f"{p}.gate_proj.weight"), w.pop(f"{p}.up_proj.weight")
        w[f"{p}.gate_up_proj"] = mx.concatenate([gate, up], axis=1).swapaxes(1, 2)
        w[f"{p}.down_proj"] = w.pop(f"{p}.down_proj.weight").swapaxes(1, 2)
    w["vision_model.patch_embedding.linear.weight"] = mx.zeros((32, 3 * 14 * 14))
    w["multi_modal_projector.linear_1.weight"] = mx.zeros((c["text_config"]["hidden_size"], 32))
    return w


def _release_minimax(w, c):
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}.block_sparse_moe"
        _unstack(w, p, "switch_mlp", c["num_local_experts"], W123)
    return w


# --- number formats ------------------------------------------------------------------


def _fp8_block(x: mx.array) -> Tuple[mx.array, mx.array]:
    """FP8 e4m3 codes and float32 `weight_scale_inv` of one matrix, per 128x128
    block (the last blocks partial), as DeepSeek's and MiniMax's exports make them."""
    m, n = x.shape
    bs = 128
    pm, pn = (-m) % bs, (-n) % bs
    blocks = mx.pad(x, ((0, pm), (0, pn))).reshape((m + pm) // bs, bs, (n + pn) // bs, bs)
    scale_inv = mx.maximum(mx.abs(blocks).max(axis=(1, 3)), 1e-12) / 448.0
    scaled = (blocks / scale_inv[:, None, :, None]).reshape(m + pm, n + pn)[:m, :n]
    return mx.to_fp8(scaled), scale_inv.astype(mx.float32)


def _int4_pack(x: mx.array) -> Tuple[mx.array, mx.array]:
    """compressed-tensors' symmetric INT4 over groups of 32: int32 words of eight
    4-bit codes (q + 8), low nibble first, and bf16 scales; mlx-lm reads them as
    affine with biases -8 * scale."""
    out, n = x.shape
    g = x.reshape(out, n // 32, 32)
    scale = (mx.abs(g).max(axis=-1) / 7.0).astype(mx.bfloat16)
    q = mx.clip(mx.round(g / scale[..., None].astype(mx.float32)), -8, 7) + 8
    q = np.array(q.astype(mx.uint32)).reshape(out, n // 8, 8)
    words = np.zeros((out, n // 8), np.uint32)
    for i in range(8):
        words |= q[..., i] << np.uint32(4 * i)
    return mx.array(words.view(np.int32)), scale


# What each source is: its architecture's config, inverse sanitize, tokenizer, and
# which matrices its release stores in which number format.


def _fp8_deepseek(name):
    # The decoder layers' projections; the routers, norms, embedding and head stay
    # bf16 (and the correction biases float32), as in DeepSeek-V3's release. (V3.2's
    # indexer wq_b/wk stay bf16 here.)
    return (name.startswith("model.layers.") and name.endswith("proj.weight")
            and ".mlp.gate." not in name)


def _fp8_minimax(name):
    return name.startswith("model.layers.") and (
        name.endswith("_proj.weight") or ".experts." in name)


def _fp8_tensor(x: mx.array) -> Tuple[mx.array, mx.array]:
    """FP8 e4m3 codes and float32 scale_inv with one scale per matrix ([] for a
    matrix, [E, 1, 1] for stacked experts), as Mistral's exports make them."""
    axes = tuple(range(x.ndim - 2, x.ndim))
    scale_inv = mx.maximum(mx.abs(x).max(axis=axes, keepdims=x.ndim > 2), 1e-12) / 448.0
    return mx.to_fp8(x / scale_inv), scale_inv.astype(mx.float32)


def _fp8_mistral(name):
    # Per tensor, the stacked experts included: see _fp8_tensor.
    return name.startswith("model.layers.") and ".mlp.gate." not in name and name.endswith(
        ("proj.weight", "experts.gate_up_proj", "experts.down_proj"))


def _int4_k2_thinking(name):
    return ".mlp.experts." in name


SOURCES = {
    # name: (config(**token ids), inverse sanitize, tokenizer, fp8, int4)
    "deepseek_v3_fp8": (_deepseek_v3_config, _release_deepseek_v3, "mixtral", _fp8_deepseek, None),
    "deepseek_v3": (_deepseek_v3_config, _release_deepseek_v3, "mixtral", None, None),
    "deepseek_v32_fp8": (_deepseek_v32_config, _release_deepseek_v32, "mixtral", _fp8_deepseek, None),
    "glm_moe_dsa": (_glm_moe_dsa_config, _release_deepseek_v32, "qwen3_moe", None, None),
    "kimi_k2_fp8": (lambda **ids: _deepseek_v3_config("kimi_k2", **ids),
                    _release_deepseek_v3, "kimi", _fp8_deepseek, None),
    "kimi_k2_int4": (lambda **ids: _deepseek_v3_config("kimi_k2", **ids),
                     _release_deepseek_v3, "kimi", None, _int4_k2_thinking),
    "kimi_k25_int4": (_kimi_k25_config, _release_kimi_k25, "kimi", None, _int4_k2_thinking),
    "mistral4_fp8": (_mistral4_config, _release_mistral4, "mixtral", _fp8_mistral, None),
    "gpt_oss": (_gpt_oss_config, _release_gpt_oss, "qwen3_moe", None, None),
    "glm4_moe": (_glm4_moe_config, _release_glm4_moe, "qwen3_moe", None, None),
    "qwen3_next": (_qwen3_next_config, _release_qwen3_next, "qwen3_moe", None, None),
    "minimax_fp8": (_minimax_config, _release_minimax, "qwen3_moe", _fp8_minimax, None),
    "qwen3_5_moe": (_qwen3_5_moe_config, _release_qwen3_5_moe, "qwen3_moe", None, None),
    "llama4": (_llama4_config, _release_llama4, "qwen3_moe", None, None),
}


def _token_ids(out: Path, tokenizer: str) -> dict:
    if tokenizer == "kimi":
        write_kimi_tokenizer_files(out, "k2")
        return {"bos_token_id": KIMI_BOS, "eos_token_id": KIMI_EOS}
    _, ids = write_bpe_tokenizer_files(out, tokenizer)
    if tokenizer == "mixtral":
        return {"bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"]}
    return {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}


def built_model(config: dict, seed: int = 0):
    """mlx-lm's model for `config`, with the random weights `write_original` writes
    for `seed` (float32)."""
    from deltafin_mlx.compat import model_classes

    Model, Args = model_classes(config)
    model = Model(Args.from_dict(config))
    model.load_weights(list(_random_weights(model, seed).items()))
    return model


def _encode(name: str, x: mx.array, fp8, int4) -> List[Tuple[str, str, mx.array]]:
    if fp8 is _fp8_mistral and fp8(name):
        codes, scale_inv = _fp8_tensor(x)
        # A static input scale beside each (sanitize drops them).
        act = (name[: -len("weight")] + "activation_scale" if name.endswith(".weight")
               else name + "_activation_scale")
        return [(name, "F8_E4M3", codes), (name + "_scale_inv", "F32", scale_inv),
                (act, "F32", mx.array(1.0))]
    if x.ndim == 2 and fp8 is not None and fp8(name):
        codes, scale_inv = _fp8_block(x)
        return [(name, "F8_E4M3", codes), (name + "_scale_inv", "F32", scale_inv)]
    if x.ndim == 2 and int4 is not None and int4(name):
        base = name[: -len("weight")]
        packed, scale = _int4_pack(x)
        return [(base + "weight_packed", "I32", packed), (base + "weight_scale", "BF16", scale),
                (base + "weight_shape", "I32", mx.array(list(x.shape), dtype=mx.int32))]
    dtype = "F32" if name.endswith("e_score_correction_bias") else "BF16"
    return [(name, dtype, x)]


_MX = {"BF16": mx.bfloat16, "F32": mx.float32, "I32": mx.int32, "U8": mx.uint8,
       "F8_E4M3": mx.uint8}


def _write_shard(path: Path, tensors: Iterable[Tuple[str, str, mx.array]]) -> int:
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, dtype, x in tensors:
        x = x.astype(_MX[dtype])
        raw = np.array(x.view(mx.uint16) if dtype == "BF16" else x).tobytes()
        header[name] = {"dtype": dtype, "shape": list(x.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for raw in blobs:
            f.write(raw)
    return offset


def _layer_of(name: str) -> int:
    # Shards follow the layers, as the releases' do: embeddings with layer 0, the
    # final norm and head (and anything outside the layers) with the last.
    m = re.match(r"(?:language_model\.)?model\.(?:language_model\.)?layers\.(\d+)\.", name)
    if m:
        return int(m.group(1))
    return 0 if "embed_tokens" in name else 1 << 30


def write_original(out, source: str, seed: int = 0) -> Path:
    """Write `source` (one of SOURCES) into `out` as its release lays it out."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {sorted(SOURCES)}, got {source!r}")
    make_config, release, tokenizer, fp8, int4 = SOURCES[source]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = _token_ids(out, tokenizer)
    config = make_config(**ids)
    if int4 is not None:
        config.setdefault("quantization_config", INT4_QUANTIZATION)
    elif fp8 is not None:
        config.setdefault("quantization_config", FP8_QUANTIZATION)
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(built_model(config, seed).parameters()))
    weights = release(weights, config)
    raw = {}
    if isinstance(weights, tuple):
        weights, raw = weights
    tensors = [t for name in sorted(weights) for t in _encode(name, weights[name], fp8, int4)]
    tensors += [(name, dtype, x) for name, (dtype, x) in sorted(raw.items())]

    layers = sorted({_layer_of(t[0]) for t in tensors})
    n = len(layers)
    names = {layer: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, layer in enumerate(layers)}
    weight_map, total = {}, 0
    for layer in layers:
        shard = [t for t in tensors if _layer_of(t[0]) == layer]
        total += _write_shard(out / names[layer], shard)
        weight_map.update((t[0], names[layer]) for t in shard)
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json",
                {**ids, "do_sample": False})
    return out


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
