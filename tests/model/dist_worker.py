"""One rank of tests/model/test_distributed.py, started by mlx.launch.

    dist_worker.py tokens OUT STEPS SLOTS|- BUDGET|- NAME=MODEL,SOURCE ...
        for each model: greedy tokens of Deltafin sharded over the launch's ranks,
        and of mlx-lm's own model (the same source, quantized by mlx-lm) sharded by
        its shard(); writes OUT/rank-R.json with both under NAME, whether the logits
        are bit-equal, and the counters.
    dist_worker.py load OUT MODEL_RANK0 MODEL_RANK1
        each rank loads its own directory (ranks that disagree must stop).
    dist_worker.py die OUT MODEL
        rank 1 exits during generation; rank 0 must stop with a message.
"""

import json
import os
import sys
from pathlib import Path

import mlx.core as mx
from deltafin_mlx.testing.decode import greedy as decode

from deltafin_mlx.engine.load import load
from deltafin_mlx import runtime

PROMPT = [[5, 17, 42, 99, 3, 250, 7, 11]]


def greedy(model, steps):
    tokens, logits = decode(model, mx.array(PROMPT), steps)
    return tokens.tolist(), logits


def main():
    mode, out = sys.argv[1], Path(sys.argv[2])
    group = mx.distributed.init()
    rank = group.rank()
    result = {"rank": rank, "size": group.size()}
    try:
        if mode == "tokens":
            from helpers import reference_model

            steps, slots, budget = int(sys.argv[3]), sys.argv[4], sys.argv[5]
            for item in sys.argv[6:]:
                name, _, dirs = item.partition("=")
                model_dir, source = dirs.split(",")
                model, _ = load(model_dir, tokenizer=False,
                                memory_budget=None if budget == "-" else budget,
                                cache_slots=None if slots == "-" else int(slots))
                tokens, logits = greedy(model, steps)
                state = runtime(model)
                run = dict(tokens=tokens, bytes_read=state.store.bytes_read,
                           misses=state.stats.misses, hits=state.stats.hits,
                           slots=state.plan.slots, record_bytes=state.store.reader.record_size)
                state.close()
                oracle = reference_model(source)
                oracle.shard(group)
                mx.eval(oracle.parameters())
                ref_tokens, ref_logits = greedy(oracle, steps)
                run.update(mlx_lm_tokens=ref_tokens,
                           logits_equal=bool(mx.array_equal(logits, ref_logits).item()))
                result[name] = run
        elif mode == "load":
            model, _ = load(sys.argv[3 + rank], tokenizer=False)
            result["loaded"] = True
        elif mode == "die":
            model, _ = load(sys.argv[3], tokenizer=False)
            if rank == 1:
                os._exit(3)
            greedy(model, 4)
            result["finished"] = True
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        if os.environ.get("DELTAFIN_WORKER_DEBUG"):
            import traceback

            traceback.print_exc()
    # Whole or not at all: mlx.launch may kill this rank mid-write once the other dies.
    tmp = out / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out / f"rank-{rank}.json")
    if "error" in result:
        print(f"rank {rank}: error: {result['error']}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
