"""`deltafin-run serve`'s options and limits: a bad option or a port in use is one
line and an exit at once (Deltafin's usage, not mlx-lm's), --help says what the
server guarantees, requests beyond the running and waiting places get HTTP 503,
and a failure inside the generation loop fails only the requests it held."""

import json
import socket
import subprocess
import threading
import time
from queue import Queue

import pytest

from deltafin_mlx.testing.server import free_port, get, post, start_server, stop_server
from helpers import BIN


def serve(*args, timeout=60):
    return subprocess.run([str(BIN / "deltafin-run"), "serve", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def one_line(stderr: str) -> str:
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("option,says", [
    (["--port", "70000"], "--port: must be in 1..65535"),
    (["--prefill-step-size", "0"], "--prefill-step-size"),
    (["--prompt-cache-bytes", "-1"], "--prompt-cache-bytes"),
    (["--context", "0"], "--context"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_a_bad_option_is_one_line_of_deltafins_usage(converted, option, says):
    p = serve(converted("kimi_k3"), *option)
    line = one_line(p.stderr)
    assert p.returncode == 2 and line.startswith("deltafin-run serve: error:") and says in line


def test_a_port_in_use_exits_at_once_with_one_line(converted):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        # A server that waited for the port would never exit: the generous timeout
        # catches that, where a wall-clock bound would fail on a loaded machine.
        p = serve(converted("kimi_k3"), "--budget", "40MB", "--port", s.getsockname()[1],
                  timeout=300)
    assert p.returncode == 1
    assert "cannot listen on 127.0.0.1:" in one_line(p.stderr)


def test_help_says_what_the_server_guarantees():
    out = serve("--help").stdout
    for phrase in ("/v1/chat/completions", "/v1/models", "/tokenize", "/metrics", "HTTP 400",
                   "HTTP 503", "nothing is ever", "--sequences", "--queue", "mlx_lm.server",
                   "trusted clients only"):
        assert phrase in out, phrase


def test_requests_beyond_the_places_get_503_and_the_server_goes_on(converted, tmp_path):
    port = free_port()
    proc = start_server(converted("kimi_k3"), port, "40MB", tmp_path / "log", server="deltafin",
                        context=1024, extra=["--sequences", "1", "--queue", "0"])
    try:
        long = {"messages": [{"role": "user", "content": "Go on"}], "max_tokens": 600,
                "temperature": 0}
        first = Queue()
        t = threading.Thread(target=lambda: first.put(post(port, "/v1/chat/completions", long)))
        t.start()
        deadline = time.time() + 120  # a loaded machine starts the first one late
        while time.time() < deadline:  # the first request holds the one place
            if b"deltafin_requests_running 1" in get(port, "/metrics")[1]:
                break
            time.sleep(0.05)
        status, reply = post(port, "/v1/chat/completions", {**long, "max_tokens": 2})
        assert status == 503 and "busy" in reply["error"]["message"]
        t.join(timeout=120)
        assert first.get_nowait()[0] == 200
        assert post(port, "/v1/chat/completions", {**long, "max_tokens": 2})[0] == 200
    finally:
        stop_server(proc)


def test_a_failing_generation_loop_fails_its_requests_only_and_restarts():
    """server/generation.py's ResilientGenerator (mlx-lm's ResponseGenerator, its
    queue, request taking and waiting) over a stand-in for mlx-lm's generation
    loop that raises on one request: that request gets the error, the next is
    answered and the loop's thread is alive. The drop-in's request gate (installed
    once per process by any earlier test that loaded a model through mlx-lm) is
    installed here too, so the test does not depend on which tests ran before: a
    request it cannot check must still get an answer, never hang."""
    from deltafin_mlx import compat
    from deltafin_mlx.dropin.guard import check_taken_request
    from deltafin_mlx.server.generation import GenerationFailed, ResilientGenerator

    compat.gate_server_requests(check_taken_request)

    class StandIn(ResilientGenerator):
        def _generate(self):  # mlx-lm's loop: take a request, answer on its queue
            while not self._stop:
                r = self._next_request(0.05)
                if r is None:
                    continue
                q, request, _ = r
                q.put("ctx")
                if request == "poison":
                    raise ValueError("bad request reached generation")
                q.put(f"reply to {request}")
                q.put(None)

    restarts = []
    gen = StandIn(None, None, on_restart=lambda: restarts.append(1))
    try:
        ctx, replies = gen.generate("poison", None)
        with pytest.raises(GenerationFailed):
            list(replies)
        ctx, replies = gen.generate("hello", None)
        assert list(replies) == ["reply to hello"] and restarts == [1]
        assert gen.is_healthy
    finally:
        gen.stop_and_join()
    assert not gen.is_healthy
    with pytest.raises(GenerationFailed):  # a stopped thread: HTTP 500, never a hang
        gen.generate("late", None)


def test_a_config_naming_another_model_file_is_refused_before_serving(converted, copy_of):
    """mlx-lm executes the `model_file` config.json names before Deltafin runs; every
    deltafin-run command refuses such a config.json (its checksum is in the manifest)."""
    model = copy_of(converted("kimi_k3"))
    config = json.loads((model / "config.json").read_text())
    config["model_file"] = "../elsewhere.py"
    (model / "config.json").write_text(json.dumps(config))
    p = serve(model, "--budget", "40MB", "--port", free_port())
    assert p.returncode == 1 and "config.json" in one_line(p.stderr)


def test_scoring_requests_waiting_together_share_passes(monkeypatch):
    """server/generation.py's ResilientGenerator scores on its generation thread:
    the requests waiting when it gets to them go into one packing of passes
    (jobs/score.py iter_passes, at the largest top K asked), each gets its own
    items' scores in order, and a failing pass fails those requests only."""
    from deltafin_mlx.jobs.score_lines import ScoreItem
    from deltafin_mlx.server import generation
    from deltafin_mlx.server.generation import GenerationFailed, ResilientGenerator, ScoreJob

    calls = []

    def passes(model, items, opts):
        calls.append(([list(it.tokens) for it in items], opts.top_logprobs))
        if any(it.tokens == [9, 9] for it in items):
            raise ValueError("a pass failed")
        yield [type("S", (), {"item": it, "value": sum(it.tokens)})() for it in items], None

    monkeypatch.setattr(generation, "iter_passes", passes)
    gen = ResilientGenerator.__new__(ResilientGenerator)  # its scoring alone: no thread
    gen.score_lock, gen.model_provider = threading.Lock(), type("P", (), {"model": None})()
    item = lambda *t: ScoreItem.scored_from(0, list(t), 1)  # noqa: E731
    gen.score_jobs = [ScoreJob([item(1, 2), item(3, 4, 5)], 1), ScoreJob([item(6, 7)], 4)]
    jobs = list(gen.score_jobs)
    gen.side_work()
    assert calls == [([[1, 2], [3, 4, 5], [6, 7]], 4)]  # one packing, the largest K
    assert [s.value for s in jobs[0].answer.get_nowait()] == [3, 12]
    assert [s.value for s in jobs[1].answer.get_nowait()] == [13]
    assert gen.score_jobs == []
    gen.score_jobs = [ScoreJob([item(9, 9)], 0)]
    failed = gen.score_jobs[0]
    gen.side_work()
    assert isinstance(failed.answer.get_nowait(), GenerationFailed)
