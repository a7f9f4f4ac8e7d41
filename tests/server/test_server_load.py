"""mlx_lm.server serving a Deltafin model under 8 concurrent clients on localhost, for a
bounded time: every request answered correctly (or refused cleanly), memory within
budget, no crash."""

from deltafin_mlx.testing import server_stress


def test_eight_concurrent_clients_are_all_answered_correctly(converted, capsys):
    report = server_stress.run(converted("kimi_k3"), clients=8, seconds=12, budget="40MB",
                               max_tokens=8)
    with capsys.disabled():
        print(f"\n[server load] {report['requests']} requests, outcomes {report['outcomes']}, "
              f"p50 {report['latency_p50_s']:.3f} s, p99 {report['latency_p99_s']:.3f} s, "
              f"peak RSS {report['server_peak_rss_bytes'] >> 20} MiB "
              f"(baseline {report['baseline_rss_bytes'] >> 20} MiB)")
    assert report["requests"] >= 16
    assert report["outcomes"].get("ok", 0) >= 16
    assert server_stress.healthy(report), report


def test_deltafin_serve_survives_two_dozen_hostile_clients(converted, capsys):
    """`deltafin-run serve` under 24 simultaneous clients of which half the requests
    are hostile (out-of-vocabulary logit_bias ids, over-long prompts, malformed and
    nested bodies, bad Content-Length, disconnects, and every value that once
    stopped mlx-lm's generation thread or fetched a URL): each hostile request gets
    its HTTP error, every ordinary one its exact reply, no connection is reset,
    /health is 200 and the server answers correctly afterwards, and peak memory
    (VmHWM, less a process that only imported the server) stays within the budget
    plus 8 MiB (measured: 38-39 MiB at this 38.1 MiB budget, docs/PERFORMANCE.md)."""
    report = server_stress.run(converted("kimi_k3"), clients=24, seconds=12, budget="40MB",
                               max_tokens=6, server="deltafin", hostile_fraction=0.5,
                               context=1024, max_requests=400)
    with capsys.disabled():
        print(f"\n[hostile load] {report['requests']} requests ({report['hostile_requests']} "
              f"hostile), outcomes {report['outcomes']}, peak RSS "
              f"{report['server_peak_rss_bytes'] >> 20} MiB (baseline "
              f"{report['baseline_rss_bytes'] >> 20} MiB)")
    assert report["outcomes"].get("ok", 0) >= 24
    assert report["outcomes"].get("refused-ok", 0) >= 24
    assert not any(k.startswith("error") for k in report["outcomes"]), report["errors"]
    assert server_stress.healthy(report, margin=8 << 20), report
