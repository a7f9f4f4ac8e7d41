"""Damaged or hostile tokenizer files: each refused at load in one line, never a hang."""

import json
import time

import pytest

import deltafin_mlx.cli.main as cli
from deltafin_mlx.cli.main import main
from deltafin_mlx.engine.load import load
from deltafin_mlx.errors import TemplateLimit, TokenizerError
from deltafin_mlx.format.manifest import ModelError, read_manifest
from deltafin_mlx.tokenizer.jinja import render_jinja_chat
from deltafin_mlx.tokenizer.kimi import read_special_tokens, read_tiktoken_ranks

from helpers import no_hang, only_stderr_line, reseal, run_cli


def test_swapped_tokenizer_ranks_are_refused_at_load(converted, copy_of):
    path = copy_of(converted("kimi_k3"))
    lines = (path / "tiktoken.model").read_bytes().splitlines()
    (a, ra), (b, rb) = lines[10].split(), lines[11].split()
    lines[10], lines[11] = a + b" " + rb, b + b" " + ra  # same size: ranks are 10, 11
    (path / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
    assert (path / "tiktoken.model").stat().st_size == read_manifest(
        path, check_files=False).files["tiktoken.model"]
    with pytest.raises(ModelError, match="tiktoken.model: modified since conversion"):
        load(path, memory_budget="2GB")


def test_emptied_special_token_resealed_is_one_line_not_a_hang(converted, copy_of):
    """The same-size edit that used to hang every load: tiktoken's special-token
    pattern with an empty alternative matches everywhere and never advances."""
    path = copy_of(converted("kimi_k3"))
    text = (path / "tokenizer_config.json").read_text()
    edited = text.replace('"content": "<|sep|>"', '"content": ""       ', 1)
    assert edited != text and len(edited) == len(text)
    (path / "tokenizer_config.json").write_text(edited)
    reseal(path, "tokenizer_config.json")
    with no_hang(30), pytest.raises(ModelError, match="special token must be a non-empty"):
        load(path, memory_budget="2GB")
    code, err = run_cli(path, "hi", "-n", "2", timeout=60)
    assert code == 1 and "non-empty string" in only_stderr_line(err)


def _ranks_file(tmp_path, lines):
    p = tmp_path / "tiktoken.model"
    p.write_bytes(b"\n".join(lines) + b"\n")
    return p


def _b64(b):
    import base64

    return base64.b64encode(b)


@pytest.mark.parametrize("lines,why", [
    ([_b64(b"a") + b" 0", _b64(b"b") + b" 0"], "rank 0 is given twice"),
    ([_b64(b"a") + b" 0", _b64(b"b") + b" 2"], "rank 1 is missing"),
    ([_b64(b"a") + b" 0", b"!!notbase64 1"], "bad base64"),
    ([_b64(b"a") + b" 0", _b64(b"a") + b" 1"], "appears twice"),
    ([_b64(b"a") + b" 0", _b64(b"b") + b" x"], "is not a number"),
    ([_b64(b"a") + b" 0 extra"], "is not 'base64-token rank'"),
])
def test_bad_tiktoken_files_are_one_line_each(tmp_path, lines, why):
    with pytest.raises(TokenizerError, match=why):
        read_tiktoken_ranks(_ranks_file(tmp_path, lines))


def test_empty_token_is_refused(tmp_path):
    # "" is valid base64 for zero bytes; written as "=" it still decodes to nothing.
    with pytest.raises(TokenizerError, match="empty token|bad base64"):
        read_tiktoken_ranks(_ranks_file(tmp_path, [_b64(b"a") + b" 0", b"= 1"]))


@pytest.mark.parametrize("added,why", [
    ({"1000": {"content": ""}}, "non-empty string"),
    ({"1000": {"content": 5}}, "non-empty string"),
    ({"1000": {"content": "<|x|>"}, "1001": {"content": "<|x|>"}}, "names two ids"),
    ({"1000": {"content": "a"}}, "is also ordinary token"),
    ({"abc": {"content": "<|x|>"}}, "is not a number"),
    ({"5": {"content": "<|x|>"}}, "outside the special ids"),
    ({"1000": ["content"]}, "non-empty string"),
])
def test_bad_special_tokens_are_one_line_each(added, why):
    with pytest.raises(TokenizerError, match=why):
        read_special_tokens({"added_tokens_decoder": added}, 1000, {b"a": 0})


def test_a_tokenizer_library_panic_is_one_line_from_the_cli(converted, monkeypatch, capsys):
    """tiktoken's Rust panics are pyo3 PanicExceptions: BaseException, not Exception."""
    import deltafin_mlx.tokenizer.kimi as tok

    class PanicException(BaseException):
        pass

    def panic(*a, **k):
        raise PanicException("called `Result::unwrap()` on an `Err` value")

    monkeypatch.setattr(tok.tiktoken, "Encoding", panic)
    assert cli.main([str(converted("kimi_k3")), "hi", "-n", "1"]) == 1
    line = only_stderr_line(capsys.readouterr().err)
    assert "PanicException" in line and "tiktoken" in line


def test_a_jinja_template_that_never_ends_is_stopped(monkeypatch):
    import deltafin_mlx.tokenizer.jinja as tok

    monkeypatch.setattr(tok, "JINJA_MAX_SECONDS", 1.0)
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(TemplateLimit, match="ran over"):
        render_jinja_chat(loop, [{"role": "user", "content": "x"}])
    assert time.monotonic() - start < 30  # 10**10 iterations unstopped: hours
    # A loop over a list touches nothing a check could run in.
    listed = ("{% set r = range(100000)|list %}"
              "{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}")
    with pytest.raises(TemplateLimit, match="ran over"):
        render_jinja_chat(listed, [])
    assert time.monotonic() - start < 30
    doubling = ('{% set ns = namespace(s="a") %}{% for i in range(40) %}'
                "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}")
    for allocating in ['{{ "a" * 10000000000 }}', '{{ "a" + "b" * 16777216 }}', doubling,
                       '{{ "a"|center(10000000000) }}', '{{ "a".center(10000000000) }}']:
        with pytest.raises(TemplateLimit, match="uses a value of"):
            render_jinja_chat(allocating, [])
    with pytest.raises(TemplateLimit):
        render_jinja_chat("{{ 9 ** 99999999 }}", [])
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        render_jinja_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(TemplateLimit, match="not a string of at most"):
        render_jinja_chat("x" * (tok.JINJA_MAX_TEMPLATE_CHARS + 1), [])


def test_a_byte_level_tokenizer_without_a_bytes_token_is_refused_at_load(converted, copy_of,
                                                                          capsys):
    """Hugging Face's BPE would drop the byte from every text without a word."""
    path = copy_of(converted("qwen3_moe"))
    d = json.loads((path / "tokenizer.json").read_text())
    vocab, merges = d["model"]["vocab"], d["model"]["merges"]
    used = {c for merge in merges for part in merge for c in part}
    byte = next(k for k in vocab if len(k) == 1 and k.isalpha() and k not in used)
    vocab[byte + "zz"] = vocab.pop(byte)
    (path / "tokenizer.json").write_text(json.dumps(d))
    reseal(path, "tokenizer.json")
    assert main([str(path), "hi", "-n", "1"]) == 1
    line = only_stderr_line(capsys.readouterr().err)
    assert f"no token for 1 of the 256 bytes (0x{ord(byte):02x})" in line


def test_a_tiktoken_file_without_a_bytes_token_is_refused_at_load(converted, copy_of, capsys):
    """tiktoken would panic at the first text holding the byte."""
    import base64

    path = copy_of(converted("kimi_k3"))
    lines = (path / "tiktoken.model").read_bytes().splitlines()
    a = base64.b64encode(b"A")
    (path / "tiktoken.model").write_bytes(b"\n".join(
        base64.b64encode(b"\x01\x02zz") + b" " + x.split()[1] if x.split()[0] == a else x
        for x in lines) + b"\n")
    reseal(path, "tiktoken.model")
    assert main([str(path), "hi", "-n", "1"]) == 1
    assert "no token for 1 of the 256 bytes (0x41)" in only_stderr_line(capsys.readouterr().err)


def test_a_tokenizer_with_more_ids_than_the_embedding_table_is_refused_at_load(
        converted, copy_of, capsys):
    path = copy_of(converted("qwen3_moe"))
    rows = json.loads((path / "config.json").read_text())["vocab_size"]
    d = json.loads((path / "tokenizer.json").read_text())
    d["model"]["vocab"]["zqzq"] = rows + 5
    (path / "tokenizer.json").write_text(json.dumps(d))
    reseal(path, "tokenizer.json")
    assert main([str(path), "hi", "-n", "1"]) == 1
    line = only_stderr_line(capsys.readouterr().err)
    assert f"ids up to {rows + 5}, beyond the {rows} rows" in line
