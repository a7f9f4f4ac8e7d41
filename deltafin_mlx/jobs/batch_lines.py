"""The lines of a batch job's input, read into requests in one canonical form.

Two line formats are read: Deltafin's own, `{"id": ..., "prompt": "..."}` or
`{"id": ..., "messages": [...]}`, and OpenAI's Batch format, `{"custom_id": ...,
"method": "POST", "url": "/v1/chat/completions", "body": {...}}` (or
`/v1/completions` with a `prompt`). Either way the request is checked by the one
request rule (generation/request.py), the one `serve` applies to the same body:
an OpenAI Batch line means what its body means at serve's endpoint of its `url`
(a /v1/completions prompt is text as it is, no chat template), and an own line
is such a body (every field serve takes, `temp` for `temperature`) whose
`prompt` is the user's message of a conversation (text as it is with --raw).
A line that is wrong in any way — not JSON, not UTF-8, too long, nested too deep,
an unknown key, a value out of range, a message or tool call of the wrong shape,
an unpaired surrogate — becomes a request that carries its error and is answered
by an error line; only duplicate ids stop the job before it starts.
"""

import json
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, List, Optional, Union

from deltafin_mlx.errors import JobError
from deltafin_mlx.generation.request import GenerationRequest, RequestLimits, unbounded
from deltafin_mlx.units import is_int

ALIASES = {"temp": "temperature"}  # Deltafin's own name, in its own lines
OPENAI_URLS = ("/v1/chat/completions", "/v1/completions")
OPENAI_LINE_KEYS = {"custom_id", "method", "url", "body"}


@dataclass
class Request:
    key: str  # the id as JSON text (ids may be strings or numbers)
    id: object
    line: int
    spec: dict = field(default_factory=dict)  # canonical: batch_spec's
    error: Optional[str] = None
    custom_id: bool = False  # the line was in OpenAI's Batch format


def read_requests(lines: Iterable[Union[str, bytes, None]],
                  spec_of: Optional[Callable[[dict], dict]] = None) -> List[Request]:
    """One Request per non-empty line (None stands for a line too long to read).
    A line without a usable id is kept as an error keyed by its line number;
    duplicate ids refuse the job. `spec_of` turns a line's object into the job's
    canonical spec or raises ValueError (default: a batch request's, `batch_spec`;
    a score job has its own keys)."""
    return list(iter_requests(lines, spec_of))


def iter_requests(lines: Iterable[Union[str, bytes, None]],
                  spec_of: Optional[Callable[[dict], dict]] = None) -> Iterator[Request]:
    """read_requests' Requests one at a time, holding only the ids seen (a job
    that streams its input reads it once through this to refuse duplicates before
    anything runs)."""
    seen = {}
    for n, text in enumerate(lines, 1):
        if text is not None and not text.strip():
            continue
        req = _read_line(n, text, spec_of or batch_spec)
        if req.id is not None:
            if req.key in seen:
                raise JobError(f"id {req.key} appears on lines {seen[req.key]} and {n}: ids "
                                 "must be unique (the output is matched to the input by id)")
            seen[req.key] = n
        yield req


def _read_line(n: int, text, spec_of) -> Request:
    def bad(why):
        return Request(f"line:{n}", None, n, error=f"line {n}: {why}")

    if text is None:
        return bad("longer than a request may be")
    try:
        spec = json.loads(text)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        return bad(f"not JSON ({type(e).__name__}: {str(e)[:200]})")
    openai = isinstance(spec, dict) and "custom_id" in spec and spec_of is batch_spec
    name = "custom_id" if openai else "id"
    if not isinstance(spec, dict) or not _is_id(spec.get(name)):
        return bad(f'not an object with an "{name}" (a string or an integer)')
    rid = spec[name]
    req = Request(json.dumps(rid), rid, n, custom_id=openai)
    try:
        _check_text(spec)
        req.spec = spec_of(spec)
    except ValueError as e:
        req.error = f"line {n}: {e}"
    return req


def batch_spec(spec: dict) -> dict:
    """A batch line's canonical spec, `{"id", "url", "body"}`: the request body of
    an OpenAI Batch line and its url, or an own line's keys but its id (url None),
    checked by the one request rule as far as that needs no model (`batch_request`
    checks the rest once the model is loaded)."""
    if "custom_id" in spec:
        out = _from_openai(spec)
    else:
        out = {"id": spec.get("id"), "url": None,
               "body": _renamed({k: v for k, v in spec.items() if k != "id"})}
    batch_request(out, unbounded())
    return out


def batch_request(spec: dict, limits: RequestLimits, raw: bool = False) -> GenerationRequest:
    """The GenerationRequest of a canonical spec, for a model's `limits`; `raw`:
    an own line's prompt is text as it is (--raw). RequestError names the field."""
    return GenerationRequest.from_batch_line(spec["body"], spec["url"], limits, raw=raw)


def _is_id(v) -> bool:
    if isinstance(v, str):
        return _encodable(v)
    return is_int(v)


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:  # an unpaired surrogate ("\ud800")
        return False


def _check_text(value, depth: int = 0):
    """Every string in a line is text: JSON's escapes can spell unpaired
    surrogates, which no tokenizer and no UTF-8 output can hold."""
    if depth > 64:
        raise ValueError("nested more than 64 levels deep")
    if isinstance(value, str):
        if not _encodable(value):
            raise ValueError("a string holds an unpaired surrogate (not text)")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, depth + 1)
            _check_text(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_text(v, depth + 1)


def _renamed(body: dict) -> dict:
    out = {}
    for k, v in body.items():
        name = ALIASES.get(k, k)
        if name in out:
            alias = next(a for a, n in ALIASES.items() if n == name)
            raise ValueError(f"both {name!r} and its alias {alias!r} given")
        out[name] = v
    return out


def _from_openai(spec: dict) -> dict:
    unknown = sorted(set(spec) - OPENAI_LINE_KEYS)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (a Batch API line has "
                         f"{', '.join(sorted(OPENAI_LINE_KEYS))})")
    if spec.get("method", "POST") != "POST":
        raise ValueError('"method" must be "POST"')
    url = spec.get("url", "/v1/chat/completions")
    if url not in OPENAI_URLS:
        raise ValueError(f'"url" must be one of {", ".join(sorted(OPENAI_URLS))} ({url!r})')
    body = spec.get("body")
    if not isinstance(body, dict):
        raise ValueError('"body" must be an object')
    return {"id": spec["custom_id"], "url": url, "body": dict(body)}
