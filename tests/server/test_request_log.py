"""`deltafin-run serve` writes one log line per request: mlx-lm's per-chunk
"Prompt processing progress" lines and its per-request prompt cache sizes are
not in the log (`--log-level DEBUG` keeps them); a scored request refused busy
when its reply was to be generated ends its count too."""

import email.message
import logging
import time
from types import SimpleNamespace

import pytest

from deltafin_mlx.generation.request import unbounded
from deltafin_mlx.server.admission import Busy
from deltafin_mlx.server.counters import ServerCounters
from deltafin_mlx.server.handler import DeltafinHandler
from deltafin_mlx.server.schema import read_completion
from deltafin_mlx.testing.server import free_port, post, start_server, stop_server

TEXT = "/v1/completions"


@pytest.fixture(scope="module")
def served_log(converted, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # A small pass: the prompt below takes several prefill chunks.
    proc = start_server(converted("kimi_k3"), port, "40MB", log, server="deltafin",
                        context=1024, extra=["--prefill-step-size", "16"])
    try:
        for i in range(3):
            status, _ = post(port, TEXT, {"prompt": f"Request {i}: " + "tell me more " * 20,
                                          "max_tokens": 3, "temperature": 0.0})
            assert status == 200
        # A request's line is written as its reply ends: wait for the last one.
        deadline = time.monotonic() + 60
        while log.read_text().count("[deltafin] " + TEXT) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop_server(proc)
    return log.read_text()


def test_each_request_is_one_line(served_log):
    lines = [line for line in served_log.splitlines() if "[deltafin] " + TEXT in line]
    assert len(lines) == 3, served_log
    assert all(" ok: " in line and "prompt" in line for line in lines)


def test_mlx_lms_progress_and_cache_lines_are_not_logged(served_log):
    assert "Prompt processing progress" not in served_log
    assert "Prompt Cache:" not in served_log


def test_a_scored_request_refused_busy_is_one_busy_line_and_no_longer_running(caplog):
    counters = ServerCounters(None)

    def no_place():
        raise Busy("the server is busy")

    handler = DeltafinHandler.__new__(DeltafinHandler)  # no connection: its request only
    handler.settings = SimpleNamespace(counters=counters,
                                       admission=SimpleNamespace(place=no_place))
    handler.headers = email.message.Message()

    def scored(path, request):  # its prompt scored, its reply still to generate
        handler.prompt_scores = ("x", [1, 2], None)
        return False

    handler.scored_alone = scored
    request = read_completion({"prompt": "x", "echo": True, "max_tokens": 4,
                               "temperature": 0.7}, False, unbounded())
    with caplog.at_level(logging.INFO, "deltafin_mlx.server"), pytest.raises(Busy):
        handler.hand_to_mlx_lm(TEXT, request)
    assert counters.outcomes == {"busy": 1}
    assert not counters._running  # its peers no longer count it
    lines = [r.message for r in caplog.records if "[deltafin] " + TEXT in r.message]
    assert len(lines) == 1 and " busy: " in lines[0], lines
