"""What a conversation may hold, checked once for every way one comes in: a chat
request to `deltafin-run serve`, a `messages` line of `batch` or `score`.

`chat_messages` returns the conversation as the chat templates take it: each
message with a role the templates know, its content as one string (OpenAI's list of
text parts joined; null is empty), tool calls as `{"type": "function", "function":
{"name", "arguments": {...}}}` with their arguments parsed, and only the keys below.
Anything else is refused naming the field: a part that is not text (before any I/O:
no URL a client names is fetched), a key no template reads, a value of the wrong
type, a lone surrogate, a name or list beyond its bound. The keys OpenAI's clients
echo back from a reply (`refusal`, `audio`, `annotations`, `function_call`) are
taken while empty, since they then carry nothing.
"""

import json

from deltafin_mlx.errors import RequestError

MAX_MESSAGES = 4096
MAX_NAME_CHARS = 256
ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning",
                "reasoning_content")
EMPTY_ECHOES = ("refusal", "audio", "annotations", "function_call")
TOOL_CALL_KEYS = ("id", "type", "function")
FUNCTION_KEYS = ("name", "arguments")


def fail(field: str, what: str):
    raise RequestError(f"{field}: {what}")


def text(v, field, max_chars=None, allow_empty=True) -> str:
    """A string of valid Unicode, at most `max_chars` long."""
    if not isinstance(v, str):
        fail(field, f"must be a string, not {type(v).__name__}")
    if not allow_empty and not v:
        fail(field, "must not be empty")
    if max_chars is not None and len(v) > max_chars:
        fail(field, f"is {len(v)} characters, more than {max_chars}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        fail(field, "holds a lone surrogate (not valid Unicode)")
    return v


def _known_keys(obj: dict, known, field: str, echoes=()):
    for key in obj:
        if key in known or (key in echoes and obj[key] in (None, [], "")):
            continue
        fail(field, f"unknown key {str(key)[:40]!r} (known: {', '.join(known)})")


def _objects(items: list, field: str):
    """(field name, item) of each item of a list of JSON objects."""
    for i, item in enumerate(items):
        f = f"{field}[{i}]"
        if not isinstance(item, dict):
            fail(f, "must be an object")
        yield f, item


def _content(v, field) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return text(v, field)
    if not isinstance(v, list):
        fail(field, "must be a string, a list of text parts or null")
    parts = []
    for f, part in _objects(v, field):
        kind = part.get("type")
        if kind != "text":
            # Refused before anything else is done with the conversation: no URL is
            # fetched and no image decoded.
            fail(f, f"content type {str(kind)[:40]!r} is not supported (this model takes "
                    "text only)")
        _known_keys(part, ("type", "text"), f)
        parts.append(text(part.get("text"), f + ".text"))
    return "".join(parts)


def _tool_calls(v, field) -> list:
    if not isinstance(v, list):
        fail(field, "must be a list")
    out = []
    for f, call in _objects(v, field):
        _known_keys(call, TOOL_CALL_KEYS, f)
        if call.get("type", "function") != "function":
            fail(f + ".type", 'must be "function"')
        fn = call.get("function")
        if not isinstance(fn, dict):
            fail(f + ".function", "must be an object")
        _known_keys(fn, FUNCTION_KEYS, f + ".function")
        name = text(fn.get("name"), f + ".function.name", MAX_NAME_CHARS, allow_empty=False)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                fail(f + ".function.arguments", "is not valid JSON")
        if not isinstance(args, dict):
            fail(f + ".function.arguments", "must be a JSON object")
        entry = {"type": "function", "function": {"name": name, "arguments": args}}
        if call.get("id") is not None:
            entry["id"] = text(call["id"], f + ".id", MAX_NAME_CHARS)
        out.append(entry)
    return out


def chat_messages(v) -> list:
    """The conversation `v` (a decoded JSON value) checked and in the templates'
    form, or RequestError naming the first field that is wrong."""
    if not isinstance(v, list) or not v:
        fail("messages", "must be a non-empty list of {\"role\", \"content\"} objects")
    if len(v) > MAX_MESSAGES:
        fail("messages", f"has {len(v)} entries, more than {MAX_MESSAGES}")
    out = []
    for f, m in _objects(v, "messages"):
        _known_keys(m, MESSAGE_KEYS, f, EMPTY_ECHOES)
        role = m.get("role")
        if role not in ROLES:
            fail(f + ".role", f"must be one of {', '.join(ROLES)}")
        entry = {"role": role, "content": _content(m.get("content"), f + ".content")}
        if m.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(m["tool_calls"], f + ".tool_calls")
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                entry[key] = text(m[key], f"{f}.{key}", MAX_NAME_CHARS)
        for key in ("reasoning", "reasoning_content"):
            if m.get(key) is not None:
                entry[key] = text(m[key], f"{f}.{key}")
        out.append(entry)
    return out
