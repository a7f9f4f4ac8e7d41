"""Kimi's tiktoken tokenizer for mlx-lm: its files, checked, and loading it.

Kimi checkpoints (K2, K3, Kimi-Linear) ship no `tokenizer.json`: the
vocabulary is `tiktoken.model`, the special tokens are in
`tokenizer_config.json`, and the rest is Python in the checkpoint
(`tokenization_kimi.py`, and for K3 `encoding_k3.py`) that transformers only
runs with `trust_remote_code`. This module reads the two data files itself,
so a Kimi model loads without executing code from the checkpoint; prompts are
rendered by `xtml` (K3) or by the sandboxed Jinja template (`jinja`).
"""

import base64
import codecs
import json
import shutil
from collections import OrderedDict
from functools import cached_property, lru_cache
from pathlib import Path

import tiktoken
from mlx_lm.tokenizer_utils import StreamingDetokenizer, TokenizerWrapper
from deltafin_mlx.errors import TokenizerError
from deltafin_mlx.tokenizer.encode_thread import run_on_encode_thread

# A rendered conversation is encoded piece by piece (its markup, each turn's text),
# and the same pieces come back each time the conversation is rendered again (a
# score job's messages line renders it up to every assistant turn; a chat renders it
# every turn), so pieces are kept encoded: each is encoded once. Pieces are exact
# units (each is encoded on its own, memo or not). Bounded: the most recent
# PIECE_MEMO pieces of at most PIECE_MEMO_CHARS characters.
PIECE_MEMO = 4096
PIECE_MEMO_CHARS = 1 << 16
from deltafin_mlx.tokenizer.jinja import render_jinja_chat
from deltafin_mlx.tokenizer.xtml import (XTML_CLOSE, XTML_END_OF_MSG, XTML_OPEN, XTML_SEP,
                                         render_xtml_chat)

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
    # tiktoken panics at the first text holding a byte that has no token of its own.
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        shown = ", ".join(f"0x{b:02x}" for b in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise TokenizerError(f"{path}: no token for {len(missing)} of the 256 bytes ({shown}): "
                             "text holding them cannot be encoded")
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
            raise TokenizerError(f"added token {key} is outside the special ids {first}..{end - 1}")
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
        return tiktoken.Encoding(name, pat_str=KIMI_PATTERN, mergeable_ranks=mergeable_ranks,
                                 special_tokens=special_tokens)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # tiktoken's Rust panics are BaseExceptions (pyo3)
        raise TokenizerError(f"tiktoken refused the vocabulary ({type(e).__name__}: "
                             f"{str(e)[:200]})") from None


@lru_cache(maxsize=1)
def _bytes_to_unicode():
    """GPT-2's byte -> printable character table, used for token strings."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def byte_token_strings() -> list:
    """The token string of each byte 0..255 in byte-level BPE vocabularies."""
    table = _bytes_to_unicode()
    return [table[b] for b in range(256)]


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
        self._pieces = OrderedDict()  # (text, allow_special) -> ids, most recent last
        self.init_kwargs = config
        self.name_or_path = str(name_or_path)
        # name -> id for every reserved id, named or not
        self.special_tokens = {name: encoding.encode_single_token(name)
                               for name in encoding.special_tokens_set}
        self.chat_template = config.get("chat_template")
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        added = config.get("added_tokens_decoder", {})
        self.all_special_ids = sorted(i for i in self.special_tokens.values()
                                      if added.get(str(i), {}).get("special", True))
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
        return [self.encoding.decode_single_token_bytes(i) for i in range(self.encoding.n_vocab)]

    @cached_property
    def _token_strings(self):
        # Byte-level strings as the release's tokenizer (and GPT-2) spells
        # them; special tokens keep their names.
        byte_char = _bytes_to_unicode()
        names = {i: name for name, i in self.special_tokens.items()}
        return [names.get(i) or "".join(byte_char[b] for b in token)
                for i, token in enumerate(self.token_bytes)]

    @cached_property
    def vocab(self):
        return {token: i for i, token in enumerate(self._token_strings)}

    def get_vocab(self):
        return self.vocab

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        if isinstance(ids, int):
            return self._token_strings[ids]
        return [self._token_strings[i] for i in ids
                if not (skip_special_tokens and i in self._special_ids)]

    def convert_tokens_to_ids(self, tokens):
        if isinstance(tokens, str):
            return self.vocab.get(tokens, self.unk_token_id)
        return [self.vocab.get(t, self.unk_token_id) for t in tokens]

    def _encode(self, text, allow_special):
        return self._encode_pieces([(text, allow_special)])

    def _encode_pieces(self, pieces):
        """Token ids of (text, allow_special) pieces, in order, encoded on the
        process's one encode thread (tokenizer/encode_thread.py)."""
        return run_on_encode_thread(self._encode_here, pieces)

    def _encode_here(self, pieces):
        ids = []
        for text, allow_special in pieces:
            key = (text, bool(allow_special))
            known = self._pieces.get(key) if len(text) <= PIECE_MEMO_CHARS else None
            if known is not None:
                self._pieces.move_to_end(key)
                ids += known
                continue
            got = []
            # The release encodes at most 400k characters per tiktoken call.
            for i in range(0, len(text), 400_000):
                for piece in _split_long_runs(text[i : i + 400_000]):
                    if allow_special:
                        got += self.encoding.encode(piece, allowed_special="all")
                    else:
                        # Special token text is ordinary text here.
                        got += self.encoding.encode_ordinary(piece)
            if len(text) <= PIECE_MEMO_CHARS:
                self._pieces[key] = got
                if len(self._pieces) > PIECE_MEMO:
                    self._pieces.popitem(last=False)
            ids += got
        return ids

    def encode(self, text, add_special_tokens=True, allow_special_tokens=True, **kwargs):
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

    def apply_chat_template(self, conversation, tools=None, tokenize=True,
                            add_generation_prompt=True, thinking=True,
                            continue_final_message=False, return_dict=False, **kwargs):
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
            pieces = render_xtml_chat(conversation, tools,
                                      add_generation_prompt=add_generation_prompt,
                                      thinking=thinking,
                                      thinking_effort=kwargs.get("thinking_effort", "max"),
                                      continue_final_message=continue_final_message)
            if not tokenize:
                return "".join(text for text, _ in pieces)
            # Piece by piece: only markup may become special tokens.
            ids = self._encode_pieces(pieces)
        elif self.chat_template is not None:
            text = render_jinja_chat(self.chat_template, conversation, tools=tools,
                                     add_generation_prompt=add_generation_prompt,
                                     thinking=thinking,
                                     continue_final_message=continue_final_message,
                                     bos_token=self.bos_token, eos_token=self.eos_token,
                                     **kwargs)
            if not tokenize:
                return text
            ids = self.encode(text)
        else:
            raise ValueError(f"{self.name_or_path}: the tokenizer has no chat template")
        if return_dict:
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        return ids

    def render_turns(self, conversation, tools=None, thinking=True, **kwargs):
        """K3's XTML conversation rendered once: (its token ids without a generation
        prompt, the token index each message starts at and then where the
        generation prompt would, the generation prompt's ids), or None for a
        template that is not XTML. Pieces are encoded one by one and each message
        renders the same whatever follows it (xtml.render_xtml_chat), so the ids
        before message i's start are the conversation up to message i rendered on
        its own: a caller finds every turn's tokens in time linear in the
        conversation, where rendering each prefix would be quadratic. Arguments
        as `apply_chat_template`'s."""
        if not self.is_xtml:
            return None
        thinking = kwargs.pop("enable_thinking", thinking)
        starts = []
        pieces = render_xtml_chat(conversation, tools, add_generation_prompt=True,
                                  thinking=thinking,
                                  thinking_effort=kwargs.get("thinking_effort", "max"),
                                  starts=starts)
        bounds = starts + [len(pieces)]
        ids = list(self._encode_pieces(pieces[: bounds[0]]))  # declarations, notices
        at = []
        for a, b in zip(bounds, bounds[1:]):
            at.append(len(ids))
            ids += self._encode_pieces(pieces[a:b])
        return ids[: at[-1]], at, ids[at[-1]:]

    def save_pretrained(self, path):
        """Copy the tokenizer's files (and the release's code, if present)."""
        source, path = Path(self.name_or_path), Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if source.resolve() == path.resolve():
            return
        for name in ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py",
                     "encoding_k3.py"):
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
        # An id past the vocabulary (an embedding table padded beyond it) is no
        # text: rendered as nothing, as mlx-lm's decode renders it, not an IndexError.
        known = token < len(self._token_bytes)
        self.text += self._utf8.decode(self._token_bytes[token] if known else b"")

    def finalize(self):
        self.text += self._utf8.decode(b"", final=True)


def _config_eos_token_ids(model_dir):
    # The stop token of a chat turn (K3's <|end_of_msg|>) is the model
    # config's eos, not the tokenizer's.
    from deltafin_mlx.format.integrity import CONFIG_MAX_BYTES, read_inside

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    from deltafin_mlx.model.config import eos_token_ids

    return eos_token_ids(json.loads(read_inside(model_dir, "config.json", CONFIG_MAX_BYTES)))


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
        tool_kwargs = dict(tool_parser=module.parse_tool_call,
                           tool_call_start=module.tool_call_start,
                           tool_call_end=module.tool_call_end)
    return TokenizerWrapper(tokenizer, KimiStreamingDetokenizer, eos_token_ids=eos_token_ids,
                            **tool_kwargs)
