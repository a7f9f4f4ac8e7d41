"""Read every routed expert of a model through the runtime's own reader path
(bank records, or linked experts in the source's safetensors files) into slot-shaped
buffers, and report the bytes/s (bench.studies.linked_reads).

    python -m bench.lib.worker expert-reads MODEL PASSES [THROTTLE_FILE VALUE]

The model is loaded as a run loads it (direct reads); the reads then go one at a
time, in a shuffled order, each expert's sections into arrays of the slot layout.
With THROTTLE_FILE, VALUE is written there when timing starts (a blkio throttle).
"""

import json
import random
import time


def main(argv):
    from deltafin_mlx import runtime
    from deltafin_mlx.engine.load import load
    from deltafin_mlx.engine.reader import read_into
    from deltafin_mlx.format.aligned import aligned_empty
    from deltafin_mlx.format.dtypes import NUMPY

    path, passes = argv[0], int(argv[1])
    m, _ = load(path, tokenizer=False, cache_slots=1, warm_start=False)
    banks = runtime(m).cache.banks
    sections = next(iter(banks.values())).layout.held_sections
    useful = sum(s.nbytes for s in sections)
    targets = {}
    for s in sections:
        buf = aligned_empty(s.nbytes)
        targets[s.name] = buf.view(NUMPY[s.dtype]).reshape(s.shape)
    staging = aligned_empty(max(b.staging_bytes for b in banks.values()))
    order = [(layer, e) for layer, b in banks.items() for e in range(b.layout.num_experts)]
    random.Random(0).shuffle(order)
    for layer, e in order[:4]:  # warm the code path, not the disk (O_DIRECT)
        read_into(banks[layer], e, targets, staging, False)
    if len(argv) > 2:
        with open(argv[2], "w") as f:
            f.write(argv[3])
    start = time.perf_counter()
    for _ in range(passes):
        for layer, e in order:
            read_into(banks[layer], e, targets, staging, False)
    wall = time.perf_counter() - start
    direct = all(getattr(f, "direct", False) for b in banks.values()
                 for f in (getattr(b, "files", None) or [b]))
    runtime(m).close()
    n = passes * len(order)
    print(json.dumps({"reads": n, "useful_bytes_per_read": useful, "seconds": wall,
                      "bytes_per_second": n * useful / wall, "direct": direct}))
