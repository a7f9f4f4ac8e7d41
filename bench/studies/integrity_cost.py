"""What integrity checks cost: checksum rates against this disk's read rate, the
cost of `--verify` on expert reads, and of the token-id check at the model's entry.

    python -m bench.studies.integrity_cost [--dir /tmp] [--read-mb 512] [--json FILE]
    python -m bench.studies.integrity_cost --records [--tokens 24] [--repeats 3] [--json FILE]

1. Checksum throughput on a 64 MB buffer (zlib CRC-32; crc32c / google-crc32c if
   installed; sha256 for scale), median and range of 7 runs.
2. O_DIRECT sequential read rate of a fresh file (16 MB reads), median of 5 passes,
   and the same reads with a CRC-32 of each chunk in the same thread (what
   --verify does on a reader thread).
3. Greedy decode tokens/s of the synthetic K3 fixture with the token-id check and
   with it removed (the embedding's original class restored), all experts cached
   (no evaluation of Deltafin's own: where an extra host sync would show most) and
   streaming through 4 slots.

With `--records`, instead: what checking bank records' CRC-32 costs a decode, never
("off"), on each record's first read in the process (the default, "first") and on every
read (`--verify`, "every"). A synthetic K3-layout model with larger experts than the
test fixture (records of about 0.4 MB, 64 experts x 3 MoE layers) is converted once;
each repeat loads it afresh in each mode (interleaved: off, first, every, then again), so the first
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
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import mlx.core as mx

from bench.lib import common
from deltafin_mlx import runtime


def rates(fn, buf, reps=7):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(buf)
        ts.append(time.perf_counter() - t)
    gbs = sorted(len(buf) / t / 1e9 for t in ts)
    return {"median_gbps": statistics.median(gbs), "range_gbps": [gbs[0], gbs[-1]]}


def checksum_rates():
    import hashlib

    buf = os.urandom(64 << 20)
    out = {"zlib.crc32": rates(zlib.crc32, buf),
           "hashlib.sha256": rates(lambda b: hashlib.sha256(b).digest(), buf)}
    try:
        import crc32c

        out["crc32c (hardware)"] = rates(crc32c.crc32c, buf)
    except ImportError:
        out["crc32c (hardware)"] = "not installed"
    return out


def direct_read_rate(directory, mb):
    from deltafin_mlx.format.aligned import aligned_empty

    path = Path(directory) / "deltafin-integrity-read.bin"
    chunk = 16 << 20
    with open(path, "wb") as f:
        block = os.urandom(chunk)
        for _ in range(mb * (1 << 20) // chunk):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    buf = aligned_empty(chunk)
    out = {}
    try:
        for name, check in (("read", False), ("read+crc32", True)):
            gbs = []
            for _ in range(5):
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
                t, off = time.perf_counter(), 0
                while True:
                    n = os.preadv(fd, [memoryview(buf)], off)
                    if n <= 0:
                        break
                    if check:
                        zlib.crc32(memoryview(buf)[:n])
                    off += n
                os.close(fd)
                gbs.append(off / (time.perf_counter() - t) / 1e9)
            gbs.sort()
            out[name] = {"median_gbps": statistics.median(gbs), "range_gbps": [gbs[0], gbs[-1]]}
    finally:
        path.unlink()
    return out


def token_check_cost(model_dir, tokens=48, repeats=5):

    from deltafin_mlx.engine.load import load
    from deltafin_mlx.compat import embedding_path
    from deltafin_mlx.model.modules import get_module

    out = {}
    for label, slots in (("all experts cached", None), ("streaming, 4 slots", 4)):
        model, _ = load(model_dir, cache_slots=slots, tokenizer=False, memory_budget="2GB",
                        warm_start=False)
        embed = get_module(model, embedding_path(model))
        guarded, original = type(embed), type(embed).__mro__[1]
        from mlx_lm.models.cache import make_prompt_cache

        def decode():
            cache = make_prompt_cache(model)
            y = mx.argmax(model(mx.array([[1, 5, 9, 200]]), cache=cache)[:, -1], axis=-1)
            mx.eval(y)
            t = time.perf_counter()
            for _ in range(tokens):
                y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
                mx.async_eval(y)
            mx.eval(y)
            return tokens / (time.perf_counter() - t)

        res = {}
        for name, cls in (("checked", guarded), ("unchecked", original)):
            embed.__class__ = cls
            decode()  # warm
            tps = sorted(decode() for _ in range(repeats))
            res[name] = {"tokens_per_s_median": statistics.median(tps),
                         "range": [tps[0], tps[-1]]}
        embed.__class__ = guarded
        res["cost"] = 1 - res["checked"]["tokens_per_s_median"] / res["unchecked"]["tokens_per_s_median"]
        out[label] = res
        runtime(model).close()
    return out


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


def records(a):
    """The --records study (the docstring's second part)."""
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


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--read-mb", type=int, default=512)
    p.add_argument("--json", default=None)
    p.add_argument("--records", action="store_true",
                   help="the cost of checking bank records' CRC-32 on a decode instead")
    p.add_argument("--tokens", type=int, default=24, help="with --records")
    p.add_argument("--repeats", type=int, default=3, help="with --records")
    a = p.parse_args()
    if a.records:
        return records(a)
    from deltafin_mlx.convert.convert import ConvertOptions, convert
    from deltafin_mlx.testing.synthetic import make_checkpoint

    work = Path(tempfile.mkdtemp(prefix="deltafin-integrity-", dir=a.dir))
    src = make_checkpoint(work / "src", "kimi_k3", seed=0)
    model = work / "k3"
    convert(str(src), model, ConvertOptions(progress=False))
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "checksums": checksum_rates(),
        "disk": direct_read_rate(a.dir, a.read_mb),
        "token_id_check": token_check_cost(model),
    }
    return common.finish_report(report, a.json, work)


if __name__ == "__main__":
    sys.exit(main())
