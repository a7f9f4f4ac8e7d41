"""What `deltafin-run serve` checks of a body beyond the request itself: its
nesting, and the /tokenize and /detokenize endpoints' fields. A completion
body is checked by the one request rule (generation/request.py), the same a
`batch` line and the command line's flags go through, so a bad value is an HTTP
400 naming the field before anything reaches mlx-lm's generation thread.

`check_completion` returns the body as mlx-lm's handler should see it
(GenerationRequest.mlx_lm_body). Content parts other than text are refused
before any I/O: the model takes no images, and no URL a client names is ever
fetched.
"""

from deltafin_mlx.errors import RequestError
from deltafin_mlx.generation.request import (  # noqa: F401 - the drop-in's guard reads these here
    MAX_SEED, GenerationRequest, RequestLimits, boolean, integer, logit_bias, number, stops)
from deltafin_mlx.tokenizer.messages import fail, text
from deltafin_mlx.units import is_int

MAX_DEPTH = 32  # JSON nesting: messages > parts > tool calls > arguments > ...


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


def check_completion(body: dict, chat: bool, limits: RequestLimits) -> dict:
    """The checked fields of a chat (`chat`) or text completion body, for mlx-lm's
    own server (the drop-in), which scores no prompt."""
    request = read_completion(body, chat, limits)
    if request.scoring:
        fail("echo" if request.echo else "prompt_logprobs",
             "is deltafin-run serve's (mlx_lm.server does not score prompts)")
    return request.mlx_lm_body()


def read_completion(body: dict, chat: bool, limits: RequestLimits) -> GenerationRequest:
    """A chat (`chat`) or text completion body, checked by the one request rule."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    check_depth(body)
    return GenerationRequest.from_openai(body, chat, limits)


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
        if not is_int(t) or not 0 <= t < limits.vocab:
            fail(f"tokens[{i}]", f"must be a token id in 0..{limits.vocab - 1}")
    return tokens
