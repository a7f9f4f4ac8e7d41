"""What checking bank records' CRC-32 costs a decode: never ("off"), on each
record's first read in the process (the default, "first") and on every read
(`--verify`, "every").

    python -m bench.studies.record_checks [--dir /tmp] [--tokens 24] [--repeats 3] [--json FILE]

A synthetic K3-layout model with larger experts than the test fixture (records of
about 0.4 MB, 64 experts x 3 MoE layers) is converted once; each repeat loads it
afresh in each mode (interleaved: off, first, every, then again), so the first
reads are inside the measurement:

- streaming: a cache of twice the experts per token, so nearly every step reads
  records, most of them more than once over the run (greedy decode of `--tokens`
  tokens after a 4-token prompt, timed from the prompt to the last token);
- cached: every expert fits, so all first reads happen while loading (the load is
  timed) and decode reads nothing.

Reported: medians and ranges, and each mode's time relative to "off" in the same
repeat (ratios within one run: the machine is shared and noisy).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from bench.lib import common
from deltafin_mlx import runtime

MODES = ("off", "first", "every")
MODEL = dict(routed_expert_hidden_size=512, moe_intermediate_size=1024, num_experts=64,
             experts_per_token=4, num_layers=4)


def decode_seconds(model_dir, mode: str, tokens: int, slots) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    from deltafin_mlx.engine.load import load

    t0 = time.perf_counter()
    model, _ = load(model_dir, cache_slots=slots, tokenizer=False, memory_budget="4GB",
                    record_checks=mode, warm_start=False, lookahead=False)
    loaded = time.perf_counter() - t0
    cache = make_prompt_cache(model)
    t = time.perf_counter()
    y = mx.argmax(model(mx.array([[1, 5, 9, 200]]), cache=cache)[:, -1], axis=-1)
    for _ in range(tokens):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    seconds = time.perf_counter() - t
    reader = runtime(model).store.reader
    out = {"load_s": loaded, "decode_s": seconds, "reads": reader.reads,
           "reader_busy_s": reader.busy_seconds}
    runtime(model).close()
    return out


def summary(values):
    v = sorted(values)
    return {"median": statistics.median(v), "range": [v[0], v[-1]]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from deltafin_mlx.convert.convert import ConvertOptions, convert
    from deltafin_mlx.testing.synthetic import make_checkpoint

    work = Path(tempfile.mkdtemp(prefix="deltafin-record-checks-", dir=a.dir))
    src = make_checkpoint(work / "src", "kimi_k3", seed=0, **MODEL)
    model_dir = work / "k3"
    manifest = convert(str(src), model_dir, ConvertOptions(progress=False))
    k = manifest.experts["experts_per_token"]
    cases = {"streaming": 2 * k, "cached": None}
    runs = {case: {m: [] for m in MODES} for case in cases}
    for _ in range(a.repeats):
        for case, slots in cases.items():
            for mode in MODES:
                runs[case][mode].append(decode_seconds(model_dir, mode, a.tokens, slots))
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "record_bytes": manifest.experts["record_size"],
              "records": manifest.experts["num_experts"] * len(manifest.moe_layers),
              "tokens": a.tokens, "repeats": a.repeats, "cases": {}}
    for case in cases:
        key = "decode_s" if case == "streaming" else "load_s"
        res = {"timed": key}
        for mode in MODES:
            rs = runs[case][mode]
            res[mode] = {key: summary([r[key] for r in rs]),
                         "reads": summary([r["reads"] for r in rs]),
                         "relative_to_off": summary([r[key] / off[key] for r, off in
                                                     zip(rs, runs[case]["off"])])}
            if case == "streaming":
                res[mode]["tokens_per_s"] = summary([a.tokens / r["decode_s"] for r in rs])
        report["cases"][case] = res
    return common.finish_report(report, a.json, work)


if __name__ == "__main__":
    sys.exit(main())
