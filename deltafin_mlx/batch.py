"""Offline batch jobs: many prompts decoded together, resumable after any kill.

    deltafin-run batch MODEL IN.jsonl -o OUT.jsonl [--batch-size B] [-n N] ...

Each input line is `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages": [...]}`,
with optional per-line `max_tokens`, `temp`, `top_p`, `top_k`, `seed` and `stop`.
Sequences are decoded together by mlx-lm's `BatchGenerator` (continuous batching:
a finished sequence's place goes to the next prompt), so at each step every MoE
layer reads the union of the experts its sequences route to, once.

The output is written for a job that runs for days: one complete JSON line per
finished request, appended with a single write and fsynced. A kill can leave only
a last line without its newline, which the next run truncates; the next run then
skips every id already answered. A request that cannot run (bad JSON, too long,
unknown keys) becomes an error line; duplicate ids stop the job before it starts.
"""

import json
import os
import secrets
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from deltafin_mlx.generate import StatsMeter, chat_prompt, planned_pass
from deltafin_mlx.errors import BatchError
from deltafin_mlx.score.logprobs import top_logprobs
from deltafin_mlx.stops import StopMatcher

LINE_KEYS = {"id", "prompt", "messages", "max_tokens", "temp", "top_p", "top_k", "min_p",
             "seed", "stop"}
PREFILL_BATCH = 8  # prompts prefilled together (mlx-lm's default)


@dataclass
class BatchOptions:
    """Defaults for every request (a line's own keys override the sampling ones)."""

    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    raw: bool = False  # prompts as they are, no chat template
    thinking: bool = True  # K3's prompt format: thinking on
    batch_size: int = 8  # sequences decoded together
    context: int = 4096  # longest prompt + max_tokens a request may have
    logprobs: bool = False  # each generated token's log-probability in the output
    top_logprobs: int = 0  # the K likeliest tokens at each generated position (0: none)
    prefill_step_size: Optional[int] = None  # tokens per sequence per prefill call; None: the plan's pass


@dataclass
class Request:
    key: str  # the id as JSON text (ids may be strings or numbers)
    id: object
    line: int
    spec: dict = field(default_factory=dict)
    error: Optional[str] = None


def read_requests(lines: Iterable[str]) -> List[Request]:
    """One Request per non-empty line. A line that is not a JSON object with an
    id is kept as an error (keyed by its line number); duplicate ids refuse the job."""
    out, seen = [], {}
    for n, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            spec = json.loads(text)
        except ValueError as e:
            out.append(Request(f"line:{n}", None, n, error=f"line {n}: not JSON ({e})"))
            continue
        if not isinstance(spec, dict) or "id" not in spec or not _is_id(spec["id"]):
            out.append(Request(f"line:{n}", None, n,
                               error=f"line {n}: not an object with an \"id\" (a string or "
                               "an integer)"))
            continue
        key = json.dumps(spec["id"])
        if key in seen:
            raise BatchError(f"id {key} appears on lines {seen[key]} and {n}: ids must be "
                             "unique (the output is matched to the input by id)")
        seen[key] = n
        out.append(Request(key, spec["id"], n, spec))
    return out


def _is_id(v) -> bool:
    return isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool))


def answered_keys(out_path) -> set:
    """Ids the output already answers (error lines included). A last line without
    its newline is what a kill mid-write leaves: it is truncated away."""
    try:
        fd = os.open(out_path, os.O_RDWR)
    except FileNotFoundError:
        return set()
    with os.fdopen(fd, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
            os.fsync(f.fileno())
    keys = set()
    for n, raw in enumerate(data[:end].splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            keys.add(json.dumps(rec["id"]) if rec["id"] is not None else f"line:{rec['line']}")
        except (ValueError, KeyError, TypeError):
            raise BatchError(f"{out_path}: line {n} is not a batch result; not appending to "
                             "it (use another output file)") from None
    return keys


class KeyedSampler:
    """mlx-lm's sampling chain with a key of its own: a request's samples depend on
    its seed alone, not on what else is in the batch or how often the job was
    resumed. The key is split the way `mx.random.seed` + mlx-lm's sampler split the
    global one, so a request samples what `deltafin-run --seed S` samples from the
    same logits."""

    def __init__(self, seed: int, temp: float, top_p: float, top_k: int, min_p: float):
        self.key = mx.random.key(seed)
        self.temp, self.top_p, self.top_k, self.min_p = temp, top_p, top_k, min_p

    def __call__(self, logprobs: mx.array) -> mx.array:
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, 1)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / self.temp), key=sub)


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@dataclass
class Prepared:
    request: Request
    prompt: List[int]
    max_tokens: int
    stop: List[str]
    sampler: object
    seed: Optional[int]


def prepare(req: Request, tokenizer, opts: BatchOptions) -> Prepared:
    """Tokens and sampling of one request; ValueError says why it cannot run."""
    spec = req.spec
    unknown = sorted(set(spec) - LINE_KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (known: {', '.join(sorted(LINE_KEYS))})")
    if ("prompt" in spec) == ("messages" in spec):
        raise ValueError('needs exactly one of "prompt" (a string) or "messages" (a list)')
    if "prompt" in spec:
        if not isinstance(spec["prompt"], str):
            raise ValueError('"prompt" must be a string')
        if opts.raw:
            prompt = tokenizer.encode(spec["prompt"])
        else:
            prompt = chat_prompt(tokenizer, [{"role": "user", "content": spec["prompt"]}],
                                 thinking=opts.thinking)
    else:
        msgs = spec["messages"]
        if (not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in msgs)):
            raise ValueError('"messages" must be a non-empty list of {"role", "content"} '
                             "objects with string values")
        if opts.raw:
            raise ValueError('"messages" need the chat template; --raw takes "prompt" only')
        prompt = chat_prompt(tokenizer, msgs, thinking=opts.thinking)
    prompt = list(prompt)
    if not prompt:
        raise ValueError("the prompt is empty")

    def number(name, kind, default, ok):
        v = spec.get(name, default)
        if isinstance(v, bool) or not isinstance(v, kind) or not ok(v):
            raise ValueError(f'"{name}" is out of range or of the wrong type ({v!r})')
        return v

    max_tokens = number("max_tokens", int, opts.max_tokens, lambda v: v > 0)
    temp = number("temp", (int, float), opts.temp, lambda v: 0 <= v < float("inf"))
    top_p = number("top_p", (int, float), opts.top_p, lambda v: 0 <= v <= 1)
    top_k = number("top_k", int, opts.top_k, lambda v: v >= 0)
    min_p = number("min_p", (int, float), opts.min_p, lambda v: 0 <= v <= 1)
    seed = spec.get("seed", opts.seed)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed < 2**63):
        raise ValueError(f'"seed" must be a non-negative integer ({seed!r})')
    stop = spec.get("stop", list(opts.stop))
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ValueError('"stop" must be a string or a list of strings')
    if len(prompt) + max_tokens > opts.context:
        raise ValueError(f"too long: {len(prompt)} prompt tokens + max_tokens {max_tokens} "
                         f"exceed the context of {opts.context} tokens (--context)")
    sampler = greedy
    if temp > 0:
        seed = secrets.randbits(32) if seed is None else seed  # recorded in the output
        sampler = KeyedSampler(seed, temp, top_p, top_k, min_p)
    else:
        seed = None
    return Prepared(req, prompt, max_tokens, stop, sampler, seed)


class Running:
    """One request in the generator: its tokens, text so far and counters."""

    def __init__(self, p: Prepared, tokenizer):
        self.p = p
        self.tokens: List[int] = []
        self.logprobs: List[float] = []
        self.top: List[list] = []  # per generated token, its position's top K
        self.detok = tokenizer.detokenizer
        self.stops = StopMatcher(p.stop)
        self.start = time.perf_counter()
        self.steps = 0
        self.batch_sum = 0
        self.bytes_read = 0.0

    def add_token(self, token: int):
        self.tokens.append(token)
        self.detok.add_token(token)
        self.stops.add(self.detok.last_segment)

    def result(self, reason: str) -> dict:
        self.detok.finalize()  # the text held back for more tokens is checked too
        self.stops.add(self.detok.last_segment)
        self.stops.flush()
        if self.stops.stopped:
            reason = "stop"
        text = self.stops.text
        seconds = time.perf_counter() - self.start
        out = {"id": self.p.request.id, "text": text, "tokens": self.tokens,
               "finish_reason": reason}
        if self.p.seed is not None:
            out["seed"] = self.p.seed
        if self.logprobs:
            out["logprobs"] = self.logprobs
        if self.top:
            out["top_logprobs"] = self.top
        out["stats"] = {
            "prompt_tokens": len(self.p.prompt),
            "generation_tokens": len(self.tokens),
            "seconds": seconds,
            "tokens_per_second": len(self.tokens) / seconds if seconds > 0 else 0.0,
            "mean_batch": self.batch_sum / self.steps if self.steps else 0.0,
            "expert_bytes_read": int(self.bytes_read),  # its share of each step's reads
        }
        return out


def error_line(req: Request, message: str) -> dict:
    return {"id": req.id, "line": req.line, "error": message}


def iter_batch(model, tokenizer, requests: Sequence[Request], opts: BatchOptions,
               progress=None) -> Iterator[dict]:
    """Results (dicts) as requests finish, errors included, in finishing order."""
    todo = deque()
    for req in requests:
        if req.error:
            yield error_line(req, req.error)
            continue
        try:
            todo.append(prepare(req, tokenizer, opts))
        except ValueError as e:
            yield error_line(req, f"line {req.line}: {e}")
    if not todo:
        return
    B = max(1, int(opts.batch_size))
    gen = BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                         sampler=greedy, completion_batch_size=B,
                         prefill_batch_size=min(B, PREFILL_BATCH),
                         prefill_step_size=opts.prefill_step_size
                         or max(1, planned_pass(model) // min(B, PREFILL_BATCH)))
    eos = set(tokenizer.eos_token_ids)
    running = {}
    try:
        while todo or running:
            # Keep the generator's queue just full enough: caches are made on insert.
            while todo and len(running) < B + min(B, PREFILL_BATCH):
                p = todo.popleft()
                (uid,) = gen.insert([p.prompt], [p.max_tokens], samplers=[p.sampler])
                running[uid] = Running(p, tokenizer)
            meter = StatsMeter(model)
            prompt_rs, gen_rs = gen.next()
            involved = {r.uid for r in prompt_rs} | {r.uid for r in gen_rs}
            share = meter.now().bytes_read / len(involved) if involved else 0
            for uid in involved:
                running[uid].bytes_read += share
            for r in gen_rs:
                run = running[r.uid]
                run.steps += 1
                run.batch_sum += len(gen_rs)
                reason = r.finish_reason
                if not (reason == "stop" and r.token in eos):
                    run.add_token(r.token)
                    if opts.logprobs:
                        run.logprobs.append(r.logprobs[r.token].item())
                    if opts.top_logprobs:
                        run.top.append(top_logprobs(r.logprobs, opts.top_logprobs))
                    if run.stops.stopped:
                        if reason is None:
                            gen.remove([r.uid])
                        reason = "stop"
                if reason is not None:
                    del running[r.uid]
                    yield run.result(reason)
            if progress is not None:
                progress.step(len(gen_rs))
    finally:
        gen.close()


def batch_generate(model, tokenizer, requests: Sequence, **options) -> List[dict]:
    """Generate for many requests, decoded together; results in input order.

    requests: strings (prompts) or dicts in the batch line format
        ({"prompt": ...} or {"messages": [...]}, optional "id", "max_tokens",
        "temp", "top_p", "top_k", "min_p", "seed", "stop").
    options: BatchOptions fields (max_tokens, temp, batch_size, raw, thinking,
        stop, context, logprobs, ...).
    Each result: {"id", "text", "tokens", "finish_reason", "stats"} or {"id", "error"}.
    """
    opts = BatchOptions(**options)
    lines = []
    for i, r in enumerate(requests):
        spec = {"prompt": r} if isinstance(r, str) else dict(r)
        spec.setdefault("id", i)
        lines.append(json.dumps(spec))
    reqs = read_requests(lines)
    order = {r.key: i for i, r in enumerate(reqs)}
    results = [None] * len(reqs)
    for res in iter_batch(model, tokenizer, reqs, opts):
        key = json.dumps(res["id"]) if res["id"] is not None else f"line:{res['line']}"
        results[order[key]] = res
    return results


class Output:
    """Appends result lines: each one complete JSON plus newline, in one write,
    fsynced before the next request's result is written."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, result: dict):
        data = (json.dumps(result, ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]
        os.fsync(self.fd)

    def close(self):
        os.close(self.fd)


class Progress:
    """Requests done/total, aggregate tokens/s and ETA, on one stderr line
    (`label` and `items` name the job and what it counts: a score job counts texts)."""

    def __init__(self, total: int, skipped: int, show: bool, label: str = "batch",
                 items: str = "requests"):
        self.total, self.skipped, self.show = total, skipped, show
        self.label, self.items = label, items
        self.done = self.errors = self.tokens = 0
        self.start = time.perf_counter()
        self.last = 0.0

    def step(self, tokens: int):
        self.tokens += tokens
        self._draw()

    def finished(self, result: dict):
        self.done += 1
        self.errors += "error" in result
        self._draw(force=True)

    @property
    def tokens_per_second(self) -> float:
        t = time.perf_counter() - self.start
        return self.tokens / t if t > 0 else 0.0

    def _draw(self, force=False):
        now = time.perf_counter()
        if not self.show or (not force and now - self.last < 0.5):
            return
        self.last = now
        done = self.skipped + self.done
        left = self.total - done
        eta = (now - self.start) / self.done * left if self.done else float("nan")
        eta = "?" if eta != eta else f"{int(eta // 3600)}:{int(eta % 3600 // 60):02d}:{int(eta % 60):02d}"
        print(f"\r[{self.label}] {done}/{self.total} {self.items} ({self.errors} errors), "
              f"{self.tokens_per_second:.2f} tok/s, ETA {eta}   ", end="", file=sys.stderr,
              flush=True)

    def close(self):
        if self.show:
            print(file=sys.stderr)


def read_job(in_path, out_path) -> Tuple[List[Request], List[Request]]:
    """(every request of IN, those OUT does not answer yet)."""
    try:
        with open(in_path, encoding="utf-8") as f:
            requests = read_requests(f)
    except UnicodeDecodeError as e:
        raise BatchError(f"{in_path}: not UTF-8 text ({e})") from None
    done = answered_keys(out_path)
    return requests, [r for r in requests if r.key not in done]


def run_job(model, tokenizer, in_path, out_path, opts: BatchOptions,
            show_progress: Optional[bool] = None) -> dict:
    """The batch job: read IN, skip what OUT already answers, append the rest."""
    requests, todo = read_job(in_path, out_path)
    show = sys.stderr.isatty() if show_progress is None else show_progress
    progress = Progress(len(requests), len(requests) - len(todo), show)
    meter = StatsMeter(model)
    out = Output(out_path)
    try:
        for result in iter_batch(model, tokenizer, todo, opts, progress):
            out.write(result)
            progress.finished(result)
    finally:
        out.close()
        progress.close()
    s = meter.now(progress.tokens)
    return {"requests": len(requests), "skipped": len(requests) - len(todo),
            "answered": progress.done, "errors": progress.errors, "tokens": progress.tokens,
            "seconds": s.seconds, "tokens_per_second": s.tokens_per_second,
            "batch_size": opts.batch_size, "expert_bytes_read": s.bytes_read}


def summary_line(s: dict) -> str:
    per = s["expert_bytes_read"] / s["tokens"] / 1e6 if s["tokens"] else 0.0
    return (f"{s['requests']} requests: {s['answered']} answered now ({s['errors']} errors), "
            f"{s['skipped']} already answered; {s['tokens']} tokens in {s['seconds']:.1f} s "
            f"({s['tokens_per_second']:.2f} tok/s aggregate, batch {s['batch_size']}); "
            f"experts read {s['expert_bytes_read'] / 1e6:.1f} MB ({per:.2f} MB per token)")
