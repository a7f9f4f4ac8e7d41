"""Decode on a family Deltafin did not run before issue 30, side by side with
mlx-lm fully in memory, in one process.

A model of --type (default glm4_moe, GLM-4.5's class) at bench size is built with
mlx-lm's own class (deltafin_mlx.testing.zoo), saved as `mlx_lm.convert -q` saves
it (4-bit affine, group 64), and converted with default options. Then, alternated
repeat by repeat in one process: `mlx_lm.load` of that directory (every expert in
memory) and Deltafin with expert caches of --shares of the experts, each decoding
--tokens greedy tokens after the same prompt; tokens must be identical. Activations
are float32 on both sides (MLX's CPU backend is far faster in float32 than bf16).

    .venv/bin/python -m bench.studies.new_family_decode
    .venv/bin/python -m bench.studies.new_family_decode --type gpt_oss --repeats 5

Writes bench/results/new_family_decode.json and prints a table.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

# Bench size: experts that matter beside the trunk (4 MoE layers x 64 experts of
# 3 x 768 x 768 weights: 240 MB at 4 bits), a token's 4 experts a small share.
SIZES = {"hidden_size": 768, "moe_intermediate_size": 768, "intermediate_size": 1536,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "head_dim": 96, "num_experts": 64, "num_local_experts": 64, "n_routed_experts": 64,
         "moe_num_experts": 64, "num_experts_per_tok": 4, "moe_topk": 4, "moe_k": 4}


def prepare(workdir: Path, model_type: str):
    from deltafin_mlx.convert.convert import ConvertOptions, convert
    from deltafin_mlx.testing import zoo

    src, out = workdir / f"{model_type}-4bit", workdir / f"{model_type}-deltafin"
    if not (src / "config.json").exists():
        zoo.write(src, model_type, bits=4, sizes=SIZES)
    if not (out / "deltafin.json").exists():
        convert(str(src), out, ConvertOptions(progress=False))
    return src, out


def decode(model, prompt, tokens: int):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    y = mx.argmax(model(prompt, cache=cache)[:, -1], -1)
    mx.eval(y)
    for _ in range(2):  # warm-up
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], -1)
        mx.eval(y)
    out, start = [], time.perf_counter()
    for _ in range(tokens):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], -1)
        mx.eval(y)
        out.append(y.item())
    return out, (time.perf_counter() - start) / tokens


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", default="glm4_moe")
    ap.add_argument("--workdir", default="/tmp/deltafin-bench/new-family")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shares", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    ap.add_argument("--out", default="bench/results/new_family_decode.json")
    args = ap.parse_args(argv)

    import mlx.core as mx
    import numpy as np
    from mlx_lm.utils import load_model

    from deltafin_mlx import find_runtime, load
    from deltafin_mlx.format.manifest import read_manifest
    from deltafin_mlx.testing import zoo

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    src, out = prepare(workdir, args.type)
    reference, _ = load_model(src)
    reference.set_dtype(mx.float32)
    mx.eval(reference.parameters())
    m = read_manifest(out)
    experts = m.experts["num_experts"] * len(m.moe_layers)
    models = {"mlx-lm in memory": reference}
    for share in args.shares:
        slots = max(int(share * experts), 1)
        models[f"Deltafin {share:.0%} of experts"] = load(out, cache_slots=slots,
                                                          tokenizer=False)[0]
    vocab = zoo.vocab(src)
    rng = np.random.default_rng(0)
    runs = {name: [] for name in models}
    tokens = {}
    for r in range(args.repeats):
        prompt = mx.array(rng.integers(1, vocab - 4, (1, 16)).astype(np.int32))
        for name, model in models.items():
            st = find_runtime(model)
            read0 = st.store.bytes_read if st else 0
            got, s = decode(model, prompt, args.tokens)
            runs[name].append({"s_per_token": s, "expert_bytes_per_token":
                               ((st.store.bytes_read - read0) / args.tokens) if st else 0})
            tokens.setdefault(r, got)
            if got != tokens[r]:
                raise SystemExit(f"{name}: tokens differ from mlx-lm's in repeat {r + 1}")
    ref = statistics.median(x["s_per_token"] for x in runs["mlx-lm in memory"])
    rows = []
    for name, xs in runs.items():
        s = [x["s_per_token"] for x in xs]
        rows.append({"config": name, "tok_s": 1 / statistics.median(s),
                     "tok_s_range": [1 / max(s), 1 / min(s)],
                     "ratio": ref / statistics.median(s),
                     "expert_mb_per_token": statistics.median(
                         x["expert_bytes_per_token"] for x in xs) / 1e6})
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "type": args.type,
              "sizes": SIZES, "tokens": args.tokens, "repeats": args.repeats,
              "identical_tokens": True, "rows": rows,
              "expert_bytes": int(m.experts["record_size"]) * experts}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{args.type}, {experts} experts of {m.experts['record_size'] / 1e6:.2f} MB, "
          f"{args.tokens} tokens x {args.repeats} repeats; tokens identical in every run")
    print("| configuration | tok/s (range) | / mlx-lm | expert MB read per token |")
    print("|---|---|---|---|")
    for r in rows:
        lo, hi = r["tok_s_range"]
        print(f"| {r['config']} | {r['tok_s']:.1f} ({lo:.1f}-{hi:.1f}) | {r['ratio']:.2f}x "
              f"| {r['expert_mb_per_token']:.2f} |")


if __name__ == "__main__":
    main()
