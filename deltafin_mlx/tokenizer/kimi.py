"""Kimi's tiktoken tokenizer for mlx-lm, and Kimi K3's XTML prompt format.

Kimi checkpoints (K2, K3, Kimi-Linear) ship no `tokenizer.json`: the
vocabulary is `tiktoken.model`, the special tokens are in
`tokenizer_config.json`, and the rest is Python in the checkpoint
(`tokenization_kimi.py`, and for K3 `encoding_k3.py`) that transformers only
runs with `trust_remote_code`. This module reads the two data files itself,
so a Kimi model loads without executing code from the checkpoint, and renders
K3's prompts the way the release's `apply_chat_template` does.
"""

import base64
import codecs
import json
import shutil
from collections import Counter
from functools import cached_property, lru_cache
from pathlib import Path

import regex
import tiktoken
from mlx_lm.tokenizer_utils import StreamingDetokenizer, TokenizerWrapper
from deltafin_mlx.errors import TemplateLimit, TokenizerError

# The pre-tokenizer of K2, K3 and Kimi-Linear, as `tokenization_kimi.py` has it.
# `&&` is a character-class intersection (letters that are not Han), which
# tiktoken's regex engine accepts as written.
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Every Kimi release reserves 256 special ids right after the BPE ranks.
NUM_RESERVED_SPECIAL_TOKENS = 256

# Named specials by offset from the first special id (163584 in the releases).
K3_SPECIAL_TOKENS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    254: "[UNK]",
    255: "[PAD]",
}
K2_SPECIAL_TOKENS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}

# Kimi K2's chat template as released (moonshotai/Kimi-K2-Instruct, July 2025).
K2_CHAT_TEMPLATE = """\
{% if tools -%}
    {{ '<|im_system|>tool_declare<|im_middle|>' -}}
    {{- tools | tojson -}}
    {{ '<|im_end|>' -}}
{%- endif -%}

{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    {{ '<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>' }}
  {%- endif -%}
  {%- if message['role'] == 'system' -%}
    {{ '<|im_system|>system<|im_middle|>' }}
  {%- elif message['role'] == 'user' -%}
    {{ '<|im_user|>user<|im_middle|>' }}
  {%- elif message['role'] == 'assistant' -%}
    {{ '<|im_assistant|>assistant<|im_middle|>' }}
  {%- elif message['role'] == 'tool' -%}
    {{ '<|im_system|>tool<|im_middle|>' }}
  {%- endif -%}

  {%- if message['content'] is string -%}
    {{- message['content'] + '<|im_end|>' -}}
  {%- else -%}
    {%- for content in message['content'] -%}
      {%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}
        {{ '<|media_start|>image<|media_content|><|media_pad|><|media_end|>' }}
      {%- else -%}
        {{ content['text'] }}
      {%- endif -%}
    {%- endfor -%}
    {{ '<|im_end|>' }}
  {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
  {{ '<|im_assistant|>assistant<|im_middle|>' }}
{%- endif -%}"""

# XTML, K3's prompt markup: <|open|>tag attr="v"<|sep|> ... <|close|>tag<|sep|>.
XTML_OPEN = "<|open|>"
XTML_CLOSE = "<|close|>"
XTML_SEP = "<|sep|>"
XTML_END_OF_MSG = "<|end_of_msg|>"
XTML_THINKING_EFFORTS = ("low", "high", "max")


def read_tiktoken_ranks(path, data: bytes = None):
    """Read a `tiktoken.model` file: one `base64(bytes) rank` line per token.

    Every line is checked: a malformed line, bad base64, an empty token, a token
    or a rank given twice, or a gap in the ranks is refused (tiktoken itself
    would loop, panic or silently merge differently)."""
    # Not tiktoken.load.load_tiktoken_bpe: it caches files by path in a temp
    # folder and would keep serving an old vocabulary after the file changes.
    if data is None:
        data = Path(path).read_bytes()
    ranks, seen_ranks = {}, set()
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(f"{path}: line {n} is not 'base64-token rank'")
        try:
            token = base64.b64decode(parts[0], validate=True)
        except ValueError:
            raise TokenizerError(f"{path}: line {n}: bad base64 {parts[0][:40]!r}") from None
        if not parts[1].isdigit():
            raise TokenizerError(f"{path}: line {n}: rank {parts[1][:40]!r} is not a number")
        rank = int(parts[1])
        if not token:
            raise TokenizerError(f"{path}: line {n}: empty token (rank {rank})")
        if token in ranks:
            raise TokenizerError(f"{path}: line {n}: token {token[:40]!r} appears twice "
                                 f"(ranks {ranks[token]} and {rank})")
        if rank in seen_ranks:
            raise TokenizerError(f"{path}: line {n}: rank {rank} is given twice")
        ranks[token] = rank
        seen_ranks.add(rank)
    if not ranks:
        raise TokenizerError(f"{path}: no tokens")
    if max(seen_ranks) != len(ranks) - 1:
        missing = min(set(range(len(ranks))) - seen_ranks)
        raise TokenizerError(f"{path}: ranks are not 0..{len(ranks) - 1} (rank {missing} "
                             "is missing)")
    return ranks


def read_special_tokens(config, num_base_tokens, mergeable_ranks=None):
    """Name -> id for the whole reserved range, named as `added_tokens_decoder` says.

    Unnamed ids are `<|reserved_token_{id}|>`, as in the release's tokenizer.
    A special token must be a non-empty string (an empty one makes tiktoken's
    special-token pattern match everywhere: every encode loops forever), name one
    id only, and not be an ordinary token's bytes.
    """
    first, end = num_base_tokens, num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS
    names = {}
    added = config.get("added_tokens_decoder", {})
    if not isinstance(added, dict):
        raise TokenizerError("added_tokens_decoder must be an object")
    for key, entry in added.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise TokenizerError(f"added token id {key!r:.40} is not a number")
        if not first <= int(key) < end:
            # A config for another vocabulary size: every id would be wrong.
            raise TokenizerError(
                f"added token {key} is outside the special ids {first}..{end - 1}"
            )
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not content:
            raise TokenizerError(f"added token {key} has content {content!r:.60}; a special "
                                 "token must be a non-empty string")
        names[int(key)] = content
    by_name = {}
    for i in range(first, end):
        name = names.get(i, f"<|reserved_token_{i}|>")
        if name in by_name:
            raise TokenizerError(f"special token {name!r:.60} names two ids, {by_name[name]} "
                                 f"and {i}")
        if mergeable_ranks is not None and name.encode() in mergeable_ranks:
            raise TokenizerError(f"special token {name!r:.60} (id {i}) is also ordinary token "
                                 f"{mergeable_ranks[name.encode()]}")
        by_name[name] = i
    return by_name


def kimi_encoding(mergeable_ranks, special_tokens, name="kimi"):
    try:
        return tiktoken.Encoding(
            name,
            pat_str=KIMI_PATTERN,
            mergeable_ranks=mergeable_ranks,
            special_tokens=special_tokens,
        )
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # tiktoken's Rust panics are BaseExceptions (pyo3)
        raise TokenizerError(f"tiktoken refused the vocabulary ({type(e).__name__}: "
                             f"{str(e)[:200]})") from None


@lru_cache(maxsize=1)
def _bytes_to_unicode():
    """GPT-2's byte -> printable character table, used for token strings."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def _token_content(value):
    # tokenizer_config.json holds a special token as a string or as an
    # AddedToken dict.
    return value.get("content") if isinstance(value, dict) else value


def _split_long_runs(text, max_run=25_000):
    """Split text so no piece has a run of over max_run spaces or non-spaces.

    tiktoken's regex can blow its stack on very long runs
    (github.com/openai/tiktoken/issues/195); the release splits the same way.
    """
    if len(text) <= max_run:
        yield text
        return
    start, run, run_is_space = 0, 0, text[0].isspace()
    for i, char in enumerate(text):
        is_space = char.isspace()
        if is_space != run_is_space:
            run, run_is_space = 1, is_space
            continue
        run += 1
        if run > max_run:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]


class KimiTokenizer:
    """What mlx-lm uses of a Hugging Face tokenizer, over a tiktoken Encoding."""

    # Read by `mlx_lm.server --use-default-chat-template`.
    default_chat_template = None

    def __init__(self, encoding, config, name_or_path=""):
        self.encoding = encoding
        self.init_kwargs = config
        self.name_or_path = str(name_or_path)
        # name -> id for every reserved id, named or not
        self.special_tokens = {
            name: encoding.encode_single_token(name)
            for name in encoding.special_tokens_set
        }
        self.chat_template = config.get("chat_template")
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        added = config.get("added_tokens_decoder", {})
        self.all_special_ids = sorted(
            i
            for i in self.special_tokens.values()
            if added.get(str(i), {}).get("special", True)
        )
        self._special_ids = set(self.all_special_ids)

    @property
    def bos_token_id(self):
        return self.special_tokens.get(self.bos_token)

    @property
    def eos_token_id(self):
        return self.special_tokens.get(self.eos_token)

    @property
    def pad_token_id(self):
        return self.special_tokens.get(self.pad_token)

    @property
    def unk_token_id(self):
        return self.special_tokens.get(self.unk_token)

    @property
    def all_special_tokens(self):
        return [self.convert_ids_to_tokens(i) for i in self.all_special_ids]

    @property
    def is_xtml(self):
        """True for K3's prompt format, as mlx-lm's tokenizer_utils decides it."""
        markers = (XTML_OPEN, XTML_CLOSE, XTML_SEP, XTML_END_OF_MSG)
        return all(m in self.special_tokens for m in markers)

    @property
    def vocab_size(self):
        return self.encoding.n_vocab

    def __len__(self):
        return self.encoding.n_vocab

    @cached_property
    def token_bytes(self):
        """The bytes of every token id; a special token's are its name's."""
        return [
            self.encoding.decode_single_token_bytes(i)
            for i in range(self.encoding.n_vocab)
        ]

    @cached_property
    def _token_strings(self):
        # Byte-level strings as the release's tokenizer (and GPT-2) spells
        # them; special tokens keep their names.
        byte_char = _bytes_to_unicode()
        names = {i: name for name, i in self.special_tokens.items()}
        return [
            names.get(i) or "".join(byte_char[b] for b in token)
            for i, token in enumerate(self.token_bytes)
        ]

    @cached_property
    def vocab(self):
        return {token: i for i, token in enumerate(self._token_strings)}

    def get_vocab(self):
        return self.vocab

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        if isinstance(ids, int):
            return self._token_strings[ids]
        return [
            self._token_strings[i]
            for i in ids
            if not (skip_special_tokens and i in self._special_ids)
        ]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.vocab.get(tokens, self.unk_token_id)
        return [self.vocab.get(t, self.unk_token_id) for t in tokens]

    def _encode(self, text, allow_special):
        ids = []
        # The release encodes at most 400k characters per tiktoken call.
        for i in range(0, len(text), 400_000):
            for piece in _split_long_runs(text[i : i + 400_000]):
                if allow_special:
                    ids += self.encoding.encode(piece, allowed_special="all")
                else:
                    # Special token text is ordinary text here.
                    ids += self.encoding.encode_ordinary(piece)
        return ids

    def encode(
        self, text, add_special_tokens=True, allow_special_tokens=True, **kwargs
    ):
        """Encode text; special token names in it become special tokens.

        That is what Hugging Face tokenizers do, and what mlx-lm relies on
        when it encodes a rendered prompt or a stop word. Kimi adds no BOS
        or EOS, so add_special_tokens changes nothing.
        """
        return self._encode(text, allow_special_tokens)

    def decode(self, token_ids, skip_special_tokens=False, **kwargs):
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if skip_special_tokens:
            token_ids = [i for i in token_ids if i not in self._special_ids]
        return self.encoding.decode(token_ids)

    def apply_chat_template(
        self,
        conversation,
        tools=None,
        tokenize=True,
        add_generation_prompt=True,
        thinking=True,
        continue_final_message=False,
        return_dict=False,
        **kwargs,
    ):
        """Render a conversation as a prompt: token ids, or text if not tokenize.

        K3 (XTML) prompts are rendered in code, as the release does; other
        Kimi models use the Jinja `chat_template` of tokenizer_config.json.
        `enable_thinking` is accepted for `thinking`; other keyword arguments
        are K3's `thinking_effort` or go to the Jinja template.
        """
        thinking = kwargs.pop("enable_thinking", thinking)
        if self.is_xtml:
            # The release's apply_chat_template defaults the effort to max;
            # pass thinking_effort=None to leave the effort message out.
            pieces = render_xtml_chat(
                conversation,
                tools,
                add_generation_prompt=add_generation_prompt,
                thinking=thinking,
                thinking_effort=kwargs.get("thinking_effort", "max"),
                continue_final_message=continue_final_message,
            )
            if not tokenize:
                return "".join(text for text, _ in pieces)
            # Piece by piece: only markup may become special tokens.
            ids = [i for text, markup in pieces for i in self._encode(text, markup)]
        elif self.chat_template is not None:
            text = render_jinja_chat(
                self.chat_template,
                conversation,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                thinking=thinking,
                continue_final_message=continue_final_message,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
            )
            if not tokenize:
                return text
            ids = self.encode(text)
        else:
            raise ValueError(f"{self.name_or_path}: the tokenizer has no chat template")
        if return_dict:
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        return ids

    def save_pretrained(self, path):
        """Copy the tokenizer's files (and the release's code, if present)."""
        source, path = Path(self.name_or_path), Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if source.resolve() == path.resolve():
            return
        for name in (
            "tiktoken.model",
            "tokenizer_config.json",
            "tokenization_kimi.py",
            "encoding_k3.py",
        ):
            if (source / name).is_file():
                shutil.copyfile(source / name, path / name)


class KimiStreamingDetokenizer(StreamingDetokenizer):
    """Streams text at the byte level.

    A character whose UTF-8 bytes are split across tokens is held back until
    it is complete, and the text always equals `decode(tokens)` once finalized.
    """

    def __init__(self, tokenizer):
        self._token_bytes = tokenizer.token_bytes
        self.reset()

    def reset(self):
        self.offset = 0
        self.text = ""
        self.tokens = []
        # tiktoken decodes with errors="replace"; so does this decoder, but it
        # keeps the bytes of an unfinished character until the next token.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add_token(self, token):
        self.tokens.append(token)
        self.text += self._utf8.decode(self._token_bytes[token])

    def finalize(self):
        self.text += self._utf8.decode(b"", final=True)


# K3 prompts. A prompt is a list of (text, is_markup) pieces: markup is
# encoded with special tokens allowed, everything else (message content, tag
# names, attributes) as plain text, so no content can forge a turn boundary.
# The layout follows the release's `encoding_k3.build_chat_segments`.


def _escape_attr(value):
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def _open_tag(tag, attrs=()):
    pieces = [(XTML_OPEN, True), (tag, False)]
    pieces += [(f' {key}="{_escape_attr(value)}"', False) for key, value in attrs]
    return pieces + [(XTML_SEP, True)]


def _close_tag(tag):
    return [(XTML_CLOSE, True), (tag, False), (XTML_SEP, True)]


def _message(attrs, body):
    return (
        _open_tag("message", attrs)
        + body
        + _close_tag("message")
        + [(XTML_END_OF_MSG, True)]
    )


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
    schema = json.dumps(
        tools, ensure_ascii=False, separators=(",", ":"), sort_keys=True
    )
    if dynamic:
        intro = (
            "## New Tools Available\n"
            "The system dynamically extends the toolset via lazy-loading.\n"
            "You have access to all existing and extended tools.\n"
            "Here are the specs for the extended tools.\n\n"
        )
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
        text = (
            value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        )
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
            run = [
                {**m, "tool": name} if name is not None else m
                for m, (_, name) in zip(run, answered)
            ]
            order = sorted(range(len(run)), key=lambda k: answered[k][0])
            run = [run[k] for k in order]
        ordered += run
    return ordered


def render_xtml_chat(
    messages,
    tools=None,
    *,
    add_generation_prompt=True,
    thinking=True,
    thinking_effort=None,
    continue_final_message=False,
):
    """A conversation as K3 prompt pieces: a list of (text, is_markup).

    A turn is `<|open|>message role="user"<|sep|>` + content +
    `<|close|>message<|sep|><|end_of_msg|>`; an assistant turn's body is
    `<|open|>response<|sep|>` + content + `<|close|>response<|sep|>`, after
    its thinking channel `<|open|>think<|sep|>...<|close|>think<|sep|>` when
    thinking is on. The generation prompt opens an assistant turn and its
    think (or, with thinking off, response) channel. With
    continue_final_message the last (assistant) turn is left open instead.
    """
    if thinking and thinking_effort is not None:
        if thinking_effort not in XTML_THINKING_EFFORTS:
            raise ValueError(
                f"unsupported thinking_effort={thinking_effort!r}; "
                f"use one of {', '.join(XTML_THINKING_EFFORTS)}"
            )
    if continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
        raise ValueError("continue_final_message needs a final assistant message")
    messages = _order_tool_results(messages)
    pieces = []
    if tools:
        pieces += _tool_declaration(tools)
    if thinking and thinking_effort is not None:
        pieces += _system_notice(
            "thinking-effort",
            "`thinking_effort` guides on how much to think in your thinking "
            "channel (not including the response channel), supported values "
            "include `low`, `medium`, `high`, and `max`.\n"
            f"Now the system is invoked with `thinking_effort={thinking_effort}`.",
        )
    calls, tool_index = [], 0
    for n, message in enumerate(messages):
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
    if add_generation_prompt and not continue_final_message:
        pieces += _open_tag("message", [("role", "assistant")])
        pieces += _open_tag("think" if thinking else "response")
    return pieces


# Jinja templates (K2), rendered as transformers does.


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _raise_exception(message):
    raise ValueError(message)


# A chat template comes with the model: it runs sandboxed (no attribute access to
# Python internals), and within bounds of time and output size, so a template
# that loops or grows without end is an error, not a hang.
JINJA_MAX_TEMPLATE_CHARS = 1 << 20
JINJA_MAX_OUTPUT_CHARS = 16 << 20
JINJA_MAX_SECONDS = 10.0
JINJA_MAX_RANGE = 100_000


def _sandbox_class():
    import threading
    import time

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    deadline = threading.local()

    def check():
        if time.monotonic() > getattr(deadline, "at", float("inf")):
            raise TemplateLimit(f"the chat template ran over {JINJA_MAX_SECONDS:.0f} s")

    def bounded_range(*args):
        r = range(*args)
        if len(r) > JINJA_MAX_RANGE:
            raise TemplateLimit(f"the chat template asked for a range of {len(r)} numbers")
        for i in r:
            check()
            yield i

    class Sandbox(ImmutableSandboxedEnvironment):
        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's names)
            check()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            check()
            return super().getattr(obj, attribute)

        # "a" * 10**10 would allocate before any check could run.
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            check()
            if operator == "**" and (not isinstance(right, (int, float)) or abs(right) > 64):
                raise TemplateLimit("the chat template raises to a power over 64")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if (isinstance(seq, (str, list, tuple)) and isinstance(n, int)
                            and len(seq) * n > JINJA_MAX_OUTPUT_CHARS):
                        raise TemplateLimit("the chat template repeats a value past "
                                            f"{JINJA_MAX_OUTPUT_CHARS} items")
            return super().call_binop(context, operator, left, right)

    Sandbox.deadline = deadline
    Sandbox.bounded_range = staticmethod(bounded_range)
    return Sandbox


@lru_cache(maxsize=4)
def _compile_jinja(template):
    if not isinstance(template, str):
        raise TemplateLimit("the chat template is not a string")
    if len(template) > JINJA_MAX_TEMPLATE_CHARS:
        raise TemplateLimit(f"the chat template is {len(template)} characters long")
    sandbox = _sandbox_class()
    env = sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["range"] = sandbox.bounded_range
    return env, env.from_string(template)


def render_jinja_chat(template, messages, continue_final_message=False, **context):
    import time

    env, compiled = _compile_jinja(template)
    env.deadline.at = time.monotonic() + JINJA_MAX_SECONDS
    pieces, size = [], 0
    try:
        for piece in compiled.generate(messages=messages, **context):
            size += len(piece)
            if size > JINJA_MAX_OUTPUT_CHARS:
                raise TemplateLimit(f"the chat template's output passed "
                                    f"{JINJA_MAX_OUTPUT_CHARS} characters")
            if time.monotonic() > env.deadline.at:
                raise TemplateLimit(f"the chat template ran over {JINJA_MAX_SECONDS:.0f} s")
            pieces.append(piece)
    finally:
        env.deadline.at = float("inf")
    text = "".join(pieces)
    if continue_final_message:
        # As transformers does: cut the text after the final message's content.
        final = messages[-1]["content"]
        if not isinstance(final, str):
            final = final[-1]["text"]
        final = final.strip()
        text = text[: text.rindex(final) + len(final)]
    return text


def is_kimi_tokenizer(model_dir):
    return (Path(model_dir) / "tiktoken.model").is_file()


def _config_eos_token_ids(model_dir):
    # The stop token of a chat turn (K3's <|end_of_msg|>) is the model
    # config's eos, not the tokenizer's.
    from deltafin_mlx.format.integrity import CONFIG_MAX_BYTES, read_inside

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(read_inside(model_dir, "config.json", CONFIG_MAX_BYTES))
    return config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))


def _tool_parser(tokenizer):
    if tokenizer.is_xtml:
        return "kimi_k3"
    if "<|tool_calls_section_begin|>" in (tokenizer.chat_template or ""):
        return "kimi_k2"
    return None


def load_kimi_tokenizer(model_dir, eos_token_ids=None):
    """Load a Kimi tokenizer as an mlx-lm TokenizerWrapper.

    eos_token_ids (an id or a list) are stop tokens besides the tokenizer's
    eos; by default they are read from the model's config.json, if any.
    """
    from deltafin_mlx.format.integrity import TOKENIZER_MAX_BYTES, read_inside

    model_dir = Path(model_dir)
    cpath = model_dir / "tokenizer_config.json"
    try:
        config = json.loads(read_inside(model_dir, cpath.name, TOKENIZER_MAX_BYTES))
    except (ValueError, RecursionError) as e:
        raise TokenizerError(f"{cpath}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{cpath}: not a JSON object")
    tpath = model_dir / "tiktoken.model"
    ranks = read_tiktoken_ranks(tpath, read_inside(model_dir, tpath.name, TOKENIZER_MAX_BYTES))
    try:
        special_tokens = read_special_tokens(config, len(ranks), ranks)
    except TokenizerError as e:
        raise TokenizerError(f"{cpath}: {e}") from None
    encoding = kimi_encoding(ranks, special_tokens, name=model_dir.name or "kimi")
    tokenizer = KimiTokenizer(encoding, config, name_or_path=model_dir)

    if eos_token_ids is None:
        eos_token_ids = _config_eos_token_ids(model_dir)
    if isinstance(eos_token_ids, int):
        eos_token_ids = [eos_token_ids]

    tool_kwargs = {}
    parser = _tool_parser(tokenizer)
    if parser is not None:
        from importlib import import_module

        module = import_module(f"mlx_lm.tool_parsers.{parser}")
        tool_kwargs = dict(
            tool_parser=module.parse_tool_call,
            tool_call_start=module.tool_call_start,
            tool_call_end=module.tool_call_end,
        )
    return TokenizerWrapper(
        tokenizer,
        KimiStreamingDetokenizer,
        eos_token_ids=eos_token_ids,
        **tool_kwargs,
    )


# A small, format-faithful Kimi tokenizer for tests: the real files' layout
# and special ids (shifted down to follow 768 ranks), a vocabulary learned
# from the text below.

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog doesn't mind; it's
sleeping in the sun, and the fox is running through the forest again.
Mixture-of-experts models route every token to a few experts, so only a
small part of the weights is read for each token that the model generates.
We'll stream the experts from disk when they're needed and keep the rest of
the model in memory. Streaming, routing, reading, and caching: the model is
exact, and the results are the same as with all of the weights in memory.
Kimi K3 has 93 layers, 896 routed experts, 16 experts per token, and a
vocabulary of 163840 tokens; its context is 1048576 tokens long.
In 2024 and 2025 the numbers were 1, 2, 3, 10, 20, 30, 100, 200, 300, 123,
456, 789, 1000, 2048, 4096, 8192, 65536 and 3.14159; call 555-0123 at 09:30.

我们的模型从磁盘流式读取专家，只在需要的时候读取。模型很大，但是内存很小。
每个词元只会路由到少数几个专家，所以每一步只需要读取一小部分权重。
今天天气很好，我们一起去公园散步吧。中文、日本語和English可以混在一起写。
人工智能正在改变世界，语言模型可以写代码、翻译文章、回答问题。
北京、上海、广州和深圳都是中国的大城市。我们的模型在中国和世界各地都有用户。

Emoji: 🚀 launch, 🎉 party, 😀 smile, 👍 ok, ❤️ love, 🌍 world, 🔥 fire.
🚀🚀🚀 🎉🎉 😀😀 Unicode: café, naïve, résumé, Ünïcödé, Привет мир, Ελληνικά.

def route(scores, k=16):
    \"\"\"Return the top-k experts for each token.\"\"\"
    top = sorted(range(len(scores)), key=lambda i: -scores[i])[:k]
    return [(i, scores[i]) for i in top]

for layer in range(1, 93):
    experts = route(gate(hidden[layer]), k=16)
    if not experts:
        raise ValueError(f"layer {layer} has no experts")
    print(f"layer={layer} experts={len(experts)}")

{"model_type": "kimi_k3", "vocab_size": 163840, "num_experts": 896}
x += 1; y -= 2; z *= 3; return x == y and y != z || a <= b && c >= d;
"""


def _byte_pair_merge(parts, ranks):
    """tiktoken's BPE: merge the lowest-ranked adjacent pair until none is left."""
    while True:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            return parts
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


@lru_cache(maxsize=1)
def _learn_kimi_ranks(num_merges=512):
    """256 byte ranks, then num_merges merges learned from _TRAINING_TEXT.

    Words are split by KIMI_PATTERN, and after each merge they are encoded
    again the way tiktoken encodes (the new rank is the highest, so this only
    continues the last encoding), so every learned token is reachable: BPE on
    its own bytes ends in that one token.
    """
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(regex.findall(KIMI_PATTERN, _TRAINING_TEXT, flags=regex.V1))
    words = {tuple(bytes([b]) for b in w.encode()): n for w, n in words.items()}
    for _ in range(num_merges):
        pairs = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            raise ValueError("the training text is too short for the merges")
        # Most frequent first; ties by bytes, so the result is deterministic.
        best = min(pairs, key=lambda p: (-pairs[p], p))
        token = best[0] + best[1]
        ranks[token] = len(ranks)
        words = {
            tuple(_byte_pair_merge(list(w), ranks)) if _can_merge(w, token) else w: n
            for w, n in words.items()
        }
    return ranks


def _can_merge(word, token):
    # By bytes, as tiktoken merges: another split of the token's bytes counts.
    return any(a + b == token for a, b in zip(word, word[1:]))


def write_kimi_tokenizer_files(out_dir, flavor="k3"):
    """Write a small Kimi tokenizer (tiktoken.model, tokenizer_config.json).

    768 BPE ranks, then the 256 reserved special ids with the release's names
    at the release's offsets ("k3": XTML markers; "k2": K2's chat tokens and
    its Jinja chat template). Returns the vocabulary size, 1024.
    """
    if flavor not in ("k3", "k2"):
        raise ValueError(f"unknown flavor {flavor!r}; use 'k3' or 'k2'")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = _learn_kimi_ranks()
    lines = [
        f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()
    ]
    (out_dir / "tiktoken.model").write_text("".join(lines))

    first = len(ranks)
    names = K3_SPECIAL_TOKENS if flavor == "k3" else K2_SPECIAL_TOKENS
    added_tokens = {
        str(first + offset): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, name in names.items()
    }
    config = {
        "added_tokens_decoder": added_tokens,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": (
            1048576 if flavor == "k3" else 1000000000000000019884624838656
        ),
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }
    if flavor == "k2":
        config["additional_special_tokens"] = [
            "<|im_end|>",
            "<|im_user|>",
            "<|im_assistant|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "[EOT]",
            "<|im_system|>",
            "<|im_middle|>",
        ]
        config["chat_template"] = K2_CHAT_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return first + NUM_RESERVED_SPECIAL_TOKENS
