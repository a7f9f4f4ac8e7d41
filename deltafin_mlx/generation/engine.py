"""One engine under every entry point (run, chat, batch, serve, the library,
lm-eval, the mlx-lm drop-in): `prepare` makes a request ready once (its prompt
tokens by the one renderer, the context rule, the sampler and processors, a
`Render`); `stream` yields one kind of event for a sequence, `batch` the same
events for many decoded together. Entry points only adapt their input and output.

The one renderer (`chat_prompt`): a conversation through the model's own format
(K3's XTML, a Jinja template), or for a model without one mlx-lm's server's
(`convert_chat`: "USER: ...\nASSISTANT:", mlx-lm's only rendering of a
conversation); a text completion's text as mlx-lm encodes it."""

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from deltafin_mlx.engine.runtime import find_runtime
from deltafin_mlx.errors import DeltafinError, RequestError
from deltafin_mlx.generation.logprobs import top_logprobs
from deltafin_mlx.generation.render import Render, opens_thinking
from deltafin_mlx.generation.request import GenerationRequest, RequestLimits, fit_max_tokens
from deltafin_mlx.generation.sampling import KeyedSampler, Sampling
from deltafin_mlx.generation.stream import (RunStats, StatsMeter, encode_text, hint_prompt_batches,
                                            planned_pass, stream_generate)


@dataclass(frozen=True)
class Defaults:
    """What an entry point gives a request for the fields it leaves out (its flags)."""

    max_tokens: int = 256  # negative: until the context ends
    sampling: Sampling = field(default_factory=Sampling)
    seed: Optional[int] = None
    stop: Sequence[str] = ()
    thinking: bool = True  # the template's thinking on (K3's, Jinja's enable_thinking)
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class Prepared:
    """A request ready to run."""

    prompt: List[int]
    max_tokens: int
    sampling: Sampling
    seed: Optional[int]
    stop: List[str]
    thinking: bool  # the prompt opens the thinking channel (render.py)
    logprobs: bool
    top_logprobs: int
    tokenizer: object = field(repr=False, default=None)
    origin: object = None  # the entry point's own record of the request (a batch line)

    def render(self) -> Render:
        return Render(self.tokenizer, thinking=self.thinking, stop=self.stop)


def chat_prompt(tokenizer, messages: List[dict], thinking: bool = True,
                thinking_effort: Optional[str] = None, add_generation_prompt: bool = True,
                tools: Optional[list] = None, template_kwargs: Optional[dict] = None,
                tokenize: bool = True):
    """A conversation's token ids (its text: not `tokenize`), by the one renderer
    (the module's docstring). `thinking_effort` is K3's (None: the model's
    default); `template_kwargs` (a request's chat_template_kwargs) win over the
    thinking switch."""
    if not getattr(tokenizer, "has_chat_template", False):
        text = untemplated(messages) if messages else ""
        return text if not tokenize else list(tokenizer.encode(text)) if text else []
    kwargs = {"thinking": thinking, "enable_thinking": thinking}
    if thinking_effort is not None:
        kwargs["thinking_effort"] = thinking_effort
    kwargs.update(template_kwargs or {})
    if tools:
        kwargs["tools"] = tools
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize, **kwargs)
    return list(out) if tokenize else out


def untemplated(messages: List[dict]) -> str:
    """A conversation's text for a model without a chat template: mlx-lm's
    server's rendering."""
    from mlx_lm.server import convert_chat

    return convert_chat(messages)


def prompt_tokens(req: GenerationRequest, tokenizer, thinking: bool = True) -> List[int]:
    """A request's prompt tokens: a text completion's as mlx-lm encodes it
    (`encode_text`), a conversation's by `chat_prompt`."""
    if req.messages is not None:
        return chat_prompt(tokenizer, req.messages, thinking, tools=req.tools,
                           template_kwargs=req.chat_template_kwargs)
    return encode_text(tokenizer, req.prompt)


def model_limits(model, tokenizer=None, context: Optional[int] = None) -> RequestLimits:
    """What a loaded model allows a request: its vocabulary, its planned context
    (or the entry point's `context`), the text that context holds (`tokenizer`)."""
    from deltafin_mlx.model.modules import model_vocab
    from deltafin_mlx.tokenizer.text_bound import max_text_bytes

    state = find_runtime(model)
    vocab = model_vocab(getattr(model, "_inner", model))
    context = context or (state.plan.context if state is not None else 1 << 31)
    text = max_text_bytes(tokenizer, vocab, context) if tokenizer is not None else 1 << 62
    return RequestLimits(vocab=vocab, context=context, max_text_bytes=text)


def prepare(request: GenerationRequest, tokenizer, limits: RequestLimits,
            defaults: Defaults = Defaults(), *, prompt: Optional[Sequence[int]] = None,
            cached: int = 0, origin=None) -> Prepared:
    """`request` ready to run within `limits`, with the entry point's `defaults`
    for what it leaves out. `prompt`: tokens the caller already has (a chat's
    new turn, serve's as mlx-lm's own thread builds them); `cached`: tokens a
    prompt cache holds before it (the context rule counts them). RequestError or
    ContextError says why it cannot run."""
    if prompt is None:
        prompt = prompt_tokens(request, tokenizer, thinking=defaults.thinking)
    if not prompt:
        raise RequestError("the prompt is empty (no tokens)")
    max_tokens = fit_max_tokens(len(prompt), request.max_tokens or defaults.max_tokens,
                                limits.context, cached)
    sampling = request.sampling(defaults.sampling)
    # mlx-lm keeps newlines and the end of a turn out of XTC's cut.
    sampling.xtc_special_tokens = list(tokenizer.encode("\n")) + list(tokenizer.eos_token_ids)
    return Prepared(
        list(prompt), max_tokens, sampling,
        seed=request.seed if request.seed is not None else defaults.seed,
        stop=list(request.stop or defaults.stop),
        thinking=opens_thinking(tokenizer, prompt),
        logprobs=request.logprobs or defaults.logprobs,
        top_logprobs=request.top_logprobs or defaults.top_logprobs,
        tokenizer=tokenizer, origin=origin)


@dataclass
class Event:
    """One generated token: its log-probability (and top K when asked), the
    (channel, text) pieces it shows (the last event's include what was held back),
    the stats so far, and on the last event why the reply ended ("stop": a stop
    string or the model's stop token; "length"; "interrupted")."""

    token: int
    logprob: float
    top: Optional[list]
    pieces: List[Tuple[str, str]]
    stats: RunStats
    finish_reason: Optional[str] = None


def stream(model, prepared: Prepared, *, prompt_cache=None, progress=None,
           stop_requested: Callable[[], bool] = lambda: False, **kwargs) -> Iterator[Event]:
    """One sequence's events (mlx-lm's stream_generate under the plan's passes).
    When `stop_requested()` turns true after a token, that token's event is the
    last ("interrupted"). `progress(done, total)`: the prefill's progress;
    `kwargs`: more for mlx-lm's stream_generate (prefill_step_size)."""
    if prepared.seed is not None:
        mx.random.seed(prepared.seed)
    render = prepared.render()
    kwargs.setdefault("sampler", prepared.sampling.sampler())  # or a caller's own
    processors = prepared.sampling.logits_processors()
    if processors:
        kwargs.setdefault("logits_processors", processors)
    kwargs.setdefault("prompt_progress_callback", progress)
    for r in stream_generate(model, prepared.tokenizer, prepared.prompt, prepared.max_tokens,
                             prompt_cache=prompt_cache, **kwargs):
        e = token_event(render, prepared, r.token, r.logprobs, r.finish_reason, r.deltafin,
                        stop_requested)
        yield e
        if e.finish_reason is not None:
            return


def finished(render: Render, token: int, reason: Optional[str],
             interrupted: Callable[[], bool] = lambda: False):
    """(pieces, reason) of one token by the one finish rule (stream, batch, serve's
    scoring pass): mlx-lm's `reason` ("stop": the model's stop token; "length"), or
    "interrupted", unless the answer met a stop string (here or in the text the
    reply's end lets out): then "stop"."""
    pieces = render.add(token, final=reason is not None)
    if reason is None and not render.stopped and interrupted():
        reason = "interrupted"
    if reason is not None or render.stopped:
        pieces += render.finish()
        reason = "stop" if render.stopped else reason
    return pieces, reason


def token_event(render: Render, prepared: Prepared, token: int, logprobs: mx.array,
                reason: Optional[str], stats: RunStats,
                interrupted: Callable[[], bool] = lambda: False) -> Event:
    """One token's event, by the one finish rule (`finished`)."""
    pieces, reason = finished(render, token, reason, interrupted)
    top = top_logprobs(logprobs, prepared.top_logprobs) if prepared.top_logprobs else None
    logprob = logprobs[token].item() if prepared.logprobs else 0.0
    return Event(token, logprob, top, pieces, stats, reason)


PREFILL_BATCH = 8  # prompts prefilled together (mlx-lm's default)


@dataclass
class Scheduler:
    """How `batch`'s sequences share mlx-lm's BatchGenerator."""

    batch_size: int = 8  # sequences decoded together
    prefill_step_size: Optional[int] = None  # per sequence per prefill call; None: the plan's pass

    def generator(self, model, tokenizer) -> BatchGenerator:
        hint_prompt_batches()
        b = max(1, int(self.batch_size))
        return BatchGenerator(model, stop_tokens=[[t] for t in tokenizer.eos_token_ids],
                              sampler=Sampling().sampler(), completion_batch_size=b,
                              prefill_batch_size=min(b, PREFILL_BATCH),
                              prefill_step_size=self.prefill_step_size
                              or max(1, planned_pass(model) // min(b, PREFILL_BATCH)))


@dataclass
class BatchStats(RunStats):
    """A sequence's RunStats in a batch: `bytes_read` is its share of the reads of
    the steps it took part in (split evenly among their sequences); `mean_batch`
    the sequences its decode steps decoded, on average."""

    mean_batch: float = 0.0


class BatchedSequence:
    """A Prepared in the generator: its Render and its share of the work."""

    def __init__(self, p: Prepared):
        self.p, self.render, self.start, self.first = p, p.render(), time.perf_counter(), None
        self.tokens, self.batch_sum, self.bytes_read = 0, 0, 0.0

    def event(self, r, batch: int) -> Event:
        """mlx-lm's response `r` from a step that decoded `batch` sequences."""
        now = time.perf_counter()
        self.first, self.tokens = self.first or now, self.tokens + 1
        self.batch_sum += batch
        stats = BatchStats(prompt_tokens=len(self.p.prompt), tokens=self.tokens,
                           seconds=now - self.start, first_token_seconds=self.first - self.start,
                           bytes_read=int(self.bytes_read), mean_batch=self.batch_sum / self.tokens)
        return token_event(self.render, self.p, r.token, r.logprobs, r.finish_reason, stats)


def batchable(model) -> bool:
    """Whether every cache of `model` merges into mlx-lm's BatchGenerator's batch
    (mlx-lm's server's rule: llama4's chunked cache, deepseek_v41's own do not)."""
    from mlx_lm.models.cache import make_prompt_cache

    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


def batch(model, prepareds: Iterable[Prepared], scheduler: Scheduler, progress=None
          ) -> Iterator[Tuple[Prepared, Union[Event, Exception]]]:
    """(prepared, event) for each token of each sequence, as mlx-lm's
    BatchGenerator decodes them together (continuous batching: a finished
    sequence's place goes to the next prompt). A step that fails retires its
    sequences and reruns each alone from its start (its first event again has
    `stats.tokens == 1`): only a sequence that fails alone fails, as (prepared,
    the exception); a model not `batchable` runs them one at a time by `stream`.
    `progress(tokens, prompt_responses)` after each step."""
    todo, alone, running = deque(prepareds), deque(), {}
    if not todo:
        return
    if not batchable(model):
        yield from one_at_a_time(model, todo, progress)
        return
    tokenizer, b = todo[0].tokenizer, max(1, int(scheduler.batch_size))
    gen = scheduler.generator(model, tokenizer)

    def insert(p: Prepared):
        # Each sequence draws with its own seed's key alone; mlx-lm's argmax when greedy.
        keyed = p.sampling.temp > 0 and p.seed is not None
        sampler = KeyedSampler(p.sampling, p.seed) if keyed else p.sampling.sampler()
        (uid,) = gen.insert([p.prompt], [p.max_tokens], samplers=[sampler],
                            logits_processors=[p.sampling.logits_processors() or []])
        running[uid] = BatchedSequence(p)

    try:
        while todo or alone or running:
            try:
                # Keep the generator's queue just full enough: caches are made on insert.
                if alone and not running:
                    insert(alone.popleft())
                while not alone and todo and len(running) < b + min(b, PREFILL_BATCH):
                    insert(todo.popleft())
                meter = StatsMeter(model)
                prompt_rs, gen_rs = gen.next()
                involved = {r.uid for r in prompt_rs} | {r.uid for r in gen_rs}
                share = meter.now().bytes_read / len(involved) if involved else 0
                for uid in involved:
                    running[uid].bytes_read += share
                events = [(r, running[r.uid].event(r, len(gen_rs))) for r in gen_rs]
                gen.remove([r.uid for r, e in events if e.finish_reason and not r.finish_reason])
            except DeltafinError:
                raise  # the model's files or the machine, not a request: stop, resumable
            except Exception as e:
                gen.close()
                gen = scheduler.generator(model, tokenizer)
                failed = [s.p for s in running.values()]
                running.clear()
                if len(failed) == 1:
                    yield failed[0], e
                else:
                    alone.extend(failed)  # each from its start: a new sampler
                continue
            for r, e in events:
                yield (running.pop(r.uid) if e.finish_reason else running[r.uid]).p, e
            if progress is not None:
                progress(len(gen_rs), prompt_rs)
    finally:
        gen.close()


def one_at_a_time(model, prepareds: Iterable[Prepared], progress=None):
    """`batch`'s (prepared, event or exception) by `stream`, a sequence at a time."""
    for p in prepareds:
        try:
            for e in stream(model, p):
                e.stats = BatchStats(**vars(e.stats), mean_batch=1.0)
                yield p, e
                if progress is not None:
                    progress(1, ())
        except DeltafinError:
            raise  # the model's files or the machine, not a request: stop, resumable
        except Exception as e:
            yield p, e


@dataclass
class Completion:
    """A whole reply: its answer and thinking as `run --json` gives them, its
    tokens, what it cost, and why it ended."""

    text: str = ""
    tokens: List[int] = field(default_factory=list)
    stats: RunStats = field(default_factory=RunStats)
    finish_reason: Optional[str] = None
    thinking: str = ""
    top_logprobs: Optional[list] = None

    def __str__(self):
        return self.text

    def add(self, e: Event, on_piece=None):
        """One event's token and text (each piece also to `on_piece(channel, text)`)."""
        self.tokens.append(e.token)
        if e.top is not None:
            self.top_logprobs = self.top_logprobs or []
            self.top_logprobs.append(e.top)
        self.stats, self.finish_reason = e.stats, e.finish_reason
        for channel, piece in e.pieces:
            if channel == "answer":
                self.text += piece
            else:
                self.thinking += piece
            if on_piece is not None:
                on_piece(channel, piece)


def complete(events: Iterator[Event], on_piece=None) -> Completion:
    """The events of one reply gathered; a KeyboardInterrupt ends it
    "interrupted" with what came so far."""
    done = Completion()
    try:
        for e in events:
            done.add(e, on_piece)
    except KeyboardInterrupt:
        done.finish_reason = "interrupted"
    return done


def generate(model, tokenizer, prompt, max_tokens: int = 256, *, stop: Sequence[str] = (),
             temp: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: Optional[int] = None, thinking: bool = True, **kwargs) -> Completion:
    """The library's one call, generated to the reply's end: `prompt` is text or
    token ids (a text completion) or a conversation (a list of messages, through
    the chat template, `thinking` on or off). The Completion's `text` is the
    answer and `thinking` apart, as `deltafin-run --json` gives them; the answer
    ends before the earliest of the `stop` strings (finish_reason "stop")."""
    chat = not isinstance(prompt, str) and len(prompt) > 0 and isinstance(prompt[0], dict)
    ids = None if chat or isinstance(prompt, str) else list(getattr(prompt, "tolist", lambda: prompt)())
    request = GenerationRequest(prompt=prompt if isinstance(prompt, str) else None,
                                messages=list(prompt) if chat else None, max_tokens=max_tokens,
                                stop=list(stop), temperature=temp, top_p=top_p, top_k=top_k,
                                seed=seed)
    prepared = prepare(request, tokenizer, model_limits(model), Defaults(thinking=thinking),
                       prompt=ids)
    return complete(stream(model, prepared, **kwargs))
