"""Hostile files, round three: `--force` aimed at the user's own directory, Ctrl-C
as the converter finishes, manifests that drop their checksums, an unlisted
generation_config.json, escape sequences in what `info` prints, tokenizers that
cannot encode every byte or name ids the model does not have. Each is one clear
line (or no harm at all), never a traceback, a deleted file or a silent change."""

import json
import subprocess
import sys

import pytest

from deltafin_mlx.cli import convert as convert_cli
from deltafin_mlx.cli.main import main
from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.manifest import MANIFEST_NAME, read_manifest
from test_hostile import one_error_line, reseal


def convert_run(capsys, *args):
    code = convert_cli.main([*map(str, args), "--quiet"])
    return code, capsys.readouterr().err


# --- deltafin-convert --force ----------------------------------------------------------


def test_force_never_touches_a_directory_that_is_not_a_deltafin_output(sources, tmp_path, capsys):
    out = tmp_path / "mine"
    (out / "trunk").mkdir(parents=True)
    (out / "experts").mkdir()
    (out / "trunk" / "thesis.tex").write_text("years of work")
    (out / "config.json").write_text('{"theme": "dark"}')
    (out / MANIFEST_NAME).write_text('{"format": "something else"}')
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    for extra in ([], ["--force"]):
        code, err = convert_run(capsys, sources("mixtral"), out, *extra)
        line = one_error_line(err)
        assert code == 1 and "holds no Deltafin model or conversion" in line
        assert "--force" not in line
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
    assert (out / "trunk" / "thesis.tex").read_text() == "years of work"


def test_force_replaces_a_deltafin_model_or_an_unfinished_conversion(sources, tmp_path, capsys):
    out = tmp_path / "model"
    assert convert_run(capsys, sources("mixtral"), out)[0] == 0
    code, err = convert_run(capsys, sources("qwen3_moe"), out)
    assert code == 1 and "--force" in err  # another model: replaced only when asked
    assert convert_run(capsys, sources("qwen3_moe"), out, "--force")[0] == 0
    assert read_manifest(out).model_type == "qwen3_moe"
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "deltafin.partial.json").write_text("{damaged")
    assert convert_run(capsys, sources("mixtral"), partial, "--force")[0] == 0
    assert read_manifest(partial).model_type == "mixtral"


def test_ctrl_c_while_the_converter_reports_is_not_a_traceback(sources, tmp_path):
    """Ctrl-C just after the manifest is written (here: while the result is printed)
    changes nothing and prints no KeyboardInterrupt traceback."""
    program = (
        "import os, signal, sys\n"
        "import deltafin_mlx.cli.convert as c\n"
        "real = c.human_bytes\n"
        "def late_ctrl_c(n):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(n)\n"
        "c.human_bytes = late_ctrl_c\n"
        "sys.argv = ['deltafin-convert', sys.argv[1], sys.argv[2], '--quiet']\n"
        "sys.exit(c.main())\n")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-c", program, str(sources("mixtral")), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "converted" in p.stdout
    read_manifest(out)


# --- the manifest and the small files read by fixed name ---------------------------------


@pytest.mark.parametrize("checksums", [None, {}])
def test_a_manifest_without_checksums_is_refused(converted, copy_of, checksums):
    path = copy_of(converted("qwen3_moe"))
    d = json.loads((path / MANIFEST_NAME).read_text())
    if checksums is None:
        del d["checksums"]
    else:
        d["checksums"] = checksums
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ModelError, match="no checksums|checksums must name exactly"):
        read_manifest(path)


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_a_format_version_that_only_equals_an_integer_is_refused(converted, copy_of, version):
    """JSON true is not format version 1 (Python's True == 1), nor is 1.0 or "1"."""
    path = copy_of(converted("qwen3_moe"))
    d = json.loads((path / MANIFEST_NAME).read_text())
    d["format_version"] = version
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ModelError, match="format version .* is not supported"):
        read_manifest(path)


@pytest.mark.parametrize("layer", [True, 1.0])
def test_a_link_table_whose_layer_only_equals_an_integer_is_refused(tmp_path, layer):
    """A link table saying layer true is not layer 1's table."""
    import numpy as np

    from deltafin_mlx.format.bank import Section
    from deltafin_mlx.format.links import ENTRY, read_links, write_links

    section = Section("gate_proj.weight", "uint8", (4,), 0, 4)
    experts = {"num_experts": 2, "record_size": 64, "sections": [section.to_dict()]}
    path = tmp_path / "layer-00001.links"
    write_links(path, 1, [section.name], ["model.safetensors"], np.zeros((2, 1), ENTRY),
                np.zeros(2, "<u4"))
    files = {"model.safetensors": {"size": 64}}
    assert read_links(path, experts, 1, files).num_experts == 2  # as written: reads
    write_links(path, layer, [section.name], ["model.safetensors"], np.zeros((2, 1), ENTRY),
                np.zeros(2, "<u4"))
    with pytest.raises(ModelError, match="corrupt link table .*layer .* is not an integer"):
        read_links(path, experts, 1, files)


def test_an_unlisted_generation_config_is_refused(converted, copy_of, capsys):
    """An added generation_config.json would change the eos tokens unseen."""
    path = copy_of(converted("qwen3_moe"))
    d = json.loads((path / MANIFEST_NAME).read_text())
    for key in ("files", "checksums"):
        del d[key]["generation_config.json"]
    d["tokenizer"]["files"].remove("generation_config.json")
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    for command in (["info", path], ["plan", path, "--budget", "1GB"], [path, "hi", "-n", "1"]):
        assert main(list(map(str, command))) == 1
        line = one_error_line(capsys.readouterr().err)
        assert "generation_config.json: not listed in the manifest" in line, command


def test_an_edited_generation_config_is_refused(converted, copy_of, capsys):
    path = copy_of(converted("qwen3_moe"))
    g = path / "generation_config.json"
    g.write_text(g.read_text().replace("}", ', "x": 1}', 1)[: len(g.read_text())])
    assert main(["info", str(path)]) == 1
    assert "generation_config.json: modified since conversion" in one_error_line(
        capsys.readouterr().err)


def test_info_shows_escape_sequences_from_the_manifest_escaped(converted, copy_of, capsys):
    path = copy_of(converted("qwen3_moe"))
    d = json.loads((path / MANIFEST_NAME).read_text())
    d["source"]["id"] = "evil\x1b]0;owned\x07\x1b[2J\u202e"
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "evil\\x1b]0;owned\\x07\\x1b[2J\\u202e" in out


@pytest.mark.parametrize("command", [["info"], ["verify"], [], ["plan"]])
def test_an_escape_sequence_in_a_model_path_is_shown_escaped_in_the_error_line(
        converted, tmp_path, capsys, command):
    """A directory named by a stranger must not drive the terminal through an error line."""
    import shutil

    path = tmp_path / "evil\x1b[31m\x07model"
    shutil.copytree(converted("qwen3_moe"), path)
    (path / "tokenizer_config.json").unlink()  # listed, so every command refuses it
    assert main([*command, str(path), *(["hi"] if not command else [])]) == 1
    err = capsys.readouterr().err
    line = one_error_line(err)
    assert "\x1b" not in err and "\x07" not in err
    assert "evil\\x1b[31m\\x07model" in line and "tokenizer_config.json" in line


# --- tokenizers -------------------------------------------------------------------------


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
    line = one_error_line(capsys.readouterr().err)
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
    assert "no token for 1 of the 256 bytes (0x41)" in one_error_line(capsys.readouterr().err)


def test_a_tokenizer_with_more_ids_than_the_embedding_table_is_refused_at_load(
        converted, copy_of, capsys):
    path = copy_of(converted("qwen3_moe"))
    rows = json.loads((path / "config.json").read_text())["vocab_size"]
    d = json.loads((path / "tokenizer.json").read_text())
    d["model"]["vocab"]["zqzq"] = rows + 5
    (path / "tokenizer.json").write_text(json.dumps(d))
    reseal(path, "tokenizer.json")
    assert main([str(path), "hi", "-n", "1"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"ids up to {rows + 5}, beyond the {rows} rows" in line


# --- under mlx.launch -------------------------------------------------------------------


def test_only_rank_0_prints_the_stats_line(converted, monkeypatch, capsys):
    from types import SimpleNamespace

    from deltafin_mlx.engine.runtime import Runtime

    assert Runtime.is_primary.fget(SimpleNamespace(group=None))
    assert Runtime.is_primary.fget(SimpleNamespace(group=SimpleNamespace(rank=lambda: 0)))
    assert not Runtime.is_primary.fget(SimpleNamespace(group=SimpleNamespace(rank=lambda: 1)))
    args = [str(converted("qwen3_moe")), "hi", "-n", "2"]
    assert main(args) == 0
    assert "[deltafin]" in capsys.readouterr().err
    monkeypatch.setattr(Runtime, "is_primary", property(lambda self: False))  # as rank 1
    assert main(args) == 0
    assert "[deltafin]" not in capsys.readouterr().err


# --- --session files --------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(converted):
    from deltafin_mlx import runtime
    from deltafin_mlx.engine.load import load

    model, tok = load(converted("kimi_k3"), "200MB", context=1024)
    yield model, tok
    runtime(model).close()


def test_a_session_with_flipped_bytes_in_its_cached_tensors_is_refused(chat_model, tmp_path):
    from deltafin_mlx.chat.session import ChatSession, SessionError

    model, tok = chat_model
    session = ChatSession(model, tok)
    session.ask("Tell me about the fox.", 4)
    path = tmp_path / "chat.safetensors"
    session.save(path)
    assert ChatSession.restore(path, model, tok).tokens == session.tokens  # intact: restores
    data = bytearray(path.read_bytes())
    data[-64] ^= 0x40  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(SessionError, match="damaged .*checksum"):
        ChatSession.restore(path, model, tok)


def test_a_fifo_as_the_session_file_is_refused_without_blocking(chat_model, tmp_path):
    import os
    import time

    from deltafin_mlx.chat.session import ChatSession, SessionError

    model, tok = chat_model
    fifo = tmp_path / "chat.safetensors"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(SessionError, match="not a regular file"):
        ChatSession.restore(fifo, model, tok)
    assert time.monotonic() - start < 5


# --- bank records -----------------------------------------------------------------------


def test_random_bytes_over_a_bank_are_refused_without_verify(converted, copy_of, capsys):
    """Each record's CRC is checked on its first read by default: a damaged bank is
    one line naming the record, never a run of silent zeros."""
    import os

    from deltafin_mlx.format.bank import read_layout

    path = copy_of(converted("qwen3_moe"))
    m = read_manifest(path)
    for layer in m.moe_layers:
        layout = read_layout(m.bank_path(layer))
        with open(m.bank_path(layer), "r+b") as f:
            f.seek(layout.header_size)
            f.write(os.urandom(layout.num_experts * layout.record_size))
    assert main([str(path), "Hello", "-n", "4", "--budget", "40MB"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "checksum mismatch in layer" in line and "the bank is corrupt" in line


def test_each_record_is_checked_on_its_first_read_only(converted, monkeypatch):
    """Rereads after eviction are the same bytes: only first reads pay for the CRC;
    --verify checks every read."""
    import deltafin_mlx.engine.reader as reader
    from deltafin_mlx import runtime
    from deltafin_mlx.engine.load import load
    import mlx.core as mx

    from deltafin_mlx.testing.decode import greedy

    checked = []
    real = reader._check
    monkeypatch.setattr(reader, "_check", lambda bank, e, crc: (checked.append(
        (bank.layout.layer, e)), real(bank, e, crc)))
    for verify in (False, True):
        checked.clear()
        model, _ = load(converted("qwen3_moe"), cache_slots=4, tokenizer=False,
                        reader_threads=0, lookahead=False, verify=verify, warm_start=False)
        greedy(model, mx.array([[1, 5, 9, 200, 7]]), 6)
        reads = runtime(model).store.reader.reads
        runtime(model).close()
        assert reads > len(set(checked))  # experts were read more than once
        if verify:
            assert len(checked) == reads
        else:
            assert len(checked) == len(set(checked))
