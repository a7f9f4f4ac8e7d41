"""A tiny random model of every MoE type the installed mlx-lm runs, saved in mlx-lm's
own format (what `mlx_lm.convert` writes: float, or 4-bit affine).

`moe_types()` enumerates mlx-lm's `models/` folder: a model type is an MoE type when
its module, or a module of mlx-lm's it builds on, imports `switch_layers` (the home
of SwitchGLU/SwitchMLP). MODEL_REMAPPING's aliases (kimi_k2 -> deepseek_v3) are
types of their own, looked up as mlx-lm looks them up. `config` gives one small
config.json per type, carrying only the keys mlx-lm's classes of that type declare
(as the family's published config.json names them: ERNIE's `moe_k`, Step's
`moe_top_k`), never every family's name for a number at once; `build` makes the model with mlx-lm's own class and random
weights in which the experts decide the tokens: every parameter mlx-lm initialises
to a constant (routers, score-correction and expert biases, sinks, norms) gets
random values, so routing varies across tokens, and expert weights are scaled up.
"""

import ast
import json
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten

NUM_EXPERTS = 16
_SWITCH_MODULE = "switch_layers"


def _models_dir() -> Path:
    import mlx_lm.models

    return Path(mlx_lm.models.__file__).parent


@lru_cache(maxsize=1)
def _imports() -> Dict[str, set]:
    """Each module of mlx_lm/models and the sibling modules it imports."""
    out = {}
    for path in _models_dir().glob("*.py"):
        tree = ast.parse(path.read_text())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(a.name for a in node.names)
        out[path.stem] = deps
    return out


def _builds_on_switch_layers(module: str, seen=None) -> bool:
    seen = seen if seen is not None else set()
    if module in seen:
        return False
    seen.add(module)
    deps = _imports().get(module, set())
    return _SWITCH_MODULE in deps or any(_builds_on_switch_layers(d, seen) for d in deps)


def _has_model_class(module: str) -> bool:
    tree = ast.parse((_models_dir() / f"{module}.py").read_text())
    return any(isinstance(n, ast.ClassDef) and n.name == "Model" for n in tree.body)


def moe_types() -> List[str]:
    """Every model type of the installed mlx-lm whose model can hold switch modules."""
    from mlx_lm.utils import MODEL_REMAPPING

    files = {m for m in _imports() if m != _SWITCH_MODULE and _has_model_class(m)
             and _builds_on_switch_layers(m)}
    aliases = {alias for alias, target in MODEL_REMAPPING.items() if target in files}
    return sorted(files | aliases)


# --- configs -------------------------------------------------------------------

def _base(vocab: int) -> dict:
    """Keys most mlx-lm classes share, under each of their usual names (`config`
    keeps the ones the type declares)."""
    return {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "layer_norm_eps": 1e-6,
        "norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "num_experts": NUM_EXPERTS,
        "num_local_experts": NUM_EXPERTS,
        "num_vocab": vocab,
        "n_routed_experts": NUM_EXPERTS,
        "moe_num_experts": NUM_EXPERTS,
        "num_experts_per_tok": 2,
        "moe_topk": 2,
        "moe_k": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "n_shared_experts": 1,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "torch_dtype": "bfloat16",
    }


# Per type: what the shared keys do not cover. A "text_config" is the model's
# language model (the wrapper's other parts are vision towers mlx-lm drops).
_MLA_V32 = {"q_lora_rank": 32, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 4,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "attention_bias": False}
_LINEAR_ATTENTION = {"linear_num_value_heads": 4, "linear_num_key_heads": 2,
                     "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                     "linear_conv_kernel_dim": 3, "full_attention_interval": 2,
                     "partial_rotary_factor": 0.5}
_MINIMAX = {"shared_intermediate_size": 64, "rotary_dim": 8, "use_qk_norm": True}
_MISTRAL4 = {"model_type": "mistral4", "q_lora_rank": 32,
             "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default",
                                 "llama_4_scaling_beta": 0.1,
                                 "original_max_position_embeddings": 4096}}
_LONGCAT = {"attention_method": "MLA", "zero_expert_type": "identity", "ffn_hidden_size": 128,
            "moe_topk": 2, "expert_ffn_hidden_size": 64, "zero_expert_num": 2, "num_layers": 2,
            "q_lora_rank": 32, "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
            "attention_bias": False}
_GEMMA4 = {"model_type": "gemma4_text", "enable_moe_block": True, "top_k_experts": 2,
           "global_head_dim": 32, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 16,
           "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
           "final_logit_softcapping": 30.0}
_QWEN3_MOE = {"model_type": "qwen3_moe"}

OVERRIDES: Dict[str, dict] = {
    "Klear": {"attention_bias": False},
    "afmoe": {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 8,
              "num_dense_layers": 0, "num_shared_experts": 1},
    "bailing_moe": {"num_shared_experts": 1},
    "bailing_moe_linear": {"num_shared_experts": 1, "layer_group_size": 2,
                           "group_norm_size": 1},
    "bailing_hybrid": {"num_shared_experts": 1, "layer_group_size": 2, "group_norm_size": 1},
    "deepseek_v2": {"rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
                                     "mscale": 1.0, "mscale_all_dim": 1.0,
                                     "original_max_position_embeddings": 4096,
                                     "type": "yarn"}},
    "deepseek_v32": _MLA_V32,
    "glm_moe_dsa": {**_MLA_V32, "rope_parameters": {"rope_theta": 10000.0,
                                                     "rope_type": "default"}},
    "deepseek_v41": {"q_lora_rank": 32, "head_dim": 32, "o_groups": 2, "o_lora_rank": 32,
                     "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
                     "hc_mult": 2, "sliding_window": 8},
    "deepseek_v41_text": {"q_lora_rank": 32, "head_dim": 32, "o_groups": 2,
                          "o_lora_rank": 32, "index_n_heads": 2, "index_head_dim": 16,
                          "index_topk": 4, "hc_mult": 2, "sliding_window": 8},
    "ernie4_5_moe": {"use_bias": False},
    "exaone_moe": {"num_shared_experts": 1, "sliding_window": 8,
                   "layer_types": ["sliding_attention", "full_attention"],
                   "is_moe_layer": [True, True]},
    "gemma4": {"text_config": _GEMMA4},
    "gemma4_unified": {"text_config": _GEMMA4},
    "gemma4_text": {k: v for k, v in _GEMMA4.items() if k != "model_type"},
    "glm4_moe": {"rope_scaling": None, "use_qk_norm": True, "attention_bias": False,
                 "partial_rotary_factor": 0.5},
    "granitemoe": {"logits_scaling": 1.0, "attention_multiplier": 0.25,
                   "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                   "attention_bias": False},
    "granitemoehybrid": {"logits_scaling": 1.0, "attention_multiplier": 0.25,
                         "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                         "attention_bias": False, "layer_types": ["mamba", "attention"],
                         "shared_intermediate_size": 64, "mamba_n_heads": 4,
                         "mamba_d_head": 16, "mamba_proj_bias": False, "mamba_d_state": 16,
                         "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_conv_bias": False,
                         # transformers' config (the tokenizer loads it) checks that the
                         # heads fill mamba_expand * hidden_size (its default expand: 2)
                         "mamba_expand": 1},
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
                "attention_bias": False, "num_shared_expert": 1, "use_mixed_mlp_moe": True,
                "use_qk_norm": True, "use_cla": False, "cla_share_factor": 1},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 0,
              "expert_layer_period": 1, "mamba_d_conv": 4, "mamba_d_state": 16,
              "mamba_expand": 2},
    "kimi_k25": {"text_config": {"model_type": "kimi_k2"}},
    "kimi_vl": {"text_config": {"model_type": "deepseek_v3"}},
    "kimi_linear": {"linear_attn_config": {"num_heads": 4, "head_dim": 16, "kda_layers": [1]},
                    "model_max_length": 4096, "num_experts_per_token": 2,
                    "num_shared_experts": 1},
    "lfm2_moe": {"use_expert_bias": True, "num_dense_layers": 0, "conv_bias": False,
                 "conv_L_cache": 3, "layer_types": ["conv", "full_attention"]},
    "llama4": {"text_config": {"model_type": "llama4", "attention_chunk_size": 8,
                               "num_experts_per_tok": 1,  # mlx-lm runs top-1 only
                               "num_hidden_layers": 4,  # its masks index layer 3
                               "interleave_moe_layer_step": 1, "intermediate_size_mlp": 128,
                               "use_qk_norm": True, "attention_bias": False,
                               "rope_scaling": None}},
    "llava": {"text_config": _MISTRAL4},
    "mistral3": {"text_config": _MISTRAL4},
    "mistral4": {k: v for k, v in _MISTRAL4.items() if k != "model_type"},
    "longcat_flash": _LONGCAT,
    "longcat_flash_ngram": {**_LONGCAT, "ngram_vocab_size_ratio": 2},
    "mellum": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
               "rope_parameters": {"sliding_attention": {"rope_theta": 10000.0},
                                   "full_attention": {"rope_theta": 100000.0}}},
    "kimi_k3": {"text_config": {
        "model_type": "kimi_linear", "num_hidden_layers": 3, "attn_res_block_size": 2,
        "linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 2], "num_heads": 4,
                               "head_dim": 16, "short_conv_kernel_size": 4,
                               "use_full_rank_gate": True, "gate_lower_bound": -5.0},
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "latent_moe_use_norm": True, "routed_expert_hidden_size": 64, "mla_use_nope": True,
        "mla_use_output_gate": True, "num_experts_per_token": 2, "num_shared_experts": 1,
        "num_expert_group": 1, "q_lora_rank": 32, "moe_router_activation_func": "sigmoid",
        "model_max_length": 4096}},
    "minimax_m3_vl": {"text_config": {"num_local_experts": NUM_EXPERTS,
                                      "dense_intermediate_size": 128,
                                      "intermediate_size": 64, "rotary_dim": 8,
                                      "moe_layer_freq": [1, 1]}},
    "muse_spark": {"text_config": {"post_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0},
                                   "layer_rope_theta": [10000.0, 0.0],
                                   "layer_types": ["sliding_attention", "full_attention"],
                                   "sliding_window": 8, "final_logit_softcapping": 30.0,
                                   "output_multiplier": 1.0, "moe_hidden_size": 32,
                                   "mlp_layer_types": ["sparse", "sparse"]}},
    "mimo_v2_flash": {"hybrid_layer_pattern": [0, 1], "moe_layer_freq": [1, 1],
                      "add_swa_attention_sink_bias": True,
                      "add_full_attention_sink_bias": False, "sliding_window_size": 8,
                      "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                      "layernorm_epsilon": 1e-5, "swa_rope_theta": 10000.0,
                      "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
                      "v_head_dim": 16, "swa_head_dim": 16, "swa_v_head_dim": 16,
                      "partial_rotary_factor": 0.5},
    "minimax": _MINIMAX,
    "minimax_m2": _MINIMAX,
    "nemotron_h": {"num_hidden_layers": 4, "attention_bias": False, "mamba_num_heads": 4,
                   "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 16,
                   "conv_kernel": 3, "n_groups": 1, "mlp_bias": False,
                   "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
                   "hybrid_override_pattern": ["M", "E", "*", "E"],
                   "moe_shared_expert_intermediate_size": 64},
    "phi-msft": {"model_dim": 64, "num_heads": 4, "num_layers": 2, "rotary_dim": 8},
    "phixtral": {"model_dim": 64, "num_heads": 4, "num_layers": 2, "rotary_dim": 8},
    "qwen3_5": _LINEAR_ATTENTION,
    "qwen3_5_moe": _LINEAR_ATTENTION,
    "qwen3_next": _LINEAR_ATTENTION,
    "qwen3_vl_moe": {"text_config": _QWEN3_MOE},
    "step3p5": {"num_attention_groups": 2, "moe_num_experts": NUM_EXPERTS, "moe_top_k": 2,
                "share_expert_dim": 64, "sliding_window": 8,
                "layer_types": ["full_attention", "sliding_attention"]},
}


# Keys transformers writes into every config.json, whatever the type's ModelArgs reads.
COMMON_KEYS = frozenset({"model_type", "torch_dtype", "vocab_size", "max_position_embeddings",
                         "tie_word_embeddings", "text_config"})


def _every_name(model_type: str, vocab: int) -> dict:
    """`model_type`'s keys with every usual name of each (what `config` filters)."""
    own = OVERRIDES.get(model_type, {})
    if "text_config" in own:
        text = {**_base(vocab), **own["text_config"]}
        return {"model_type": model_type, "text_config": text, "vocab_size": vocab,
                "num_hidden_layers": text["num_hidden_layers"],
                "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    return {**_base(vocab), **own, "model_type": model_type}


def _args_keys(args_class) -> set:
    import inspect

    return set(inspect.signature(args_class).parameters)


@lru_cache(maxsize=None)
def declared_keys(model_type: str) -> frozenset:
    """The config keys mlx-lm's classes of `model_type` declare: its ModelArgs's and
    those of every arguments object its built model's modules hold (a wrapper's
    language model, whose keys sit under `text_config`)."""
    from deltafin_mlx.compat import model_classes

    cfg = _every_name(model_type, 256)
    Model, Args = model_classes(cfg)
    keys = _args_keys(Args)
    try:
        model = Model(Args.from_dict(cfg))
    except Exception:  # a type mlx-lm cannot build here: its ModelArgs says
        return frozenset(keys)
    for _, module in model.named_modules():
        args = module.__dict__.get("args")
        if args is not None and not isinstance(args, dict):
            keys |= _args_keys(type(args))
    return frozenset(keys)


def own_keys(model_type: str):
    """(top level, text_config) keys `config` may give `model_type`: those its classes
    declare (`declared_keys`), transformers' own, and its OVERRIDES (set for it)."""
    own, common = OVERRIDES.get(model_type, {}), declared_keys(model_type) | COMMON_KEYS
    return common | set(own), common | set(own.get("text_config") or ())


def config(model_type: str, vocab: int) -> dict:
    """The tiny config.json of `model_type`, for a tokenizer of `vocab` ids: only its
    own keys (`own_keys`), never every family's name for a number."""
    top, text = own_keys(model_type)
    cfg = {k: v for k, v in _every_name(model_type, vocab).items() if k in top}
    if "text_config" in cfg:
        cfg["text_config"] = {k: v for k, v in cfg["text_config"].items() if k in text}
    return cfg


# --- the model -----------------------------------------------------------------

def switch_modules(model: nn.Module) -> List[str]:
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    return [name for name, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]


def roll_experts(params):
    """A switch module's parameters with its experts moved one place along axis 0."""
    from mlx.utils import tree_map

    return tree_map(lambda a: mx.roll(a, 1, axis=0), params)


def vocab(directory) -> int:
    cfg = json.loads((Path(directory) / "config.json").read_text())
    return cfg.get("text_config", cfg).get("vocab_size") or cfg["vocab_size"]


def build(cfg: dict, seed: int = 0, expert_scale: float = 2.0):
    """mlx-lm's model of `cfg` with random weights in which the experts decide."""
    from deltafin_mlx.compat import model_classes

    Model, Args = model_classes(cfg)
    model = Model(Args.from_dict(cfg))
    switches = tuple(switch_modules(model))
    mx.random.seed(seed)
    params = {}
    for name, v in tree_flatten(model.parameters()):
        if not mx.issubdtype(v.dtype, mx.floating):
            params[name] = v
            continue
        if v.size > 1 and mx.all(v == v.reshape(-1)[0]).item() or v.size == 1:
            # A constant mlx-lm starts from (zeros, ones): routers and biases must vary.
            v = v + 0.2 * mx.random.normal(v.shape)
        if name.startswith(tuple(s + "." for s in switches)):
            v = v * expert_scale
        params[name] = v
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def write(out, model_type: str, bits: Optional[int] = None, seed: int = 0,
          sizes: Optional[dict] = None) -> Path:
    """The tiny model of `model_type` as `mlx_lm.convert` writes it, with the test
    tokenizer: float (bfloat16) or quantized at `bits` (affine, group size 64).
    `sizes`: config keys that make it bigger (the benches' models)."""
    from mlx_lm.utils import quantize_model, save_config, save_model
    from deltafin_mlx.testing.tokenizers import write_bpe_tokenizer_files

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab, _ = write_bpe_tokenizer_files(out, "qwen3_moe")
    cfg = {**config(model_type, vocab), **(sizes or {})}
    model = build(cfg, seed)
    # As mlx_lm.convert casts: floats the model's own predicate allows.
    cast = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(mx.bfloat16) if cast(k) and mx.issubdtype(v.dtype, mx.floating)
        else v, model.parameters()))
    if bits is not None:
        model, cfg = quantize_model(model, cfg, 64, bits)
    save_model(out, model, donate_model=True)
    save_config(cfg, config_path=out / "config.json")
    return out
