"""What a loaded tokenizer must cover before anything is encoded: every byte a text
can hold, and no id beyond the model's embedding table.

A byte-level tokenizer missing one byte's token loads fine and then, at the first
text holding that byte, panics (tiktoken) or drops the byte without a word (Hugging
Face's BPE): both are refused at load. So is a tokenizer with more ids than the
embedding table has rows, whose extra ids the model could never embed. Kimi's
tiktoken files are checked for their bytes where they are read (tokenizer/kimi.py).
"""

import json
from typing import List, Optional

from deltafin_mlx import compat
from deltafin_mlx.errors import TokenizerError
from deltafin_mlx.tokenizer.kimi import byte_token_strings


def check_tokenizer(tokenizer, vocab_rows: Optional[int], where):
    """TokenizerError unless `tokenizer` (mlx-lm's TokenizerWrapper or what it
    wraps) encodes every byte and has ids only below `vocab_rows`."""
    inner = compat.wrapped_tokenizer(tokenizer)
    top = _largest_id(inner)
    if isinstance(vocab_rows, int) and top is not None and top >= vocab_rows:
        raise TokenizerError(f"{where}: the tokenizer has ids up to {top}, beyond the "
                             f"{vocab_rows} rows of the model's embedding table")
    missing = _missing_byte_tokens(inner)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise TokenizerError(f"{where}: the tokenizer has no token for {len(missing)} of the "
                             f"256 bytes ({shown}): text holding them cannot be encoded")


def _largest_id(inner) -> Optional[int]:
    if hasattr(inner, "encoding"):  # tokenizer/kimi.py: ranks, then special ids
        return inner.encoding.n_vocab - 1
    vocab = inner.get_vocab() if hasattr(inner, "get_vocab") else None
    return max(vocab.values()) if vocab else None


def _missing_byte_tokens(inner) -> List[str]:
    """The bytes a Hugging Face tokenizer's decoder says it spells with byte tokens
    (ByteLevel: GPT-2's byte characters; ByteFallback: `<0xXX>`) that its vocabulary
    lacks; [] for other tokenizers, which are not byte-level."""
    backend = getattr(inner, "backend_tokenizer", None)
    if backend is None or backend.decoder is None:
        return []
    decoder = json.loads(backend.decoder.__getstate__())
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []
                                     if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        names = byte_token_strings()
    elif "ByteFallback" in kinds:
        names = [f"<0x{b:02X}>" for b in range(256)]
    else:
        return []
    vocab = backend.get_vocab(with_added_tokens=True)
    return [f"0x{b:02x}" for b, name in enumerate(names) if name not in vocab]
