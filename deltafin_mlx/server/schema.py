"""One schema for every request body `deltafin-run serve` takes (chat and text
completions, tokenize and detokenize): each value's type, range, length and
nesting is checked here, before anything reaches mlx-lm's generation thread, so
a bad value is an HTTP 400 naming the field, never an exception where every
client would feel it.

`check_completion` returns the body as mlx-lm's handler should see it: only the
fields it understands, in the types it expects (a legacy integer `logprobs` of
/v1/completions becomes `logprobs` plus `top_logprobs`; `stop` always a list).
Content parts other than text are refused before any I/O: the model takes no
images, and no URL a client names is ever fetched.
"""

import math
from dataclasses import dataclass

from deltafin_mlx.errors import RequestError
from deltafin_mlx.tokenizer.messages import MAX_NAME_CHARS, chat_messages, fail, text
from deltafin_mlx.tokenizer.text_bound import text_bytes

MAX_DEPTH = 32  # JSON nesting: messages > parts > tool calls > arguments > ...
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 10
MAX_SEED = 2**63 - 1
MAX_TOOLS = 256
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10


@dataclass(frozen=True)
class RequestLimits:
    """What the served model and its plan allow a request."""
    vocab: int  # rows of the embedding table: valid token ids are 0..vocab-1
    context: int  # planned tokens of prompt plus reply
    max_text_bytes: int  # a prompt with more UTF-8 bytes cannot fit the context


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v))


def integer(body, field, low, high, default=None):
    v = body.get(field, default)
    if v is None:
        return default
    if not _is_int(v):
        fail(field, f"must be an integer, not {type(v).__name__}")
    if not low <= v <= high:
        fail(field, f"must be in {low}..{high}, not {v}")
    return v


def number(body, field, low, high, default=None):
    v = body.get(field, default)
    if v is None:
        return default
    if not _is_number(v):
        fail(field, "must be a finite number")
    if not low <= v <= high:
        fail(field, f"must be in [{low}, {high}], not {v}")
    return float(v)


def boolean(body, field, default=False):
    v = body.get(field, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        fail(field, f"must be true or false, not {type(v).__name__}")
    return v


def check_depth(value, limit=MAX_DEPTH):
    """Refuse JSON nested deeper than `limit` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > limit:
                raise RequestError(f"the body is nested more than {limit} levels deep")
            items = v.values() if isinstance(v, dict) else v
            stack.extend((x, depth + 1) for x in items)


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
    if not isinstance(v, list):
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
    "logprobs", "top_logprobs", "chat_template_kwargs",
}
# OpenAI's fields that say nothing about the reply (bookkeeping for the client's side).
INFORMATIONAL_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
# OpenAI's fields for what this server does not do: taken only at the value that asks
# for nothing (a client library may send it), refused otherwise.
NO_OP_VALUES = {
    "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "tool_choice": (None, "auto"), "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]), "functions": (None,), "function_call": (None,),
    "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "images": (None,), "image": (None,),
}


def check_fields(body: dict):
    for key in body:
        if key in READ_FIELDS or key in INFORMATIONAL_FIELDS:
            continue
        if key in NO_OP_VALUES:
            v = body[key]
            if not any(v == ok and type(v) is type(ok) for ok in NO_OP_VALUES[key]):
                fail(str(key), "is not supported by deltafin-run serve (only its default, "
                               f"{NO_OP_VALUES[key][-1]!r}, is taken)")
            continue
        fail(str(key)[:40], "is not a field deltafin-run serve takes")


def check_completion(body: dict, chat: bool, limits: RequestLimits) -> dict:
    """The validated fields of a chat (`chat`) or text completion body."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    check_depth(body)
    check_fields(body)
    out = {"stream": boolean(body, "stream")}
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            fail("stream_options", "must be an object")
        out["stream_options"] = {"include_usage": boolean(so, "include_usage")}
    for key in ("model",):
        if body.get(key) is not None:
            text(body[key], key, MAX_NAME_CHARS)
    # Any "model" a request names is answered by the served model; a request
    # must not make the server load anything else.
    for key in ("adapters", "draft_model"):
        if body.get(key) not in (None, "default_model"):
            fail(key, "is not supported by deltafin-run serve")
    if integer(body, "n", 1, 1, 1) != 1:
        fail("n", "must be 1")
    if chat:
        out["messages"] = chat_messages(body.get("messages"))
        out["tools"] = tools(body.get("tools"))
        prompt_text = [out["messages"], out["tools"]]
    else:
        out["prompt"] = text(body.get("prompt"), "prompt", allow_empty=False)
        prompt_text = out["prompt"]
    size = text_bytes(prompt_text)
    if size > limits.max_text_bytes:
        raise RequestError(f"the prompt is {size} bytes of text, more than the planned context "
                           f"of {limits.context} tokens can hold (deltafin-run serve --context "
                           "N plans for more)")
    ctx = limits.context
    max_tokens = integer(body, "max_completion_tokens", 1, 1 << 31)
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", 1, 1 << 31)
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    for key, low, high in (("temperature", 0, 100), ("top_p", 0, 1), ("min_p", 0, 1),
                           ("presence_penalty", -100, 100),
                           ("frequency_penalty", -100, 100), ("xtc_probability", 0, 1),
                           ("xtc_threshold", 0, 1)):
        v = number(body, key, low, high)
        if v is not None:
            out[key] = v
    v = repetition_penalty(body)
    if v is not None:
        out["repetition_penalty"] = v
    # mlx-lm's server samples with min_tokens_to_keep 1 and takes no other.
    if integer(body, "min_tokens_to_keep", 1, limits.vocab) not in (None, 1):
        fail("min_tokens_to_keep", "other than 1 is not supported by deltafin-run serve")
    v = integer(body, "top_k", 0, limits.vocab - 1)  # mlx-lm's sampler takes fewer than all
    if v is not None:
        out["top_k"] = v
    for key in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        v = integer(body, key, 0, ctx)
        if v is not None:
            out[key] = v
    seed = integer(body, "seed", 0, MAX_SEED)
    if seed is not None:
        out["seed"] = seed
    out["logit_bias"] = logit_bias(body.get("logit_bias"), limits.vocab)
    out["stop"] = stops(body.get("stop"))
    lp = body.get("logprobs")
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if not chat and _is_int(lp):  # OpenAI's legacy API: logprobs is the count of top tokens
        if not 0 <= lp <= MAX_TOP_LOGPROBS:
            fail("logprobs", f"must be in 0..{MAX_TOP_LOGPROBS}, not {lp}")
        out["logprobs"], top = True, lp
    else:
        out["logprobs"] = boolean(body, "logprobs")
    if top:
        out["logprobs"] = True
        out["top_logprobs"] = top
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or len(kwargs) > 32 or not all(
                isinstance(k, str) and (v is None or isinstance(v, (bool, str)) or _is_number(v))
                for k, v in kwargs.items()):
            fail("chat_template_kwargs", "must be an object of at most 32 plain values")
        out["chat_template_kwargs"] = kwargs
    return out


def only_fields(body: dict, fields):
    """/tokenize and /detokenize, as the completions: a field the endpoint does not
    take is refused, never dropped."""
    for key in body:
        if key not in fields:
            fail(str(key)[:40], "is not a field this endpoint takes")


def check_tokenize(body: dict, limits: RequestLimits):
    """/tokenize's `content` and `add_special` (llama.cpp's shape)."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    only_fields(body, ("content", "add_special"))
    content = text(body.get("content"), "content")
    if len(content.encode("utf-8")) > limits.max_text_bytes:
        fail("content", f"is more text than the planned context of {limits.context} "
                         "tokens can hold")
    return content, boolean(body, "add_special")


def check_detokenize(body: dict, limits: RequestLimits) -> list:
    """/detokenize's `tokens`: ids in the vocabulary, at most a context of them."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    only_fields(body, ("tokens",))
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        fail("tokens", "must be a list of token ids")
    if len(tokens) > limits.context:
        fail("tokens", f"has {len(tokens)} ids, more than the context of {limits.context}")
    for i, t in enumerate(tokens):
        if not _is_int(t) or not 0 <= t < limits.vocab:
            fail(f"tokens[{i}]", f"must be a token id in 0..{limits.vocab - 1}")
    return tokens
