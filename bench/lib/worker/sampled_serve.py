"""`deltafin-run serve` with a thread that samples the process's memory every 50 ms
and appends each sample to FILE as a JSON line: VmRSS, RssAnon, RssFile and threads
(KiB, from /proc), MLX's active and cached bytes, and glibc's heap (mallinfo2:
arena, mapped, used and free bytes; absent elsewhere). Where a server's peak goes.

    python -m bench.lib.worker sampled-serve FILE serve MODEL [serve options...]
"""

import ctypes
import json
import threading
import time


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


def _mallinfo():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    return libc.mallinfo2


def sample(mallinfo) -> dict:
    import mlx.core as mx

    row = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "RssAnon", "RssFile", "Threads"):
                row[key] = int(value.split()[0])
    row["mlx_active"] = mx.get_active_memory() >> 10
    row["mlx_cache"] = mx.get_cache_memory() >> 10
    if mallinfo is not None:
        m = mallinfo()
        row.update(heap=m.arena >> 10, mapped=m.hblkhd >> 10, heap_used=m.uordblks >> 10,
                   heap_free=m.fordblks >> 10)
    return row


def main(argv):
    path, serve_argv = argv[0], argv[1:]
    mallinfo = _mallinfo()
    out = open(path, "w")
    start = time.monotonic()

    def sampler():
        while True:
            row = {"t": round(time.monotonic() - start, 2), **sample(mallinfo)}
            out.write(json.dumps(row) + "\n")
            out.flush()
            time.sleep(0.05)

    threading.Thread(target=sampler, daemon=True).start()
    from deltafin_mlx.cli.main import main as deltafin_run

    return deltafin_run(serve_argv)
