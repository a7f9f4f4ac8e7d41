"""Offline batch jobs: many prompts decoded together, resumable after any kill.

    deltafin-run batch MODEL IN.jsonl -o OUT.jsonl [--batch-size B] [-n N] ...

The input's lines (Deltafin's own format or OpenAI's Batch format) are read by
`batch_lines.py` and checked by the one request rule (generation/request.py), the
output is appended to and scanned by `results_file.py`. A result's `text` and
`thinking` are generation/render.py's, as `run --json` and `serve` give them.
Sequences are decoded together by the engine's `batch` (generation/engine.py:
mlx-lm's `BatchGenerator`, continuous batching).

A request that cannot run becomes an error line, whether it fails when it is read,
when it is tokenized and rendered, or inside the decode loop (only a request that
fails alone: the engine reruns alone each sequence of a failed step).
"""

import json
import secrets
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

from deltafin_mlx.jobs.results_file import (Results, check_not_input, open_input, read_lines,
                                            result_key)
from deltafin_mlx.jobs.batch_lines import Request, batch_request, read_requests
from deltafin_mlx.jobs.job_options import check_options
from deltafin_mlx.jobs.outcome import Outcome, error_line
from deltafin_mlx.jobs.progress import Progress
from deltafin_mlx.errors import DeltafinError
from deltafin_mlx.engine.runtime import find_runtime
from deltafin_mlx.generation.stream import StatsMeter
from deltafin_mlx.generation import engine
from deltafin_mlx.generation.engine import (Completion, Defaults, Prepared, Scheduler, batch,
                                            model_limits)
from deltafin_mlx.generation.request import RequestLimits
from deltafin_mlx.generation.sampling import Sampling


@dataclass
class BatchOptions:
    """Defaults for every request (a line's own fields override the sampling ones)."""

    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    penalty_context: int = 20
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    raw: bool = False  # own lines' prompts as they are, no chat template
    thinking: bool = True  # K3's prompt format: thinking on
    batch_size: int = 8  # sequences decoded together
    context: int = 4096  # longest prompt + reply a request may have
    logprobs: bool = False  # each generated token's log-probability in the output
    top_logprobs: int = 0  # the K likeliest tokens at each generated position (0: none)
    prefill_step_size: Optional[int] = None  # tokens per sequence per prefill call; None: the plan's pass

    def defaults(self) -> Defaults:
        n = self.penalty_context
        sampling = Sampling(temp=self.temp, top_p=self.top_p, top_k=self.top_k,
                            min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                            presence_penalty=self.presence_penalty,
                            frequency_penalty=self.frequency_penalty,
                            repetition_context=n, presence_context=n, frequency_context=n)
        return Defaults(self.max_tokens, sampling, self.seed, tuple(self.stop), self.thinking,
                        self.logprobs, self.top_logprobs)


def prepare(req: Request, tokenizer, opts: BatchOptions, limits: RequestLimits) -> Prepared:
    """One line ready to run (generation/engine.py's prepare, the line kept as its
    `origin`); a sampled request without a seed gets one, recorded in the output."""
    request = batch_request(req.spec, limits, raw=opts.raw)
    p = engine.prepare(request, tokenizer, limits, opts.defaults(), origin=req)
    p.seed = (secrets.randbits(32) if p.seed is None else p.seed) if p.sampling.temp > 0 else None
    return p


def iter_batch(model, tokenizer, requests: Sequence[Request], opts: BatchOptions,
               progress=None) -> Iterator[dict]:
    """Results (dicts) as requests finish, errors included, in finishing order."""
    todo = []
    limits = model_limits(model, tokenizer, context=opts.context)
    for req in requests:
        if req.error:
            yield error_line(req, req.error)
            continue
        try:
            todo.append(prepare(req, tokenizer, opts, limits))
        except DeltafinError as e:  # the template's own limits, a token id, ...
            yield error_line(req, f"line {req.line}: {e}")
        except Exception as e:  # whatever the tokenizer or template make of it
            yield error_line(req, f"line {req.line}: {_failure(e)}")
    replies = {}  # id(prepared) -> (Completion, logprobs)
    step = progress.step if progress is not None else None
    for p, e in batch(model, todo, Scheduler(opts.batch_size, opts.prefill_step_size), step):
        if isinstance(e, Exception):
            req = p.origin
            yield error_line(req, f"line {req.line}: failed while decoding ({_failure(e)})")
            continue
        if e.stats.tokens == 1:  # a reply starts (again, after a failed step)
            replies[id(p)] = (Completion(), [])
        done, logprobs = replies[id(p)]
        done.add(e)
        logprobs.append(e.logprob)
        if e.finish_reason is not None:
            del replies[id(p)]
            yield result(p, done, logprobs)


def result(p: Prepared, done: Completion, logprobs: List[float]) -> dict:
    """A finished request's line; the model's stop token is not one of its tokens."""
    req, s = p.origin, done.stats
    n = len(done.tokens) - (done.finish_reason == "stop"
                            and done.tokens[-1] in p.tokenizer.eos_token_ids)
    out = {"id": req.id, "text": done.text, "thinking": done.thinking,
           "tokens": done.tokens[:n], "finish_reason": done.finish_reason}
    if req.custom_id:
        out["custom_id"] = req.id
    if p.seed is not None:
        out["seed"] = p.seed
    if p.logprobs and n:
        out["logprobs"] = logprobs[:n]
    if p.top_logprobs and n:
        out["top_logprobs"] = done.top_logprobs[:n]
    out["stats"] = {"prompt_tokens": s.prompt_tokens, "generation_tokens": n, "seconds": s.seconds,
                    "tokens_per_second": n / s.seconds if s.seconds > 0 else 0.0,
                    "mean_batch": s.mean_batch, "expert_bytes_read": s.bytes_read}
    return out


def _failure(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def batch_generate(model, tokenizer, requests: Sequence, **options) -> List[dict]:
    """Generate for many requests, decoded together; results in input order.

    requests: strings (prompts) or dicts in the batch line format
        ({"prompt": ...} or {"messages": [...]}, optional "id" and any field a
        serve body takes: "max_tokens", "temperature" (or "temp"), "top_p", ...).
    options: BatchOptions fields (max_tokens, temp, batch_size, raw, thinking,
        stop, context, logprobs, ...).
    Each result: {"id", "text", "thinking", "tokens", "finish_reason", "stats"} or
    {"id", "error"}.
    """
    opts = BatchOptions(**options)
    lines = []
    for i, r in enumerate(requests):
        spec = {"prompt": r} if isinstance(r, str) else dict(r)
        if "custom_id" not in spec:
            spec.setdefault("id", i)
        lines.append(json.dumps(spec))
    reqs = read_requests(lines)
    order = {r.key: i for i, r in enumerate(reqs)}
    results = [None] * len(reqs)
    for res in iter_batch(model, tokenizer, reqs, opts):
        results[order[result_key(res)]] = res
    return results


@dataclass
class Job:
    """A job's requests, the ones its output does not answer yet, and the output,
    locked until `close`."""

    requests: List[Request]
    todo: List[Request]
    results: Results
    note: Optional[str] = None  # what the options check has to say (job_options.py)

    @property
    def skipped(self) -> int:
        return len(self.requests) - len(self.todo)

    def close(self):
        self.results.close()


def open_job(in_path, out_path, options: Optional[dict] = None) -> Job:
    """Read IN, lock OUT (`-`: stdout, no resume), find what it already answers and
    check `options` ({flag: value}) against the ones OUT was written with."""
    check_not_input(in_path, out_path)
    with open_input(in_path) as f:
        requests = read_requests(line for _, line, _ in read_lines(f))
    results = Results(out_path)
    note = None
    try:
        done = results.scan()
        if options is not None and results.resumable:
            note = check_options(out_path, options, started=bool(done))
    except BaseException:
        results.close()
        raise
    return Job(requests, [r for r in requests if r.key not in done], results, note)


def run_job(model, tokenizer, job: Job, opts: BatchOptions,
            show_progress: Optional[bool] = None, outcome: Optional[Outcome] = None) -> dict:
    """The batch job: answer what its output does not answer yet, appending each
    result as it finishes (and counting it in `outcome`)."""
    show = sys.stderr.isatty() if show_progress is None else show_progress
    outcome = Outcome("batch") if outcome is None else outcome
    progress = Progress(len(job.requests), job.skipped, show, outcome)
    meter = StatsMeter(model)
    state = find_runtime(model) if show else None
    layers = state.observe(on_pass_layer=progress.layer) if state is not None else nullcontext()
    try:
        with layers:  # prefill steps report their layers
            progress.step(0)  # shown from the start, before the first step returns
            for result in iter_batch(model, tokenizer, job.todo, opts, progress):
                job.results.write(result)
                progress.finished(result)
    finally:
        progress.close()
    s = meter.now(progress.tokens)
    return {"requests": len(job.requests), "skipped": job.skipped,
            "answered": outcome.answered, "errors": outcome.errors, "tokens": progress.tokens,
            "seconds": s.seconds, "tokens_per_second": s.tokens_per_second,
            "batch_size": opts.batch_size, "expert_bytes_read": s.bytes_read}


def summary_line(s: dict) -> str:
    per = s["expert_bytes_read"] / s["tokens"] / 1e6 if s["tokens"] else 0.0
    return (f"{s['requests']} requests: {s['answered']} answered now ({s['errors']} errors), "
            f"{s['skipped']} already answered; {s['tokens']} tokens in {s['seconds']:.1f} s "
            f"({s['tokens_per_second']:.2f} tok/s aggregate, batch {s['batch_size']}; a "
            "result's stats.tokens_per_second is its own tokens over its own time, shared "
            "with the requests decoded beside it); "
            f"experts read {s['expert_bytes_read'] / 1e6:.1f} MB ({per:.2f} MB per token)")
