"""Score jobs: `deltafin_mlx.score` and the library of `deltafin-run score`.

Every line of IN is prepared (score/inputs.py), the texts not yet answered are
packed into passes (score/packing.py, sized by plan/scoring.py), each pass runs
once through the model (score/sweep.py) and its texts' results are written as the
pass finishes (score/outputs.py), so a killed job loses at most the pass in flight
and a rerun of the same command resumes. The summary counts texts, scored tokens,
mean negative log-likelihood and perplexity, sweeps (passes: each reads every
expert it routes to at most once), expert bytes read against the union bound, and
tokens/s.
"""

import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple


from deltafin_mlx.units import count
from deltafin_mlx.jobs.outcome import Outcome, error_line
from deltafin_mlx.jobs.progress import Progress
from deltafin_mlx.jobs.job_options import activation_record, check_options
from deltafin_mlx.jobs.results_file import LINE_MAX_BYTES, check_not_input, open_input, read_lines
from deltafin_mlx.jobs.batch_lines import Request, iter_requests, read_requests
from deltafin_mlx.engine.runtime import find_runtime
from deltafin_mlx.generation.engine import model_limits
from deltafin_mlx.errors import JobError
from deltafin_mlx.model.config import max_context
from deltafin_mlx.model.modules import model_vocab
from deltafin_mlx.plan.scoring import (attention_tokens, logit_rows, long_text_tokens,
                                       scoring_pass_tokens)
from deltafin_mlx.jobs.score_lines import ScoreItem, prepare
from deltafin_mlx.tokenizer.text_bound import max_json_bytes
from deltafin_mlx.jobs.score_results import open_output, result_line
from deltafin_mlx.jobs.score_packing import pack
from deltafin_mlx.jobs.score_sweep import PassStats, Scored, run_long, run_pass

UNPLANNED_PASS = 8192  # tokens per pass for a model Deltafin did not load
UNPLANNED_STEP = 512
UNPLANNED_LOGIT_ROWS = 256


@dataclass
class ScoreOptions:
    top_logprobs: int = 0  # K most likely next tokens per scored position (0: none)
    thinking: bool = True  # K3's prompt format for "messages": thinking on
    format: str = "jsonl"  # or "safetensors" (shards + a JSONL index)
    max_pass_tokens: Optional[int] = None  # at most this many tokens per pass (None: the plan's)
    content_only: bool = False  # "messages": the turns' content tokens only, not the template's
    activation_dtype: str = "auto"  # the model's load option, as given

    def recorded(self) -> dict:
        """What the results depend on, by flag (jobs/job_options.py): not the pass size."""
        return {"--top-logprobs": self.top_logprobs, "--format": self.format,
                "--no-think": not self.thinking, "--content-only": self.content_only,
                **activation_record(self.activation_dtype)}


@dataclass
class Totals:
    texts: int = 0
    errors: int = 0
    scored_tokens: int = 0
    logprob: float = 0.0
    sweeps: int = 0
    pass_tokens: int = 0  # pads included
    expert_bytes_read: int = 0
    union_bytes: int = 0

    def add(self, results: List[Scored], stats: PassStats):
        self.texts += len(results)
        self.scored_tokens += sum(s.item.scored_tokens for s in results)
        self.logprob += sum(s.logprob for s in results)
        self.sweeps += stats.passes
        self.pass_tokens += stats.tokens
        self.expert_bytes_read += stats.expert_bytes_read
        self.union_bytes += stats.union_bytes


class Sizing:
    """How big the passes of this model may be (plan/scoring.py's rule)."""

    def __init__(self, model):
        state = find_runtime(model)
        self.state = state
        if state is None:
            self.step, self.rows = UNPLANNED_STEP, UNPLANNED_LOGIT_ROWS
            self.limit = None
            return
        config, plan = state.model_dir.config, state.plan
        self.step = plan.prefill_step
        act = state.activation_dtype
        self.rows = logit_rows(config, plan, act)
        self.limit = max_context(config)
        self._capacity = lambda longest: scoring_pass_tokens(config, plan, act, longest)
        self._attention = lambda longest: attention_tokens(config, plan, act, longest)
        self._segment = lambda length: long_text_tokens(config, plan, act, length)

    def capacity(self, longest: int) -> int:
        if self.state is None:
            return max(UNPLANNED_PASS, longest)
        return self._capacity(longest)

    def segment(self, length: int) -> Optional[int]:
        """Tokens per pass where a text of `length` tokens is too long for one pass
        (it is scored across passes, keeping its KV), else None."""
        if self.state is None:
            return None
        tokens = self._segment(length)
        return tokens if length > tokens else None

    def attention(self, longest: int) -> int:
        """Tokens per attention call of a pass of texts within a chunk."""
        return UNPLANNED_PASS if self.state is None else self._attention(longest)


def prepare_all(requests: Sequence[Request], tokenizer, opts: ScoreOptions,
                limit=None, vocab=None) -> Tuple[List[ScoreItem], List[dict]]:
    """(items to score, error lines); `limit`: the model's longest sequence,
    `vocab`: its embedding rows."""
    items, errors = [], []
    for req in requests:
        if req.error:
            errors.append(error_line(req, req.error))
            continue
        try:
            items.append(within(prepare(req, tokenizer, opts.thinking, opts.content_only,
                                        vocab), limit))
        except ValueError as e:
            errors.append(error_line(req, f"line {req.line}: {e}"))
    return items, errors


def within(item: ScoreItem, limit=None) -> ScoreItem:
    """`item`, unless longer than the model's longest sequence `limit` (ValueError)."""
    if isinstance(limit, int) and len(item.tokens) > limit:
        raise ValueError(f"{len(item.tokens)} tokens, beyond this model's maximum "
                         f"of {limit} (max_position_embeddings)")
    return item


def iter_passes(model, items: Sequence[ScoreItem], opts: ScoreOptions, at_ids=None,
                groups=None) -> Iterator[Tuple[List[Scored], PassStats]]:
    """Each pass's scores, as the passes finish; `at_ids`: per item, the token ids
    whose log-probabilities are wanted at each scored position (run_pass);
    `groups`: per item, a key whose items share passes (score_packing.pack)."""
    if opts.top_logprobs < 0:
        raise JobError(f"--top-logprobs must be 0 or more (got {opts.top_logprobs})")
    sizing = Sizing(model)
    capacity = sizing.capacity
    if opts.max_pass_tokens:
        capacity = lambda longest: min(sizing.capacity(longest), opts.max_pass_tokens)
    whole = []
    for i, it in enumerate(items):
        segment = sizing.segment(len(it.tokens))
        cap = opts.max_pass_tokens
        if cap and len(it.tokens) > cap:
            segment = min(segment or cap, cap)
        if segment is None:
            whole.append(i)
            continue
        done, stats = run_long(model, it, opts.top_logprobs, sizing.rows, segment,
                               None if at_ids is None else at_ids[i])
        yield [done], stats
    items = [items[i] for i in whole]
    at_ids = None if at_ids is None else [at_ids[i] for i in whole]
    groups = None if groups is None else [groups[i] for i in whole]
    for indices in pack([len(it.tokens) for it in items], capacity, groups):
        chosen = [items[i] for i in indices]
        longest = max(len(it.tokens) for it in chosen)
        yield run_pass(model, chosen, opts.top_logprobs, sizing.rows, sizing.step,
                       sizing.attention(longest),
                       None if at_ids is None else [at_ids[i] for i in indices])


def score(model, tokenizer, inputs: Sequence, **options) -> List[dict]:
    """Teacher-forced scores of many texts, packed into as few passes as the
    memory plan allows; results in input order.

    inputs: strings (each a "text") or dicts in the score line format
        ({"text"}, {"prompt", "completion"}, {"messages"} or {"tokens"}, optional "id").
    options: ScoreOptions fields (top_logprobs, thinking, content_only).
    Each result: {"id", "line", "tokens", "token_logprobs", ["top_ids", "top_logprobs",
    "tail_logprob"], "logprob", "scored_tokens", "greedy"} or {"id", "line", "error"}
    (docs/FORMAT.md, "Score lines")."""
    opts = ScoreOptions(**options)
    lines = []
    for i, x in enumerate(inputs):
        spec = {"text": x} if isinstance(x, str) else dict(x)
        spec.setdefault("id", i)
        lines.append(json.dumps(spec))
    requests = read_requests(lines, spec_of=dict)
    order = {r.key: i for i, r in enumerate(requests)}
    sizing = Sizing(model)
    items, errors = prepare_all(requests, tokenizer, opts, sizing.limit, model_vocab(model))
    results = [None] * len(requests)
    for e in errors:
        results[order[f"line:{e['line']}" if e["id"] is None else json.dumps(e["id"])]] = e
    for done, _ in iter_passes(model, items, opts):
        for s in done:
            results[order[json.dumps(s.item.id)]] = result_line(s)
    return results


def job_requests(in_path, line_limit: Optional[int] = None) -> Iterator[Request]:
    """IN's lines as batch reads its own (a regular file, a longer line than
    `line_limit` an error line, never held), each line's object kept as it is
    (`prepare` says which cannot be scored), read one at a time: only the ids
    seen are held."""
    with open_input(in_path) as f:
        yield from iter_requests((line for _, line, _ in read_lines(f, line_limit)),
                                 spec_of=dict)


# Texts prepared at a time: this many passes' worth of tokens (at least one text),
# packed among themselves. What a job holds of its input is that, the ids it has
# seen and the one line being read (at most LINE_MAX_BYTES), whatever its size.
WINDOW_PASSES = 4


def windows(requests: Iterator[Request], tokenizer, opts: ScoreOptions, sizing: Sizing,
            vocab) -> Iterator[Tuple[List[ScoreItem], List[dict]]]:
    """(items, error lines) a window at a time: texts are tokenized as they are
    read until the window holds WINDOW_PASSES passes of tokens."""
    bound = WINDOW_PASSES * sizing.capacity(sizing.step)
    items, errors, tokens = [], [], 0
    for req in requests:
        got, bad = prepare_all([req], tokenizer, opts, sizing.limit, vocab)
        items += got
        errors += bad
        tokens += sum(len(it.tokens) for it in got)
        if tokens >= bound:
            yield items, errors
            items, errors, tokens = [], [], 0
    if items or errors:
        yield items, errors


def run_job(model, tokenizer, in_path, out_path, opts: ScoreOptions,
            show_progress: Optional[bool] = None, outcome: Optional[Outcome] = None) -> dict:
    """The score job: read IN, skip what OUT already answers, score and append the
    rest a pass at a time (counting each line in `outcome`). IN is read twice,
    a line at a time: once to count its lines and refuse duplicate ids before
    anything runs, then to prepare and score it a window at a time (`windows`)."""
    check_not_input(in_path, out_path)
    sizing = Sizing(model)  # a line longer than the longest text it can score: not held
    longest = min(LINE_MAX_BYTES, max_json_bytes(
        model_limits(model, tokenizer, sizing.limit).max_text_bytes))
    keys = [r.key for r in job_requests(in_path, longest)]
    out = open_output(out_path, opts.format, opts.top_logprobs)
    try:
        note = check_options(out_path, opts.recorded(), started=bool(out.done))
    except BaseException:
        out.close()
        raise
    if note:
        print(f"[score] {note}", file=sys.stderr)
    outcome = Outcome("score") if outcome is None else outcome
    total, skipped = len(keys), sum(1 for key in keys if key in out.done)
    del keys
    show = sys.stderr.isatty() if show_progress is None else show_progress
    progress = Progress(total, skipped, show, outcome, items="texts")
    totals = Totals()
    start = time.perf_counter()
    try:
        todo = (r for r in job_requests(in_path, longest) if r.key not in out.done)
        for items, errors in windows(todo, tokenizer, opts, sizing, model_vocab(model)):
            for e in errors:
                out.write_error(e)
                progress.finished(e)
            totals.errors += len(errors)
            for results, stats in iter_passes(model, items, opts):
                out.write_pass(results)
                totals.add(results, stats)
                progress.tokens += sum(s.item.scored_tokens for s in results)
                for s in results:
                    progress.finished({})
    finally:
        out.close()
        progress.close()
    seconds = time.perf_counter() - start
    # No tokens scored, no perplexity (not exp(0) = 1, a perfect score).
    nll = -totals.logprob / totals.scored_tokens if totals.scored_tokens else None
    return {"texts": total, "skipped": skipped,
            "scored_texts": totals.texts, "errors": totals.errors,
            "scored_tokens": totals.scored_tokens, "mean_nll": nll,
            "perplexity": None if nll is None else math.exp(nll) if nll < 700 else float("inf"),
            "sweeps": totals.sweeps, "pass_tokens": totals.pass_tokens,
            "expert_bytes_read": totals.expert_bytes_read,
            "union_bytes": totals.union_bytes, "seconds": seconds,
            "tokens_per_second": totals.scored_tokens / seconds if seconds > 0 else 0.0}


def summary_line(s: dict) -> str:
    scores = (f"mean NLL {s['mean_nll']:.4f}, perplexity {s['perplexity']:.3f}"
              if s["scored_tokens"] else "no perplexity")
    return (f"{count(s['texts'], 'text')}: {s['scored_texts']} scored now "
            f"({count(s['errors'], 'error')}), "
            f"{s['skipped']} already answered; {s['scored_tokens']} tokens scored, "
            f"{scores}; "
            f"{count(s['sweeps'], 'sweep')}; experts read {s['expert_bytes_read'] / 1e6:.1f} MB "
            f"(union bound {s['union_bytes'] / 1e6:.1f} MB); "
            f"{s['tokens_per_second']:.1f} tok/s in {s['seconds']:.1f} s")
