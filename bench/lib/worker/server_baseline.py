"""Peak memory (VmHWM, KiB) of a process that has imported what the server
imports, with no model: the baseline a server's peak is compared with.

    python -m bench.lib.worker server-baseline
"""


def main(argv):
    import mlx.core as mx
    import mlx_lm.server  # noqa: F401  (imported for its memory, as the server does)

    import deltafin_mlx.engine.load  # noqa: F401

    mx.eval(mx.zeros(8) + 1)
    with open("/proc/self/status") as f:
        print([line for line in f if line.startswith("VmHWM")][0].split()[1])
