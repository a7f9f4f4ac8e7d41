"""Summing routed experts' outputs per group of experts, as a pass computes them,
instead of after SwitchGLU returns all k of a token's (mlx-lm's MoE block order):
does it change float results, and what does each hold per token?

On the demo model (mlx-lm's own model, every expert in memory), every MoE block
is run both ways on the same input: mlx-lm's `(switch_mlp(y, inds) * weights).sum(-2)`,
and a pass's order, where each group of --group experts computes its (token,
expert) pairs and adds their weighted outputs into one accumulator per token. The
prompt is prefilled twice, once carrying mlx-lm's sums through the model and once
the grouped ones. Reported: MoE outputs that differ (count, largest difference),
whether the last position's logits are equal, and each way's peak MLX memory per
token over the block's call (mx.get_peak_memory).

    .venv/bin/python -m bench.studies.group_sum [--tokens 256] [--group 8]
"""

import argparse
import json

import mlx.core as mx
import numpy as np


def main(argv=None) -> int:
    import mlx_lm.models.kimi_k3 as k3
    from mlx_lm.models.cache import make_prompt_cache

    from bench.lib.common import demo_model
    from deltafin_mlx.testing.decode import load_resident

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--group", type=int, default=8, help="experts per group")
    args = ap.parse_args(argv)
    model = load_resident(demo_model()[0])
    stats = {"blocks": 0, "elements": 0, "differing": 0, "max_abs": 0.0,
             "peak_mlx_lm": [], "peak_grouped": []}

    def routed(self, x):
        inds, weights = k3._group_expert_select(
            self.gate(x), self.e_score_correction_bias, self.args.num_experts_per_token,
            self.args.num_expert_group, self.args.topk_group, self.args.routed_scaling_factor,
            self.args.moe_renormalize)
        y = self.routed_expert_down_proj(x) if self.latent_size is not None else x
        return inds, weights, y

    def mlx_lm_order(self, x):
        inds, weights, y = routed(self, x)
        return (self.switch_mlp(y, inds) * weights[..., None]).sum(axis=-2)

    def grouped_order(self, x):
        inds, weights, y = routed(self, x)
        mx.eval(inds, weights, y)
        k = inds.shape[-1]
        flat = np.array(inds).reshape(-1)
        ys, w = y.reshape(-1, y.shape[-1]), weights.reshape(-1)
        kind = (ys[:1] * w[:1, None]).dtype
        acc = mx.zeros((ys.shape[0], ys.shape[-1]), dtype=kind)
        experts = np.unique(flat)
        for s in range(0, experts.size, args.group):
            pairs = np.nonzero(np.isin(flat, experts[s : s + args.group]))[0]
            rows = mx.array((pairs // k).astype(np.uint32))
            slots = mx.array(flat[pairs].astype(np.uint32)).reshape(1, -1, 1)
            out = self.switch_mlp(ys[rows][None], slots).reshape(len(pairs), -1)
            acc = acc.at[rows].add(out * w[mx.array(pairs.astype(np.uint32))][:, None])
            mx.eval(acc)
        return acc.reshape(*x.shape[:-1], -1)

    def peak(fn, self, x):
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = fn(self, x)
        mx.eval(out)
        return out, mx.get_peak_memory() - base

    carry = {"grouped": False}

    def both(self, x):
        mx.eval(x)
        a, pa = peak(mlx_lm_order, self, x)
        b, pb = peak(grouped_order, self, x)
        d = np.abs(np.array(a) - np.array(b))
        stats["blocks"] += 1
        stats["elements"] += d.size
        stats["differing"] += int((d > 0).sum())
        stats["max_abs"] = max(stats["max_abs"], float(d.max()))
        stats["peak_mlx_lm"].append(pa / x.shape[1])
        stats["peak_grouped"].append(pb / x.shape[1])
        y = b if carry["grouped"] else a
        if self.routed_expert_norm is not None:
            y = self.routed_expert_norm(y)
        if self.latent_size is not None:
            y = self.routed_expert_up_proj(y)
        return y + self.shared_experts(x) if self.shared_experts is not None else y

    k3.KimiK3SparseMoE.__call__ = both
    prompt = mx.array(np.random.default_rng(0).integers(1, 700, args.tokens)[None].astype(np.int32))
    logits = []
    for grouped in (False, True):
        carry["grouped"] = grouped
        out = model(prompt, cache=make_prompt_cache(model))[:, -1]
        mx.eval(out)
        logits.append(out)
        if not grouped:
            first = {k: list(v) if isinstance(v, list) else v for k, v in stats.items()}
    print(json.dumps({
        "tokens": args.tokens, "group_experts": args.group,
        "moe_blocks": first["blocks"], "moe_output_elements": first["elements"],
        "moe_outputs_differing": first["differing"], "moe_max_abs_difference": first["max_abs"],
        "logits_equal": bool(mx.array_equal(logits[0], logits[1])),
        "logits_max_abs_difference": float(mx.abs(logits[0] - logits[1]).max()),
        "peak_bytes_per_token_mlx_lm_order": first["peak_mlx_lm"],
        "peak_bytes_per_token_grouped": first["peak_grouped"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
