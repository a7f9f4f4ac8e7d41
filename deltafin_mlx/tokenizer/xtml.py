"""Kimi K3's prompt format, XTML: a conversation rendered as the release's
`apply_chat_template` renders it.

A prompt is a list of (text, is_markup) pieces: markup is encoded with special
tokens allowed, everything else (message content, tag names, attributes) as
plain text, so no content can forge a turn boundary. The layout follows the
release's `encoding_k3.build_chat_segments`.
"""

import json

# XTML, K3's prompt markup: <|open|>tag attr="v"<|sep|> ... <|close|>tag<|sep|>.
XTML_OPEN = "<|open|>"
XTML_CLOSE = "<|close|>"
XTML_SEP = "<|sep|>"
XTML_END_OF_MSG = "<|end_of_msg|>"
XTML_THINKING_EFFORTS = ("low", "high", "max")


def _escape_attr(value):
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open_tag(tag, attrs=()):
    pieces = [(XTML_OPEN, True), (tag, False)]
    pieces += [(f' {key}="{_escape_attr(value)}"', False) for key, value in attrs]
    return pieces + [(XTML_SEP, True)]


def _close_tag(tag):
    return [(XTML_CLOSE, True), (tag, False), (XTML_SEP, True)]


def _message(attrs, body):
    return _open_tag("message", attrs) + body + _close_tag("message") + [(XTML_END_OF_MSG, True)]


def _content(content):
    """A message's content, a string or a list of text parts, as plain text."""
    if content is None:
        return []
    if isinstance(content, str):
        return [(content, False)]
    pieces = []
    for part in content:
        if part.get("type") in ("image", "image_url"):
            raise ValueError("images in Kimi K3 prompts are not supported")
        pieces.append((part["text"], False))
    return pieces


def _system_notice(kind, body):
    # The release's "internal system message", e.g. the thinking effort.
    return _message([("role", "system"), ("type", kind)], [(body.strip(), False)])


def _tool_declaration(tools, dynamic=False):
    schema = json.dumps(tools, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    if dynamic:
        intro = ("## New Tools Available\n"
                 "The system dynamically extends the toolset via lazy-loading.\n"
                 "You have access to all existing and extended tools.\n"
                 "Here are the specs for the extended tools.\n\n")
    else:
        intro = "# Tools\nHere are the available tools, described in JSONSchema.\n\n"
    return _system_notice("tool-declare", f"{intro}```json\n{schema}\n```")


def _function(call):
    # OpenAI nests name and arguments under "function"; bare calls are accepted.
    return call.get("function", call)


def _xtml_type(value):
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, dict):
        return "object"
    return "array"


def _tool_call(call, index):
    function = _function(call)
    arguments = function.get("arguments")
    pieces = _open_tag("call", [("tool", function["name"]), ("index", index)])
    if isinstance(arguments, str) and arguments.strip():
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            # Arguments that are not JSON are carried verbatim in a json block.
            json_block = _open_tag("json", [("type", "object")])
            json_block += [(function["arguments"], False)] + _close_tag("json")
            return pieces + json_block + _close_tag("call")
        if not isinstance(arguments, dict):
            raise ValueError("Kimi K3 tool call arguments must be a JSON object")
    elif arguments is None or isinstance(arguments, str):
        arguments = {}
    elif not isinstance(arguments, dict):
        raise ValueError("Kimi K3 tool call arguments must be a dict or a JSON string")
    for key, value in arguments.items():
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        pieces += _open_tag("argument", [("key", key), ("type", _xtml_type(value))])
        pieces += [(text, False)] + _close_tag("argument")
    return pieces + _close_tag("call")


def _assistant_body(message, thinking, finished=True):
    body = []
    if thinking:
        # The thinking channel is kept in history, empty if there is none.
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        body += _open_tag("think")
        if reasoning is not None and str(reasoning).strip():
            body.append((str(reasoning), False))
        body += _close_tag("think")
    body += _open_tag("response") + _content(message.get("content"))
    if not finished:
        return body
    body += _close_tag("response")
    calls = message.get("tool_calls") or []
    if calls:
        body += _open_tag("tools")
        for index, call in enumerate(calls, start=1):
            body += _tool_call(call, index)
        body += _close_tag("tools")
    return body


def _order_tool_results(messages):
    """Put each run of tool results in the order of the calls they answer.

    When every result of a run names a call of the last assistant turn (by
    `tool_call_id`), the run is sorted by call and each result takes the
    called tool's name; otherwise the run is kept as it is.
    """
    ordered, calls, i = [], {}, 0
    while i < len(messages):
        message = messages[i]
        if message.get("role") != "tool":
            if message.get("role") == "assistant":
                calls = {}
                for position, call in enumerate(message.get("tool_calls") or [], 1):
                    if call.get("id") is not None:
                        name = _function(call).get("name")
                        calls.setdefault(str(call["id"]), (position, name))
            ordered.append(message)
            i += 1
            continue
        run = []
        while i < len(messages) and messages[i].get("role") == "tool":
            run.append(messages[i])
            i += 1
        call_ids = [m.get("tool_call_id", m.get("id")) for m in run]
        answered = [calls.get(str(c)) if c is not None else None for c in call_ids]
        if all(answered):
            run = [{**m, "tool": name} if name is not None else m
                   for m, (_, name) in zip(run, answered)]
            order = sorted(range(len(run)), key=lambda k: answered[k][0])
            run = [run[k] for k in order]
        ordered += run
    return ordered


def render_xtml_chat(messages, tools=None, *, add_generation_prompt=True, thinking=True,
                     thinking_effort=None, continue_final_message=False, starts=None):
    """A conversation as K3 prompt pieces: a list of (text, is_markup).

    A turn is `<|open|>message role="user"<|sep|>` + content +
    `<|close|>message<|sep|><|end_of_msg|>`; an assistant turn's body is
    `<|open|>response<|sep|>` + content + `<|close|>response<|sep|>`, after
    its thinking channel `<|open|>think<|sep|>...<|close|>think<|sep|>` when
    thinking is on. The generation prompt opens an assistant turn and its
    think (or, with thinking off, response) channel. With
    continue_final_message the last (assistant) turn is left open instead.

    `starts`, a list, gets the index of the piece each message's rendering starts
    at (messages in the order rendered: a run of tool results in the order of the
    calls it answers), then the index where the generation prompt starts. Each
    message renders the same whatever follows it, so the conversation up to any
    message is those pieces (KimiTokenizer.render_turns renders a conversation once).
    """
    if thinking and thinking_effort is not None and thinking_effort not in XTML_THINKING_EFFORTS:
        raise ValueError(f"unsupported thinking_effort={thinking_effort!r}; "
                         f"use one of {', '.join(XTML_THINKING_EFFORTS)}")
    if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
        raise ValueError("continue_final_message needs a final assistant message")
    messages = _order_tool_results(messages)
    pieces = []
    if tools:
        pieces += _tool_declaration(tools)
    if thinking and thinking_effort is not None:
        pieces += _system_notice(
            "thinking-effort", "`thinking_effort` guides on how much to think in your thinking "
            "channel (not including the response channel), supported values "
            "include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={thinking_effort}`.")
    calls, tool_index = [], 0
    for n, message in enumerate(messages):
        if starts is not None:
            starts.append(len(pieces))
        role = message["role"]
        attrs = [("role", role)]
        if message.get("name") and role in ("user", "system"):
            attrs.append(("name", message["name"]))
        if role == "system" and message.get("tools"):
            pieces += _tool_declaration(message["tools"], dynamic=True)
        elif role in ("user", "system"):
            pieces += _message(attrs, _content(message.get("content")))
        elif role == "assistant" and continue_final_message and n == len(messages) - 1:
            pieces += _open_tag("message", attrs)
            pieces += _assistant_body(message, thinking, finished=False)
        elif role == "assistant":
            calls, tool_index = message.get("tool_calls") or [], 0
            pieces += _message(attrs, _assistant_body(message, thinking))
        elif role == "tool":
            tool_index += 1
            tool = message.get("tool", message.get("name"))
            if tool is None and tool_index <= len(calls):
                tool = _function(calls[tool_index - 1])["name"]
            if tool is None:
                raise ValueError("a tool message needs the name of its tool")
            attrs = [("role", "tool"), ("tool", tool), ("index", tool_index)]
            pieces += _message(attrs, _content(message.get("content")))
        else:
            raise ValueError(f"Kimi K3 prompts have no role {role!r}")
    if starts is not None:
        starts.append(len(pieces))
    if add_generation_prompt and not continue_final_message:
        pieces += _open_tag("message", [("role", "assistant")])
        pieces += _open_tag("think" if thinking else "response")
    return pieces
