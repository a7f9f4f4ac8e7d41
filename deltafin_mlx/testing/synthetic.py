"""Synthetic Hugging Face MoE checkpoints, written at test time.

`make_checkpoint` writes a directory laid out like a real release of one of
`ARCHITECTURES`: the release's config.json keys, its tensor names, dtypes and
shard naming, an index, and tokenizer files. The weights are random but
scaled so that activations stay O(1) and routing varies across tokens and
layers. The converter reads these as its input, and mlx-lm loading the same
directory is the oracle it is checked against, so every directory must load
with `mlx_lm.utils.load_model`.

Tensors are streamed to disk one at a time (in row chunks for big ones, by
`safetensors_writer`), so benchmarks can write checkpoints many GB in size in
bounded memory.
"""

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, List, Tuple

import numpy as np
from deltafin_mlx.testing.safetensors_writer import Tensor, normal, write_safetensors
from deltafin_mlx.testing.tokenizers import (
    KIMI_BOS,
    KIMI_END_OF_MSG,
    KIMI_EOS,
    KIMI_MEDIA_PAD,
    KIMI_PAD,
    KIMI_TOKENIZER_SIZE,
    write_bpe_tokenizer_files,
    write_kimi_tokenizer_files,
)

ARCHITECTURES = ("kimi_k3", "kimi_k2", "qwen3_moe", "mixtral")


@dataclass
class SyntheticConfig:
    """Dimensions of a synthetic checkpoint; `make_checkpoint` overrides
    name these fields. Fields an architecture has no use for are ignored."""

    hidden_size: int = 64
    num_layers: int = 4
    num_experts: int = 16
    experts_per_token: int = 4
    moe_intermediate_size: int = 32
    # Dense MLP width: Kimi's first `first_k_dense_replace` layers and
    # qwen3_moe's `mlp_only_layers`. Mixtral uses moe_intermediate_size.
    intermediate_size: int = 128
    vocab_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # qwen3_moe only; mixtral derives it from hidden_size
    mlp_only_layers: Tuple[int, ...] = ()  # qwen3_moe only
    # Multi-head latent attention (kimi_k2 and K3's full-attention layers)
    q_lora_rank: int = 48
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 24
    # Kimi MoE
    num_shared_experts: int = 1
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    # Kimi K3 only
    routed_expert_hidden_size: int = 64  # latent width the experts run in
    kda_num_heads: int = 2
    kda_head_dim: int = 32
    full_attn_every: int = 4  # every Nth layer (1-indexed) and the last is MLA
    attn_res_block_size: int = 2
    a_log_pad_to: int = 128  # A_log rounds heads up to this (release: 96 -> 128)
    # Spread of the Kimi routers' score-correction bias. Random weights route
    # almost uniformly; a larger spread makes a few experts popular, as trained
    # routers are (bench/studies/iobound.py uses it to get skewed routing).
    router_bias_std: float = 0.1


_DEFAULTS = {
    # hidden != latent != moe_intermediate so that a transposed or swapped
    # tensor fails on shape instead of passing silently.
    "kimi_k3": dict(
        hidden_size=128,
        moe_intermediate_size=96,
        intermediate_size=256,
        vocab_size=1024,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=64,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_shared_experts=2,
    ),
    "kimi_k2": dict(
        vocab_size=1024,
        num_attention_heads=2,
        num_key_value_heads=2,
        routed_scaling_factor=2.827,
    ),
    "qwen3_moe": dict(),
    "mixtral": dict(),
}


# --- initializers -----------------------------------------------------------


def _linear(name, out_dim, in_dim):
    # 1/sqrt(fan_in) keeps the output of a normalized input at O(1).
    return Tensor(name, (out_dim, in_dim), "BF16", normal(in_dim**-0.5))


def _norm(name, dim, dtype="BF16"):
    # Near 1 but not exactly, so a norm swapped with another one shows.
    return Tensor(name, (dim,), dtype, normal(0.1, mean=1.0))


def _glu(prefix, hidden, inner, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    return [
        _linear(f"{prefix}.{gate}.weight", inner, hidden),
        _linear(f"{prefix}.{up}.weight", inner, hidden),
        _linear(f"{prefix}.{down}.weight", hidden, inner),
    ]


def _embedding(name, vocab, hidden):
    # Unit variance so that the first RMSNorm sees O(1) inputs.
    return Tensor(name, (vocab, hidden), "BF16", normal(1.0))


def _router_bias(name, n, std=0.1):
    # Small against the sigmoid scores (~0.2 spread) by default, so it shifts
    # selection without pinning every token to the same experts.
    return Tensor(name, (n,), "F32", normal(std))


# MXFP4: E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; uniformly random codes
# have this RMS.
_E2M1_RMS = math.sqrt((0 + 0.25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8)


def _mxfp4(name, out_dim, in_dim):
    """Packed codes and E8M0 scales of one MXFP4 expert matrix."""

    def packed(rng, shape, dtype):
        # Random bytes are random code pairs: cheap for GB-sized benchmarks.
        return rng.integers(0, 256, size=shape, dtype=np.uint8)

    # Pick the exponent that gives the weights RMS ~ 1/sqrt(fan_in), then
    # jitter it by +-1 per group so the scales are not all equal.
    exponent = round(math.log2(in_dim**-0.5 / _E2M1_RMS))

    def scale(rng, shape, dtype):
        jitter = rng.integers(-1, 2, size=shape)
        return (exponent + 127 + jitter).astype(np.uint8)

    return [
        Tensor(f"{name}.weight_packed", (out_dim, in_dim // 2), "U8", packed),
        Tensor(f"{name}.weight_scale", (out_dim, in_dim // 32), "U8", scale),
    ]


# --- kimi_k3 ----------------------------------------------------------------


def _k3_full_attn_layers(c: SyntheticConfig) -> List[int]:
    # 1-indexed, as in the release: every 4th layer and the last one.
    n = c.num_layers
    return [i for i in range(1, n + 1) if i % c.full_attn_every == 0 or i == n]


def _k3_config(c: SyntheticConfig) -> dict:
    full = _k3_full_attn_layers(c)
    kda = [i for i in range(1, c.num_layers + 1) if i not in full]
    ids = dict(
        bos_token_id=KIMI_BOS, eos_token_id=KIMI_END_OF_MSG, pad_token_id=KIMI_PAD
    )
    # Every key of the release's config.json, in its order; only sizes and
    # token ids are scaled down.
    text_config = {
        "_name_or_path": "",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "add_cross_attention": False,
        "architectures": ["KimiLinearForCausalLM"],
        "attn_res_block_size": c.attn_res_block_size,
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
            "AutoModel": "modeling_kimi_linear.KimiLinearModel",
            "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM",
        },
        "bad_words_ids": None,
        "begin_suppress_tokens": None,
        "bos_token_id": ids["bos_token_id"],
        "chunk_size_feed_forward": 0,
        "cross_attention_hidden_size": None,
        "decoder_start_token_id": None,
        "diversity_penalty": 0.0,
        "do_sample": False,
        "dtype": "bfloat16",
        "early_stopping": False,
        "encoder_no_repeat_ngram_size": 0,
        "eos_token_id": ids["eos_token_id"],
        "exponential_decay_length_penalty": None,
        "finetuning_task": None,
        "first_k_dense_replace": c.first_k_dense_replace,
        "forced_bos_token_id": None,
        "forced_eos_token_id": None,
        "hidden_act": "situ",
        "hidden_size": c.hidden_size,
        "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
        "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size,
        "is_decoder": False,
        "is_encoder_decoder": False,
        "kv_lora_rank": c.kv_lora_rank,
        "label2id": {"LABEL_0": 0, "LABEL_1": 1},
        "latent_moe_use_norm": True,
        "length_penalty": 1.0,
        "linear_attn_config": {
            "full_attn_layers": full,
            "gate_lower_bound": -5.0,
            "head_dim": c.kda_head_dim,
            "kda_layers": kda,
            "num_heads": c.kda_num_heads,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
        },
        "max_length": 20,
        "max_position_embeddings": 1048576,
        "min_length": 0,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "model_type": "kimi_linear",
        "moe_intermediate_size": c.moe_intermediate_size,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "no_repeat_ngram_size": 0,
        "num_attention_heads": c.num_attention_heads,
        "num_beam_groups": 1,
        "num_beams": 1,
        "num_expert_group": c.num_expert_group,
        "num_experts": c.num_experts,
        "num_experts_per_token": c.experts_per_token,
        "num_hidden_layers": c.num_layers,
        "num_key_value_heads": c.num_attention_heads,
        "num_nextn_predict_layers": 0,
        "num_return_sequences": 1,
        "num_shared_experts": c.num_shared_experts,
        "output_attentions": False,
        "output_hidden_states": False,
        "output_scores": False,
        "pad_token_id": ids["pad_token_id"],
        "prefix": None,
        "problem_type": None,
        "pruned_heads": {},
        "q_lora_rank": c.q_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "quantization_config": {
            "config_groups": {
                "group_0": {
                    "format": "mxfp4-pack-quantized",
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
                        "scale_dtype": "torch.uint8",
                        "strategy": "group",
                        "symmetric": True,
                        "type": "float",
                        "zp_dtype": None,
                    },
                }
            },
            "format": "mxfp4-pack-quantized",
            "global_compression_ratio": None,
            "ignore": [
                "re:.*self_attn.*",
                "re:.*shared_experts.*",
                "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                "re:.*lm_head.*",
                "re:.*vision_tower.*",
                "re:.*mm_projector.*",
            ],
            "kv_cache_scheme": None,
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
        },
        "remove_invalid_values": False,
        "repetition_penalty": 1.0,
        "return_dict": True,
        "return_dict_in_generate": False,
        "rms_norm_eps": 1e-05,
        "routed_expert_hidden_size": c.routed_expert_hidden_size,
        "routed_scaling_factor": c.routed_scaling_factor,
        "sep_token_id": None,
        "suppress_tokens": None,
        "task_specific_params": None,
        "temperature": 1.0,
        "tf_legacy_loss": False,
        "tie_encoder_decoder": False,
        "tie_word_embeddings": False,
        "tokenizer_class": None,
        "top_k": 50,
        "top_p": 1.0,
        "topk_group": c.topk_group,
        "topk_method": "noaux_tc",
        "torchscript": False,
        "transformers_version": "4.56.2",
        "typical_p": 1.0,
        "use_bfloat16": False,
        "use_cache": True,
        "use_grouped_topk": True,
        "v_head_dim": c.v_head_dim,
        "vocab_size": c.vocab_size,
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
        },
        "bos_token_id": ids["bos_token_id"],
        "dtype": "bfloat16",
        "eos_token_id": ids["eos_token_id"],
        "ignore_index": -100,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "media_placeholder_token_id": KIMI_MEDIA_PAD,
        "model_type": "kimi_k3",
        "pad_token_id": ids["pad_token_id"],
        "text_config": text_config,
        "tie_word_embeddings": False,
        "vision_config": _k3_vision_config(c),
    }


# The vision tower is not run by anyone here: converters must skip it. Its
# config keeps the release's keys with small sizes matching the tensors below.
_K3_VT_HIDDEN = 32
_K3_MM_HIDDEN = 32


def _k3_vision_config(c: SyntheticConfig) -> dict:
    return {
        "_attn_implementation": "flash_attention_2",
        "activation_func": "gelu_pytorch_tanh",
        "attn_bias": False,
        "init_pos_emb_height": 4,
        "init_pos_emb_time": 4,
        "init_pos_emb_width": 4,
        "linear_bias": False,
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mlp_type": "mlp2",
        "mm_hidden_size": _K3_MM_HIDDEN,
        "mm_projector_type": "patchmergerv2",
        "norm_type": "rmsnorm",
        "patch_embed_proj_bias": False,
        "patch_size": 14,
        "pos_emb_interpolation_mode": "bilinear",
        "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        "qkv_hidden_size": 3 * _K3_VT_HIDDEN,
        "text_hidden_size": c.hidden_size,
        "vt_hidden_size": _K3_VT_HIDDEN,
        "vt_intermediate_size": 4 * _K3_VT_HIDDEN,
        "vt_num_attention_heads": 2,
        "vt_num_hidden_layers": 1,
    }


def _k3_kda(p: str, c: SyntheticConfig) -> List[Tensor]:
    heads, hd, h = c.kda_num_heads, c.kda_head_dim, c.hidden_size
    proj = heads * hd
    padded = -(-heads // c.a_log_pad_to) * c.a_log_pad_to

    def a_log(rng, shape, dtype):
        # Decay rates in [1, 16], zero past the real heads as in the release.
        out = np.zeros(shape, np.float32)
        out[:heads] = np.log(rng.uniform(1.0, 16.0, size=heads))
        return out

    def conv(rng, shape, dtype):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.5)

    tensors = [_linear(f"{p}.{x}_proj.weight", proj, h) for x in "qkv"]
    tensors += [
        Tensor(f"{p}.{x}_conv1d.weight", (proj, 1, 4), "F32", conv) for x in "qkv"
    ]
    tensors += [
        _linear(f"{p}.f_a_proj.weight", hd, h),
        _linear(f"{p}.f_b_proj.weight", proj, hd),
        _linear(f"{p}.b_proj.weight", heads, h),
        Tensor(f"{p}.A_log", (padded,), "F32", a_log),
        Tensor(f"{p}.dt_bias", (proj,), "F32", normal(0.5)),
        _norm(f"{p}.o_norm.weight", hd, dtype="F32"),
    ]
    return tensors


def _mla(p: str, c: SyntheticConfig) -> List[Tensor]:
    heads, h = c.num_attention_heads, c.hidden_size
    return [
        _linear(f"{p}.q_a_proj.weight", c.q_lora_rank, h),
        _norm(f"{p}.q_a_layernorm.weight", c.q_lora_rank),
        _linear(
            f"{p}.q_b_proj.weight",
            heads * (c.qk_nope_head_dim + c.qk_rope_head_dim),
            c.q_lora_rank,
        ),
        _linear(
            f"{p}.kv_a_proj_with_mqa.weight", c.kv_lora_rank + c.qk_rope_head_dim, h
        ),
        _norm(f"{p}.kv_a_layernorm.weight", c.kv_lora_rank),
        _linear(
            f"{p}.kv_b_proj.weight",
            heads * (c.qk_nope_head_dim + c.v_head_dim),
            c.kv_lora_rank,
        ),
    ]


def _k3_layer(layer: int, c: SyntheticConfig) -> List[Tensor]:
    p = f"language_model.model.layers.{layer}"
    h = c.hidden_size
    is_kda = (layer + 1) not in _k3_full_attn_layers(c)
    attn_width = (
        c.kda_num_heads * c.kda_head_dim
        if is_kda
        else c.num_attention_heads * c.v_head_dim
    )
    tensors = [
        _norm(f"{p}.input_layernorm.weight", h),
        _norm(f"{p}.post_attention_layernorm.weight", h),
        _norm(f"{p}.self_attention_res_norm.weight", h),
        _linear(f"{p}.self_attention_res_proj.weight", 1, h),
        _norm(f"{p}.mlp_res_norm.weight", h),
        _linear(f"{p}.mlp_res_proj.weight", 1, h),
    ]
    a = f"{p}.self_attn"
    tensors += _k3_kda(a, c) if is_kda else _mla(a, c)
    tensors += [
        _linear(f"{a}.g_proj.weight", attn_width, h),
        _linear(f"{a}.o_proj.weight", h, attn_width),
    ]
    if layer < c.first_k_dense_replace:
        return tensors + _glu(f"{p}.mlp", h, c.intermediate_size)

    m = f"{p}.block_sparse_moe"
    latent, inner = c.routed_expert_hidden_size, c.moe_intermediate_size
    tensors += [
        _linear(f"{m}.gate.weight", c.num_experts, h),
        _router_bias(f"{m}.gate.e_score_correction_bias", c.num_experts, c.router_bias_std),
        _linear(f"{m}.routed_expert_down_proj.weight", latent, h),
        _linear(f"{m}.routed_expert_up_proj.weight", h, latent),
        _norm(f"{m}.routed_expert_norm.weight", latent),
    ]
    tensors += _glu(f"{m}.shared_experts", h, inner * c.num_shared_experts)
    for e in range(c.num_experts):
        tensors += _mxfp4(f"{m}.experts.{e}.w1", inner, latent)  # gate
        tensors += _mxfp4(f"{m}.experts.{e}.w2", latent, inner)  # down
        tensors += _mxfp4(f"{m}.experts.{e}.w3", inner, latent)  # up
    return tensors


def _k3_shards(c: SyntheticConfig) -> Iterator[List[Tensor]]:
    # As in the release: layer L in shard L+1, then the embeddings, head and
    # output attention residual, then the projector, then the vision tower.
    h, v = c.hidden_size, c.vocab_size
    for i in range(c.num_layers):
        yield _k3_layer(i, c)
    yield [
        _embedding("language_model.model.embed_tokens.weight", v, h),
        _linear("language_model.lm_head.weight", v, h),
        _norm("language_model.model.norm.weight", h),
        _norm("language_model.model.output_attn_res_norm.weight", h),
        _linear("language_model.model.output_attn_res_proj.weight", 1, h),
    ]
    vt, merged = _K3_VT_HIDDEN, 4 * _K3_VT_HIDDEN  # 2x2 patch merge
    yield [
        _norm("mm_projector.pre_norm.weight", vt),
        _linear("mm_projector.proj.0.weight", merged, merged),
        _linear("mm_projector.proj.2.weight", h, merged),
    ]
    blk = "vision_tower.encoder.blocks.0"
    yield [
        Tensor(
            "vision_tower.patch_embed.proj.weight",
            (vt, 3, 14, 14),
            "BF16",
            normal(588**-0.5),
        ),
        _norm(f"{blk}.norm0.weight", vt),
        _linear(f"{blk}.wqkv.weight", 3 * vt, vt),
        _linear(f"{blk}.wo.weight", vt, vt),
        _norm(f"{blk}.norm1.weight", vt),
        _linear(f"{blk}.mlp.fc0.weight", 4 * vt, vt),
        _linear(f"{blk}.mlp.fc1.weight", vt, 4 * vt),
        _norm("vision_tower.encoder.final_layernorm.weight", vt),
    ]


# --- kimi_k2 (DeepSeek-V3 layout) ---------------------------------------------


def _k2_config(c: SyntheticConfig) -> dict:
    # Kimi-K2-Instruct's config.json keys, less its fp8 quantization_config:
    # these fixtures are bf16.
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
        "bos_token_id": KIMI_BOS,
        "eos_token_id": KIMI_EOS,
        "first_k_dense_replace": c.first_k_dense_replace,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size,
        "kv_lora_rank": c.kv_lora_rank,
        "max_position_embeddings": 131072,
        "model_type": "kimi_k2",
        "moe_intermediate_size": c.moe_intermediate_size,
        "moe_layer_freq": 1,
        "n_group": c.num_expert_group,
        "n_routed_experts": c.num_experts,
        "n_shared_experts": c.num_shared_experts,
        "norm_topk_prob": True,
        "num_attention_heads": c.num_attention_heads,
        "num_experts_per_tok": c.experts_per_token,
        "num_hidden_layers": c.num_layers,
        "num_key_value_heads": c.num_attention_heads,
        "num_nextn_predict_layers": 0,
        "pretraining_tp": 1,
        "q_lora_rank": c.q_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "rms_norm_eps": 1e-06,
        "rope_theta": 50000.0,
        "routed_scaling_factor": c.routed_scaling_factor,
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": c.topk_group,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.48.3",
        "use_cache": True,
        "v_head_dim": c.v_head_dim,
        "vocab_size": c.vocab_size,
    }


def _k2_layer(layer: int, c: SyntheticConfig) -> List[Tensor]:
    p = f"model.layers.{layer}"
    h = c.hidden_size
    rope = c.qk_rope_head_dim

    def inv_freq(rng, shape, dtype):
        return 50000.0 ** (-np.arange(0, rope, 2, dtype=np.float32) / rope)

    tensors = [
        _norm(f"{p}.input_layernorm.weight", h),
        _norm(f"{p}.post_attention_layernorm.weight", h),
    ]
    tensors += _mla(f"{p}.self_attn", c)
    tensors += [
        _linear(
            f"{p}.self_attn.o_proj.weight", h, c.num_attention_heads * c.v_head_dim
        ),
        # The release carries each layer's rotary buffer; loaders drop it.
        Tensor(f"{p}.self_attn.rotary_emb.inv_freq", (rope // 2,), "BF16", inv_freq),
    ]
    if layer < c.first_k_dense_replace:
        return tensors + _glu(f"{p}.mlp", h, c.intermediate_size)
    tensors += [
        _linear(f"{p}.mlp.gate.weight", c.num_experts, h),
        _router_bias(f"{p}.mlp.gate.e_score_correction_bias", c.num_experts, c.router_bias_std),
    ]
    tensors += _glu(
        f"{p}.mlp.shared_experts", h, c.moe_intermediate_size * c.num_shared_experts
    )
    for e in range(c.num_experts):
        tensors += _glu(f"{p}.mlp.experts.{e}", h, c.moe_intermediate_size)
    return tensors


# --- qwen3_moe and mixtral ---------------------------------------------------


def _qwen3_moe_config(c: SyntheticConfig, bos: int, eos: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "decoder_sparse_step": 1,
        "eos_token_id": eos,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": 40960,
        "max_window_layers": c.num_layers,
        "mlp_only_layers": list(c.mlp_only_layers),
        "model_type": "qwen3_moe",
        "moe_intermediate_size": c.moe_intermediate_size,
        "norm_topk_prob": True,
        "num_attention_heads": c.num_attention_heads,
        "num_experts": c.num_experts,
        "num_experts_per_tok": c.experts_per_token,
        "num_hidden_layers": c.num_layers,
        "num_key_value_heads": c.num_key_value_heads,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": c.vocab_size,
    }


def _qwen3_moe_layer(layer: int, c: SyntheticConfig) -> List[Tensor]:
    p = f"model.layers.{layer}"
    h, hd = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    tensors = [
        _norm(f"{p}.input_layernorm.weight", h),
        _norm(f"{p}.post_attention_layernorm.weight", h),
        _linear(f"{p}.self_attn.q_proj.weight", q, h),
        _linear(f"{p}.self_attn.k_proj.weight", kv, h),
        _linear(f"{p}.self_attn.v_proj.weight", kv, h),
        _linear(f"{p}.self_attn.o_proj.weight", h, q),
        _norm(f"{p}.self_attn.q_norm.weight", hd),
        _norm(f"{p}.self_attn.k_norm.weight", hd),
    ]
    if layer in c.mlp_only_layers:
        return tensors + _glu(f"{p}.mlp", h, c.intermediate_size)
    tensors.append(_linear(f"{p}.mlp.gate.weight", c.num_experts, h))
    for e in range(c.num_experts):
        tensors += _glu(f"{p}.mlp.experts.{e}", h, c.moe_intermediate_size)
    return tensors


def _mixtral_config(c: SyntheticConfig, bos: int, eos: int) -> dict:
    return {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": c.moe_intermediate_size,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": c.num_attention_heads,
        "num_experts_per_tok": c.experts_per_token,
        "num_hidden_layers": c.num_layers,
        "num_key_value_heads": c.num_key_value_heads,
        "num_local_experts": c.num_experts,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "vocab_size": c.vocab_size,
    }


def _mixtral_layer(layer: int, c: SyntheticConfig) -> List[Tensor]:
    p = f"model.layers.{layer}"
    h = c.hidden_size
    hd = h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    m = f"{p}.block_sparse_moe"
    tensors = [
        _norm(f"{p}.input_layernorm.weight", h),
        _norm(f"{p}.post_attention_layernorm.weight", h),
        _linear(f"{p}.self_attn.q_proj.weight", q, h),
        _linear(f"{p}.self_attn.k_proj.weight", kv, h),
        _linear(f"{p}.self_attn.v_proj.weight", kv, h),
        _linear(f"{p}.self_attn.o_proj.weight", h, q),
        _linear(f"{m}.gate.weight", c.num_experts, h),
    ]
    for e in range(c.num_experts):
        tensors += _glu(
            f"{m}.experts.{e}", h, c.moe_intermediate_size, names=("w1", "w3", "w2")
        )
    return tensors


def _layered_shards(layer_fn, c: SyntheticConfig) -> Iterator[List[Tensor]]:
    # Like Kimi K2's release (and most size-split HF exports): the embedding
    # rides in the first shard, the final norm and head in the last.
    for i in range(c.num_layers):
        tensors = layer_fn(i, c)
        if i == 0:
            embed = _embedding("model.embed_tokens.weight", c.vocab_size, c.hidden_size)
            tensors.insert(0, embed)
        if i == c.num_layers - 1:
            tensors += [
                _norm("model.norm.weight", c.hidden_size),
                _linear("lm_head.weight", c.vocab_size, c.hidden_size),
            ]
        yield tensors


def _num_shards(arch: str, c: SyntheticConfig) -> int:
    return c.num_layers + 3 if arch == "kimi_k3" else c.num_layers


def _shards(arch: str, c: SyntheticConfig) -> Iterator[List[Tensor]]:
    """The tensors of each shard, one shard at a time: a real-sized K3 layer
    alone is ~2,700 tensors."""
    if arch == "kimi_k3":
        return _k3_shards(c)
    layer_fn = {
        "kimi_k2": _k2_layer,
        "qwen3_moe": _qwen3_moe_layer,
        "mixtral": _mixtral_layer,
    }[arch]
    return _layered_shards(layer_fn, c)


def _shard_name(arch: str, i: int, n: int) -> str:
    if arch == "kimi_k3":
        return f"model-{i:05d}-of-{n:06d}.safetensors"
    if arch == "kimi_k2":
        return f"model-{i}-of-{n}.safetensors"
    return f"model-{i:05d}-of-{n:05d}.safetensors"


# --- entry points ---------------------------------------------------------------


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _resolve(arch: str, overrides: dict) -> SyntheticConfig:
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {ARCHITECTURES}, got {arch!r}")
    c = replace(SyntheticConfig(**_DEFAULTS[arch]), **overrides)
    c.mlp_only_layers = tuple(c.mlp_only_layers)
    if not 0 < c.experts_per_token <= c.num_experts:
        raise ValueError("need 0 < experts_per_token <= num_experts")
    if arch in ("kimi_k3", "kimi_k2"):
        if not 0 <= c.first_k_dense_replace < c.num_layers:
            raise ValueError("kimi needs at least one MoE layer after the dense ones")
        if c.vocab_size < KIMI_TOKENIZER_SIZE:
            raise ValueError(f"kimi vocab_size must be >= {KIMI_TOKENIZER_SIZE}")
    if arch == "kimi_k3":
        # MXFP4 packs 32 inputs per scale: both expert input widths.
        for name in ("routed_expert_hidden_size", "moe_intermediate_size"):
            if getattr(c, name) % 32:
                raise ValueError(f"kimi_k3 {name} must be a multiple of 32")
    if arch == "kimi_k2" and c.num_layers > 61:
        # mlx-lm's deepseek_v3 sanitize drops model.layers.61 (K2's MTP slot).
        raise ValueError("kimi_k2 checkpoints load in mlx-lm with at most 61 layers")
    if arch == "mixtral" and c.hidden_size % c.num_attention_heads:
        raise ValueError("mixtral hidden_size must divide by num_attention_heads")
    return c


def checkpoint_size(arch: str = "kimi_k3", **overrides) -> int:
    """Bytes of tensor data `make_checkpoint` would write (the index's
    total_size), without writing anything."""
    c = _resolve(arch, overrides)
    return sum(t.nbytes for shard in _shards(arch, c) for t in shard)


def make_checkpoint(
    out_dir, arch: str = "kimi_k3", *, seed: int = 0, **overrides
) -> Path:
    """Write a synthetic `arch` checkpoint into `out_dir` and return its path.

    `overrides` are `SyntheticConfig` fields (hidden_size, num_layers,
    num_experts, experts_per_token, moe_intermediate_size, vocab_size,
    routed_expert_hidden_size, ...). Weights are deterministic in `seed`.
    """
    c = _resolve(arch, overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = _num_shards(arch, c)
    names = [_shard_name(arch, i + 1, n) for i in range(n)]
    stale = {p.name for p in out.glob("model*.safetensors")} - set(names)
    if stale:
        # mlx-lm globs model*.safetensors: leftovers would be loaded too.
        raise FileExistsError(f"{out} holds other shards: {sorted(stale)}")

    # Tokenizer first: its size bounds vocab_size before GBs get written.
    if arch in ("kimi_k3", "kimi_k2"):
        n_tokens = write_kimi_tokenizer_files(out, "k3" if arch == "kimi_k3" else "k2")
        bos = KIMI_BOS
        eos = KIMI_END_OF_MSG if arch == "kimi_k3" else KIMI_EOS
    else:
        n_tokens, ids = write_bpe_tokenizer_files(out, arch)
        if arch == "qwen3_moe":
            bos, eos = ids["<|endoftext|>"], ids["<|im_end|>"]
        else:
            bos, eos = ids["<s>"], ids["</s>"]
    if c.vocab_size < n_tokens:
        raise ValueError(f"vocab_size {c.vocab_size} < tokenizer's {n_tokens} tokens")

    if arch == "kimi_k3":
        config = _k3_config(c)
    elif arch == "kimi_k2":
        config = _k2_config(c)
    elif arch == "qwen3_moe":
        config = _qwen3_moe_config(c, bos, eos)
    else:
        config = _mixtral_config(c, bos, eos)
    _write_json(out / "config.json", config)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False},
    )

    # K3's shards carry no __metadata__; torch exports write {"format": "pt"}.
    metadata = None if arch == "kimi_k3" else {"format": "pt"}
    weight_map, total_size = {}, 0
    for name, tensors in zip(names, _shards(arch, c), strict=True):
        total_size += write_safetensors(out / name, tensors, seed, metadata)
        weight_map.update((t.name, name) for t in tensors)
    _write_json(
        out / "model.safetensors.index.json",
        {
            "metadata": {"total_size": total_size},
            "weight_map": dict(sorted(weight_map.items())),
        },
    )
    return out
