"""One rule for a generation request, wherever it comes in: a `serve` body
(/v1/chat/completions, /v1/completions), a `batch` line (Deltafin's own
`{"prompt"|"messages"}` lines and OpenAI's Batch lines for both URLs) and the
command line's sampling flags. Each is read into a `GenerationRequest` by the one
check below, so the same body gets the same verdict everywhere, and a refusal
names the same field (the command line names the flag that sets it).

The rule per field is serve's, which is OpenAI's where OpenAI has the field:
`temperature` 0..100, `top_p` and `min_p` 0..1 (0 is off), `top_k` below the
vocabulary, `repetition_penalty` 0 (none) or 0.01..10, `presence_penalty` and
`frequency_penalty` -100..100, `seed` 0..2**63-1, `stop` at most 16 non-empty
strings, `top_logprobs` 0..10, `n` 1; scoring (serve only): `echo` (a text
completion's prompt given back with its log-probabilities, vLLM's and OpenAI's
legacy API) and vLLM's `prompt_logprobs` 0..20, where `max_tokens` may be 0 and a
text completion's `prompt` may be token ids or a list of prompts. OpenAI's bookkeeping fields (`user`,
`metadata`, `store`, ...) are taken and change nothing; its fields for what this
runtime does not do are taken only at the value that asks for nothing.

A text completion (/v1/completions, or a batch line with --raw) is its prompt's
text as it is, no chat template, as mlx-lm's server tokenizes it; a conversation
goes through the model's chat template (generation/engine.py's `prompt_tokens`). The context rule is
`fit_max_tokens`: max_tokens is cut to what the context leaves after the prompt,
and only a prompt that leaves no room is refused.
"""

import math
from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional

from deltafin_mlx.errors import ContextError, RequestError
from deltafin_mlx.tokenizer.messages import MAX_NAME_CHARS, chat_messages, fail, text
from deltafin_mlx.tokenizer.text_bound import text_bytes
from deltafin_mlx.units import is_int

MAX_STOPS = 16
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 10
MAX_PROMPT_LOGPROBS = 20  # vLLM's default cap (its --max-logprobs)
MAX_PROMPTS = 64  # prompts in one scoring request (a list `prompt`)
MAX_SEED = 2**63 - 1
MAX_TOKENS = 1 << 31
MAX_TOOLS = 256
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10
MAX_PENALTY_CONTEXT = 1 << 31  # bounded by the context where it is known


@dataclass(frozen=True)
class RequestLimits:
    """What the served model and its plan allow a request."""
    vocab: int  # rows of the embedding table: valid token ids are 0..vocab-1
    context: int  # planned tokens of prompt plus reply
    max_text_bytes: int  # a prompt with more UTF-8 bytes cannot fit the context


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


def integer(body, name, low, high, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if not is_int(v):
        fail(name, f"must be an integer, not {type(v).__name__}")
    if not low <= v <= high:
        fail(name, f"must be in {low}..{high}, not {v}")
    return v


def number(body, name, low, high, default=None):
    v = body.get(name, default)
    if v is None:
        return default
    if not _is_number(v):
        fail(name, "must be a finite number")
    if not low <= v <= high:
        fail(name, f"must be in [{low}, {high}], not {v}")
    return float(v)


def boolean(body, name, default=False):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        fail(name, f"must be true or false, not {type(v).__name__}")
    return v


def tools(v):
    if v is None:
        return None
    if not isinstance(v, list):
        fail("tools", "must be a list")
    if len(v) > MAX_TOOLS:
        fail("tools", f"has {len(v)} entries, more than {MAX_TOOLS}")
    for i, t in enumerate(v):
        f = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
            fail(f, "must be an object with a 'function' object")
        text(t["function"].get("name"), f + ".function.name", MAX_NAME_CHARS, allow_empty=False)
        if not isinstance(t["function"].get("parameters", {}), dict):
            fail(f + ".function.parameters", "must be an object")
    return v or None


def stops(v):
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, (list, tuple)):
        fail("stop", "must be a string or a list of strings")
    if len(v) > MAX_STOPS:
        fail("stop", f"has {len(v)} entries, more than {MAX_STOPS}")
    return [text(s, f"stop[{i}]", MAX_STOP_CHARS, allow_empty=False) for i, s in enumerate(v)]


def logit_bias(v, vocab):
    if v is None:
        return None
    if not isinstance(v, dict):
        fail("logit_bias", "must be an object of token id to bias")
    if len(v) > MAX_LOGIT_BIAS:
        fail("logit_bias", f"has {len(v)} entries, more than {MAX_LOGIT_BIAS}")
    out = {}
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 12):
            fail("logit_bias", f"key {k[:20]!r} is not a token id")
        if not int(k) < vocab:
            fail("logit_bias", f"token id {k} is outside the vocabulary (0..{vocab - 1})")
        if not _is_number(b) or not -100 <= b <= 100:
            fail(f"logit_bias[{k}]", "must be a finite number in [-100, 100]")
        out[int(k)] = float(b)
    return out or None


def prompt_list(v: list, limits: "RequestLimits") -> list:
    """A text completion's list `prompt`: token ids (one prompt), or a list of
    prompts, each a string or token ids (lm-eval's local-completions sends these);
    as a list of prompts."""
    if v and all(is_int(t) for t in v):
        v = [v]
    if not v or len(v) > MAX_PROMPTS:
        fail("prompt", f"a list must hold 1..{MAX_PROMPTS} prompts, not {len(v)}")
    for i, p in enumerate(v):
        f = f"prompt[{i}]"
        if isinstance(p, str):
            text(p, f, allow_empty=False)
            continue
        if not isinstance(p, list) or not p or not all(is_int(t) for t in p):
            fail(f, "must be a string or a non-empty list of token ids")
        if len(p) > limits.context:
            fail(f, f"has {len(p)} tokens, more than the planned context of {limits.context}")
        bad = next((t for t in p if not 0 <= t < limits.vocab), None)
        if bad is not None:
            fail(f, f"has token id {bad}, outside the vocabulary (0..{limits.vocab - 1})")
    return v


def repetition_penalty(body):
    """0 is mlx-lm's "no penalty" (it skips the processor); otherwise a factor that
    divides repeated tokens' positive logits (multiplies negative ones), so a tiny
    one overflows them to inf and the sampler's softmax to NaN."""
    v = number(body, "repetition_penalty", 0, MAX_REPETITION_PENALTY)
    if v is not None and 0 < v < MIN_REPETITION_PENALTY:
        fail("repetition_penalty", f"must be 0 (none) or in [{MIN_REPETITION_PENALTY}, "
                                   f"{MAX_REPETITION_PENALTY}], not {v}")
    return v


# Every field a completion body may hold; anything else is refused, never dropped.
READ_FIELDS = {
    "stream", "stream_options", "model", "adapters", "draft_model", "n", "messages", "tools",
    "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "min_p",
    "presence_penalty", "frequency_penalty", "xtc_probability", "xtc_threshold",
    "repetition_penalty", "min_tokens_to_keep", "top_k", "repetition_context_size",
    "presence_context_size", "frequency_context_size", "seed", "logit_bias", "stop",
    "logprobs", "top_logprobs", "chat_template_kwargs", "echo", "prompt_logprobs",
}
# OpenAI's fields that say nothing about the reply (bookkeeping for the client's side).
INFORMATIONAL_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# OpenAI's fields for what this runtime does not do: taken only at the value that asks
# for nothing (a client library may send it), refused otherwise.
NO_OP_VALUES = {"best_of": (None, 1), "suffix": (None, ""),
                "tool_choice": (None, "auto"), "response_format": (None, {"type": "text"}),
                "modalities": (None, ["text"]), "functions": (None,), "function_call": (None,),
                "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
                "images": (None,), "image": (None,)}


def check_fields(body: dict):
    for key in body:
        if key in READ_FIELDS or key in INFORMATIONAL_FIELDS:
            continue
        if key in NO_OP_VALUES:
            v = body[key]
            if not any(v == ok and type(v) is type(ok) for ok in NO_OP_VALUES[key]):
                fail(str(key), "is not supported (only its default, "
                               f"{NO_OP_VALUES[key][-1]!r}, is taken)")
            continue
        fail(str(key)[:40], "is not a field a completion request takes")


# The sampling fields' ranges (the rest have rules of their own below).
NUMBER_FIELDS = (("temperature", 0, 100), ("top_p", 0, 1), ("min_p", 0, 1),
                 ("presence_penalty", -100, 100), ("frequency_penalty", -100, 100),
                 ("xtc_probability", 0, 1),
                 ("xtc_threshold", 0, 0.5))  # mlx-lm's apply_xtc raises beyond 0.5
CONTEXT_FIELDS = ("repetition_context_size", "presence_context_size", "frequency_context_size")


@dataclass
class GenerationRequest:
    """A checked request: the prompt (text as it is, or a conversation for the chat
    template) and every sampling field, None where the request left it to the
    entry point's defaults."""

    prompt: Optional[str] = None  # text completion: no chat template
    messages: Optional[list] = None  # a conversation, through the chat template
    tools: Optional[list] = None
    chat_template_kwargs: Optional[dict] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    xtc_probability: Optional[float] = None
    xtc_threshold: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_context_size: Optional[int] = None
    presence_context_size: Optional[int] = None
    frequency_context_size: Optional[int] = None
    seed: Optional[int] = None
    logit_bias: Optional[Dict[int, float]] = None
    stop: List[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    stream_options: Optional[dict] = None
    # Scoring (serve): the prompt given back with its log-probabilities (`echo`),
    # vLLM's per-position top `prompt_logprobs`; a text completion's prompts when
    # its `prompt` is a list (each a string or token ids; `prompt` is then None).
    echo: bool = False
    prompt_logprobs: Optional[int] = None
    prompts: Optional[list] = None

    @property
    def scoring(self) -> bool:
        """Whether the prompt is scored (echo, prompt_logprobs): serve answers it."""
        return self.echo or self.prompt_logprobs is not None

    # --- the constructors ----------------------------------------------------

    @classmethod
    def from_openai(cls, body, chat: bool, limits: RequestLimits) -> "GenerationRequest":
        """An OpenAI body for /v1/chat/completions (`chat`) or /v1/completions;
        RequestError names the field at fault."""
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        check_fields(body)
        req = cls(stream=boolean(body, "stream"))
        so = body.get("stream_options")
        if so is not None:
            if not isinstance(so, dict):
                fail("stream_options", "must be an object")
            req.stream_options = {"include_usage": boolean(so, "include_usage")}
        if body.get("model") is not None:
            text(body["model"], "model", MAX_NAME_CHARS)
        # Any "model" a request names is answered by the loaded model; a request
        # must not make the runtime load anything else.
        for key in ("adapters", "draft_model"):
            if body.get(key) not in (None, "default_model"):
                fail(key, "is not supported")
        if integer(body, "n", 1, 1, 1) != 1:
            fail("n", "must be 1")
        if chat:
            if "prompt" in body:
                fail("prompt", "is not a field of a chat completion (it takes messages)")
            req.messages = chat_messages(body.get("messages"))
            req.tools = tools(body.get("tools"))
            prompt_text = [req.messages, req.tools]
        else:
            for key in ("messages", "tools"):
                if key in body:
                    fail(key, "is not a field of a text completion (it takes prompt)")
            if isinstance(body.get("prompt"), list):
                req.prompts = prompt_list(body["prompt"], limits)
            else:
                req.prompt = text(body.get("prompt"), "prompt", allow_empty=False)
            prompt_text = req.prompt if req.prompts is None else req.prompts
        size = text_bytes(prompt_text)
        if size > limits.max_text_bytes:
            fail("prompt", f"is {size} bytes of text, more than the planned context of "
                           f"{limits.context} tokens can hold (plan for more with --context N)")
        req.echo = boolean(body, "echo")
        req.prompt_logprobs = integer(body, "prompt_logprobs", 0, MAX_PROMPT_LOGPROBS)
        if req.echo and chat:
            fail("echo", "is a text completion's (/v1/completions); a chat takes "
                         "prompt_logprobs")
        if req.scoring and req.stream:
            fail("stream", "must be false with echo or prompt_logprobs")
        if req.prompts is not None and not req.scoring:
            fail("prompt", "a list (token ids, or several prompts) is taken with echo or "
                           "prompt_logprobs only")
        least = 0 if req.scoring else 1  # a prompt scored alone generates nothing
        req.max_tokens = integer(body, "max_completion_tokens", least, MAX_TOKENS)
        if req.max_tokens is None:
            req.max_tokens = integer(body, "max_tokens", least, MAX_TOKENS)
        for key, low, high in NUMBER_FIELDS:
            setattr(req, key, number(body, key, low, high))
        req.repetition_penalty = repetition_penalty(body)
        # mlx-lm samples with min_tokens_to_keep 1 and takes no other.
        if integer(body, "min_tokens_to_keep", 1, limits.vocab) not in (None, 1):
            fail("min_tokens_to_keep", "other than 1 is not supported")
        req.top_k = integer(body, "top_k", 0, limits.vocab - 1)  # mlx-lm takes fewer than all
        for key in CONTEXT_FIELDS:
            setattr(req, key, integer(body, key, 0, limits.context))
        req.seed = integer(body, "seed", 0, MAX_SEED)
        req.logit_bias = logit_bias(body.get("logit_bias"), limits.vocab)
        req.stop = stops(body.get("stop"))
        lp = body.get("logprobs")
        top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if not chat and is_int(lp):  # OpenAI's legacy API: logprobs is the count of top tokens
            if not 0 <= lp <= MAX_TOP_LOGPROBS:
                fail("logprobs", f"must be in 0..{MAX_TOP_LOGPROBS}, not {lp}")
            req.logprobs, top = True, lp
        else:
            req.logprobs = boolean(body, "logprobs")
        if top:
            req.logprobs, req.top_logprobs = True, top
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None:
            if not isinstance(kwargs, dict) or len(kwargs) > 32 or not all(
                    isinstance(k, str) and (v is None or isinstance(v, (bool, str))
                                            or _is_number(v))
                    for k, v in kwargs.items()):
                fail("chat_template_kwargs", "must be an object of at most 32 plain values")
            req.chat_template_kwargs = kwargs
        return req

    @classmethod
    def from_batch_line(cls, body: dict, url: Optional[str], limits: RequestLimits,
                        raw: bool = False) -> "GenerationRequest":
        """A batch line's request body (jobs/batch_lines.py): an OpenAI Batch line's
        (`url` given) means what it means at serve's endpoint of that url; an own
        line's (`url` None) is the same body with its `prompt` as the user's
        message of a conversation (text as it is with `raw`, --raw). A batch
        streams nothing: `stream` may only be false."""
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        if body.get("stream") not in (None, False):
            fail("stream", "must be false in a batch")
        req = cls._batch_line(body, url, limits, raw)
        if req.scoring:  # a prompt scored is `score`'s line
            fail("echo" if req.echo else "prompt_logprobs",
                 "is serve's; a batch generates (score a prompt with `score`)")
        return req

    @classmethod
    def _batch_line(cls, body: dict, url: Optional[str], limits: RequestLimits,
                    raw: bool) -> "GenerationRequest":
        if url is not None:
            return cls.from_openai(body, url == "/v1/chat/completions", limits)
        check_fields(body)  # an unknown key is named before a missing prompt
        if ("prompt" in body) == ("messages" in body):
            raise RequestError('needs exactly one of "prompt" (a string) or "messages" '
                               '(a list)')
        if "messages" in body:
            if raw:
                fail("messages", 'need the chat template; --raw takes "prompt" only')
            return cls.from_openai(body, chat=True, limits=limits)
        # A "prompt" line's fields are a text completion's (a legacy integer
        # `logprobs` too), with or without --raw.
        req = cls.from_openai(body, chat=False, limits=limits)
        if not raw:
            req.messages, req.prompt = [{"role": "user", "content": req.prompt}], None
        return req

    @classmethod
    def from_flags(cls, flags: dict, limits: Optional[RequestLimits] = None) -> "GenerationRequest":
        """The command line's sampling options, by field name ({"temperature": ...,
        "stop": [...]}); None leaves a field to its default. Without `limits` the
        bounds that need the model (top_k below the vocabulary) are left to
        `check_limits`."""
        body = {k: v for k, v in flags.items() if v is not None and v != []}
        body["prompt"] = "x"  # the flags' check alone; the prompt is the command's
        req = cls.from_openai(body, chat=False, limits=limits or _NO_LIMITS)
        req.prompt = None
        return req

    def check_limits(self, limits: RequestLimits):
        """The bounds that need the loaded model, for a request read without it."""
        integer({"top_k": self.top_k}, "top_k", 0, limits.vocab - 1)
        logit_bias({str(k): v for k, v in (self.logit_bias or {}).items()}, limits.vocab)
        for key in CONTEXT_FIELDS:
            integer({key: getattr(self, key)}, key, 0, limits.context)

    # --- what it means -------------------------------------------------------

    def sampling(self, defaults=None):
        """The generation.sampling.Sampling of this request over `defaults` (a
        Sampling: the entry point's own flags)."""
        from deltafin_mlx.generation.sampling import Sampling

        d = defaults or Sampling()
        pick = lambda v, default: default if v is None else v  # noqa: E731
        return Sampling(
            temp=pick(self.temperature, d.temp), top_p=pick(self.top_p, d.top_p),
            top_k=pick(self.top_k, d.top_k), min_p=pick(self.min_p, d.min_p),
            xtc_probability=pick(self.xtc_probability, d.xtc_probability),
            xtc_threshold=pick(self.xtc_threshold, d.xtc_threshold),
            repetition_penalty=pick(self.repetition_penalty, d.repetition_penalty),
            presence_penalty=pick(self.presence_penalty, d.presence_penalty),
            frequency_penalty=pick(self.frequency_penalty, d.frequency_penalty),
            repetition_context=pick(self.repetition_context_size, d.repetition_context),
            presence_context=pick(self.presence_context_size, d.presence_context),
            frequency_context=pick(self.frequency_context_size, d.frequency_context),
            logit_bias=pick(self.logit_bias, d.logit_bias))

    def mlx_lm_body(self) -> dict:
        """The body as mlx-lm's server handler should read it: only the fields it
        understands, in the types it expects (`stop` always a list, a legacy integer
        `logprobs` as `logprobs` plus `top_logprobs`, -1 for none)."""
        out = {"stream": self.stream, "stop": list(self.stop), "logprobs": self.logprobs,
               "top_logprobs": self.top_logprobs or -1}
        scoring = ("echo", "prompt_logprobs", "prompts")  # serve's own, before mlx-lm
        for f in fields(self):
            if f.name in scoring:
                continue
            v = getattr(self, f.name)
            if f.name not in out and v is not None:
                out[f.name] = {str(k): b for k, b in v.items()} if f.name == "logit_bias" else v
        return out


_NO_LIMITS = RequestLimits(vocab=1 << 62, context=MAX_PENALTY_CONTEXT, max_text_bytes=1 << 62)


def unbounded() -> RequestLimits:
    """Limits for a check made before the model is loaded (a batch line as it is
    read, the command line's flags): `check_limits` applies the model's later."""
    return _NO_LIMITS


def fit_max_tokens(prompt_tokens: int, max_tokens: int, context: int, cached: int = 0) -> int:
    """The context rule of every entry point (run, chat, batch, serve): the reply
    may take what the context leaves after the prompt, so max_tokens is cut to
    fit; a prompt that leaves no room for one token is refused (ContextError).
    A negative max_tokens means "until the context ends"."""
    used = cached + prompt_tokens
    if used >= context:
        raise ContextError(f"the prompt is {used} tokens, beyond the planned context of "
                           f"{context} tokens with room for a reply (plan for more with "
                           "--context N)")
    room = context - used
    return room if max_tokens < 0 else min(max_tokens, room)
