"""What the server counts: per request, the log line written when it ends
(tokens, time to first token, decode rate, the expert reads made while it ran);
in all, the totals /metrics reports in Prometheus' text format.

A request's expert reads are the runtime's counters over the time it ran: when
requests run together (decoded in one batch, which reads each expert once for
all of them) the line says how many shared that time.
"""

import logging
import threading
import time
from dataclasses import dataclass, field

from deltafin_mlx.engine.runtime import find_runtime
from deltafin_mlx.units import human_bytes

log = logging.getLogger("deltafin_mlx.server")


def expert_counters(model) -> dict:
    state = find_runtime(model)
    if state is None:
        return {"hits": 0, "misses": 0, "bytes_read": 0}
    s = state.stats
    return {"hits": s.hits, "misses": s.misses, "bytes_read": state.store.bytes_read}


@dataclass
class RequestMeter:
    """One request from its admission to its last byte."""
    name: str
    started: float = field(default_factory=time.perf_counter)
    experts_before: dict = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, taken from the prompt cache
    reply_tokens: int = 0
    first_token: float = 0.0  # seconds after `started`
    peers: int = 0  # most other requests running at once


class ServerCounters:
    def __init__(self, model, rank: int = 0):
        self.model = model
        self.rank = rank
        self._lock = threading.Lock()
        self.outcomes = {}  # "ok", "refused", "busy", "failed", "gone" -> count
        self.prompt_tokens = 0
        self.reply_tokens = 0
        self.generation_restarts = 0
        self._running = set()

    def start(self, name: str) -> RequestMeter:
        meter = RequestMeter(name, experts_before=expert_counters(self.model))
        with self._lock:
            self._running.add(id(meter))
            meter.peers = len(self._running) - 1
        return meter

    def token(self, meter: RequestMeter):
        if meter.reply_tokens == 0:
            meter.first_token = time.perf_counter() - meter.started
        meter.reply_tokens += 1
        with self._lock:
            meter.peers = max(meter.peers, len(self._running) - 1)

    def outcome(self, name: str):
        with self._lock:
            self.outcomes[name] = self.outcomes.get(name, 0) + 1

    def finish(self, meter: RequestMeter, outcome: str):
        with self._lock:
            self._running.discard(id(meter))
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            self.prompt_tokens += meter.prompt_tokens
            self.reply_tokens += meter.reply_tokens
        if self.rank == 0:
            log.info(request_line(meter, outcome, expert_counters(self.model)))

    def metrics_text(self, admission, listener) -> str:
        """The counters in Prometheus' text exposition format (`listener`:
        server/listener.py's server, for its connections)."""
        def metric(name, value):  # a name ending in _total is a counter, others gauges
            kind = "counter" if name.endswith("_total") else "gauge"
            return [f"# TYPE deltafin_{name} {kind}", f"deltafin_{name} {value}"]

        e = expert_counters(self.model)
        with self._lock:
            lines = ["# TYPE deltafin_requests_total counter",
                     *(f'deltafin_requests_total{{outcome="{k}"}} {v}'
                       for k, v in sorted(self.outcomes.items())),
                     *metric("prompt_tokens_total", self.prompt_tokens),
                     *metric("reply_tokens_total", self.reply_tokens),
                     *metric("generation_restarts_total", self.generation_restarts)]
        lines += [*metric("expert_hits_total", e["hits"]),
                  *metric("expert_misses_total", e["misses"]),
                  *metric("expert_bytes_read_total", e["bytes_read"]),
                  *metric("requests_running", admission.active),
                  *metric("requests_waiting", admission.waiting),
                  *metric("connections_open", listener.open_connections),
                  *metric("connections_refused_total", listener.refused_connections)]
        return "\n".join(lines) + "\n"


def request_line(meter: RequestMeter, outcome: str, experts_after: dict) -> str:
    """The log line of one finished request."""
    total = time.perf_counter() - meter.started
    b = meter.experts_before
    hits = experts_after["hits"] - b.get("hits", 0)
    misses = experts_after["misses"] - b.get("misses", 0)
    read = experts_after["bytes_read"] - b.get("bytes_read", 0)
    decode = total - meter.first_token
    rate = (meter.reply_tokens - 1) / decode if meter.reply_tokens > 1 and decode > 0 else 0.0
    shared = f" (shared with {meter.peers} other request{'s' * (meter.peers != 1)})" \
        if meter.peers else ""
    cached = f" ({meter.cached_tokens} from the prompt cache)" if meter.cached_tokens else ""
    return (f"[deltafin] {meter.name} {outcome}: {meter.prompt_tokens} prompt{cached} + "
            f"{meter.reply_tokens} reply tokens in {total:.2f} s (first token "
            f"{meter.first_token:.2f} s, {rate:.1f} tok/s); experts {hits} hits, {misses} "
            f"misses, {human_bytes(read)} read{shared}")
