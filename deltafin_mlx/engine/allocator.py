"""glibc's allocator held to what the plan budgets. MLX's CPU backend allocates
its arrays with malloc; what it frees past its own buffer cache goes back to
glibc, which keeps it: each thread that allocates gets its own arena (up to 8 per
core) holding what it freed, and after a large block is freed glibc raises its mmap
threshold, so later large blocks come from the heap and stay there as free chunks.
A process's RSS then climbs over a long job while MLX's own allocations stay within
the plan (docs/LEARNED.md). Capping the arenas, fixing the threshold (large blocks
are mapped and unmapped) and trimming the heap's top past 1 MiB keeps RSS with
MLX's allocations. Elsewhere (macOS, musl) nothing: process-wide, set once."""

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8


def tune_malloc(arenas: int = 2, mmap_threshold: int = 256 << 10, trim_threshold: int = 1 << 20):
    """Call before the threads that allocate exist (an arena is a thread's)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        for option, value in ((M_ARENA_MAX, arenas), (M_MMAP_THRESHOLD, mmap_threshold),
                              (M_TRIM_THRESHOLD, trim_threshold)):
            libc.mallopt(ctypes.c_int(option), ctypes.c_int(value))
    except (OSError, AttributeError):
        pass
