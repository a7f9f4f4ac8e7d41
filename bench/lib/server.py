"""Serving benchmarks' harness: the test fixtures' server and clients
(deltafin_mlx/testing/server.py) plus what the meters need: a server whose memory is
sampled, its peak, and the baseline that peak is compared with."""

from bench.lib import worker
from deltafin_mlx.testing import server as _server
from deltafin_mlx.testing.peak import baseline_rss, peak_rss
from deltafin_mlx.testing.server import chat, expected_reply, free_port, get, post, stop_server

__all__ = ["baseline_rss", "chat", "expected_reply", "free_port", "get", "peak_rss", "post",
           "start_server", "stop_server"]


def start_server(model, port, budget, log_path, server="mlx_lm", context=4096, extra=(),
                 env=None, samples=None, prefix=()):
    """deltafin_mlx.testing.server.start_server; `samples`: a file for `deltafin-run
    serve`'s memory samples (bench/lib/worker/sampled_serve.py)."""
    return _server.start_server(model, port, budget, log_path, server=server, context=context,
                                extra=extra, env=env, prefix=prefix,
                                launcher=sampling(samples) if samples is not None else None)


def sampling(samples):
    """A launcher (deltafin_mlx.testing.server's) of `deltafin-run serve` that writes
    its memory samples to the file `samples`."""
    def launch(serve):
        return (worker.command("sampled-serve", samples, *serve),
                {"PYTHONPATH": worker.environment()["PYTHONPATH"]})

    return launch

