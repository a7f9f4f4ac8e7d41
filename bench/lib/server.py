"""Serving benchmarks' harness: the test fixtures' server and clients
(deltafin_mlx/testing/server.py) plus what the meters need: a server whose memory is
sampled, its peak, and the baseline that peak is compared with."""

import subprocess

from bench.lib import worker
from deltafin_mlx.testing import server as _server
from deltafin_mlx.testing.server import chat, expected_reply, free_port, get, post, stop_server

__all__ = ["baseline_rss", "chat", "expected_reply", "free_port", "get", "peak_rss", "post",
           "start_server", "stop_server"]


def start_server(model, port, budget, log_path, server="mlx_lm", context=4096, extra=(),
                 env=None, samples=None, prefix=()):
    """deltafin_mlx.testing.server.start_server; `samples`: a file for `deltafin-run
    serve`'s memory samples (bench/lib/worker/sampled_serve.py)."""
    def sampled(serve):
        return (worker.command("sampled-serve", samples, *serve),
                {"PYTHONPATH": worker.environment()["PYTHONPATH"]})

    return _server.start_server(model, port, budget, log_path, server=server, context=context,
                                extra=extra, env=env, prefix=prefix,
                                launcher=sampled if samples is not None else None)


def peak_rss(pid) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def baseline_rss() -> int:
    """Peak memory of a process that has imported what the server imports, with no
    model: subtracted from the server's peak to compare with the budget."""
    out = subprocess.run(worker.command("server-baseline"), capture_output=True, text=True,
                         env=worker.environment())
    return int(out.stdout.strip()) * 1024 if out.returncode == 0 else 0
