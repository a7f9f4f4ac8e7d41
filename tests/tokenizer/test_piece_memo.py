"""A conversation rendered again and again (a score job's messages line renders it
up to every assistant turn; a chat, every turn) is encoded piece by piece, each
piece once: the encodes grow with the turns, not with turns x turns, and the
tokens are those of encoding every piece afresh."""

import deltafin_mlx.tokenizer.kimi as kimi
from deltafin_mlx.jobs.batch_lines import Request
from deltafin_mlx.jobs.score_lines import prepare
from deltafin_mlx.testing.tokenizers import write_kimi_tokenizer_files
from deltafin_mlx.tokenizer.kimi import load_kimi_tokenizer


def conversation(exchanges):
    msgs = []
    for i in range(exchanges):
        msgs += [{"role": "user", "content": f"question {i} about the experts"},
                 {"role": "assistant", "content": f"answer {i}: they stream from disk"}]
    return msgs


def counted(tokenizer):
    """The tokenizer with its tiktoken encodes counted."""
    calls = []
    enc = tokenizer._tokenizer.encoding if hasattr(tokenizer, "_tokenizer") else tokenizer.encoding

    class Counting:
        def __getattr__(self, name):
            return getattr(enc, name)

        def encode(self, *a, **k):
            calls.append(1)
            return enc.encode(*a, **k)

        def encode_ordinary(self, *a, **k):
            calls.append(1)
            return enc.encode_ordinary(*a, **k)

    owner = tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer
    owner.encoding = Counting()
    return calls


def scored_line(tokenizer, exchanges):
    return prepare(Request("1", 1, 1, spec={"id": 1, "messages": conversation(exchanges)}),
                   tokenizer)


def test_each_piece_of_a_conversation_is_encoded_once(tmp_path, monkeypatch):
    write_kimi_tokenizer_files(tmp_path / "tok", flavor="k3")
    calls = {}
    for n in (20, 40):
        tok = load_kimi_tokenizer(tmp_path / "tok")
        counts = counted(tok)
        scored_line(tok, n)
        calls[n] = len(counts)
    assert calls[40] <= 2.2 * calls[20]  # linear in the turns (it was quadratic)
    # The same tokens as encoding every piece afresh.
    tok = load_kimi_tokenizer(tmp_path / "tok")
    memo = scored_line(tok, 30)
    monkeypatch.setattr(kimi, "PIECE_MEMO_CHARS", -1)
    fresh = scored_line(load_kimi_tokenizer(tmp_path / "tok"), 30)
    assert memo.tokens == fresh.tokens and (memo.scored == fresh.scored).all()
