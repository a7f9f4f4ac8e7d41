"""Where a prefill's time goes, mlx-lm fully in memory against Deltafin at a budget
holding every expert: each decoder layer's attention and its MLP/MoE block are
timed with an evaluation barrier after each (so both models run the same
barriers), one prompt of --tokens random ids, --repeats alternated rounds after a
warm-up, in one process. Prints milliseconds per part, averaged over the rounds.

    .venv/bin/python -m bench.studies.prefill_parts [--tokens 1000] [--repeats 2]
"""

import argparse
import time
from collections import defaultdict

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class Timed(nn.Module):
    """A module's calls, evaluated and timed into `totals[name]`."""

    def __init__(self, inner, name, totals):
        super().__init__()
        self.inner, self.name, self.totals = inner, name, totals

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.inner(*args, **kwargs)
        mx.eval(out)
        self.totals[self.name] += time.perf_counter() - t
        return out


def main(argv=None) -> int:
    from mlx_lm.models.cache import make_prompt_cache

    from bench.lib.common import demo_model
    from deltafin_mlx.engine.load import load
    from deltafin_mlx.testing.decode import load_resident

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    path = demo_model()[0]
    models = {"mlx-lm": load_resident(path),
              "deltafin": load(path, 64 << 30, tokenizer=False, warm_start=False,
                               context=args.tokens + 64)[0]}
    totals = defaultdict(float)
    for tag, m in models.items():
        inner = m.language_model.model if hasattr(m, "language_model") else m.model
        for i, layer in enumerate(inner.layers):
            layer.self_attn = Timed(layer.self_attn, (tag, "attention", i), totals)
            layer.mlp = Timed(layer.mlp, (tag, "mlp", i), totals)
    prompt = mx.array(np.random.default_rng(0).integers(1, 700, args.tokens)[None].astype(np.int32))

    def run(tag):
        m, cache = models[tag], make_prompt_cache(models[tag])
        t = time.perf_counter()
        mx.eval(m(prompt[:, :-1], cache=cache), [c.state for c in cache])
        mx.clear_cache()
        totals[(tag, "total", -1)] += time.perf_counter() - t

    for tag in models:
        run(tag)  # warm-up
    totals.clear()
    for _ in range(args.repeats):
        for tag in models:
            run(tag)
    print("| part | mlx-lm ms | Deltafin ms | Deltafin / mlx-lm |\n|---|---|---|---|")
    for part, layer in sorted({k[1:] for k in totals}, key=lambda p: (p[0] == "total", p[1], p[0])):
        a, b = (totals[(t, part, layer)] / args.repeats * 1e3 for t in models)
        name = part if layer < 0 else f"layer {layer} {part}"
        print(f"| {name} | {a:.0f} | {b:.0f} | {b / a:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
