"""Hostile and damaged inputs, round two: model directories built at test time to
escape by symlink, block on FIFOs, never end (/dev/zero), or carry same-size edits
(some resealed into the manifest); out-of-vocabulary token ids; damaged sources
for the converter; bad options. Every case must give one clear error (or HTTP
error), never a hang, crash, traceback or silent wrong answer."""

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import mlx.core as mx
import pytest

import deltafin_mlx.convert.convert as conv
from deltafin_mlx.cli import convert as convert_cli
from deltafin_mlx.convert.source import ConvertError, open_source
import deltafin_mlx.cli.main as cli
from deltafin_mlx.format.integrity import file_checksum, format_checksum
from deltafin_mlx.engine.load import TokenIdError, load, load_resident
from deltafin_mlx.format.manifest import MANIFEST_NAME, ModelError, read_manifest
from deltafin_mlx.errors import TemplateLimit, TokenizerError
from deltafin_mlx.tokenizer.jinja import render_jinja_chat
from deltafin_mlx.tokenizer.kimi import read_special_tokens, read_tiktoken_ranks
from deltafin_mlx.format.verify import verify_model
from test_reliability import no_hang

from deltafin_mlx import runtime
from helpers import BIN

LOAD = dict(tokenizer=False, cache_slots=4, reader_threads=0, lookahead=False)


def reseal(path: Path, *rels):
    """Record the current size and checksum of `rels` in the manifest (and the
    config hash for config.json): what someone editing a file on purpose does."""
    d = json.loads((path / MANIFEST_NAME).read_text())
    for rel in rels:
        d["files"][rel] = (path / rel).stat().st_size
        d["checksums"][rel] = format_checksum(file_checksum(path / rel))
        if rel == "config.json":
            d["source"]["config_sha256"] = hashlib.sha256((path / rel).read_bytes()).hexdigest()
    (path / MANIFEST_NAME).write_text(json.dumps(d))


def run_cli(*args, env=None, timeout=120):
    p = subprocess.run([str(BIN / "deltafin-run"), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    return p.returncode, p.stderr


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


# --- files: every file a model names resolves inside it and is a regular file --


@pytest.mark.parametrize("what", ["bank", "trunk", "experts_dir", "tokenizer", "manifest"])
def test_symlink_to_a_same_size_copy_outside_the_model_is_refused(converted, copy_of, tmp_path,
                                                                  what):
    path = copy_of(converted("kimi_k3"))
    m = read_manifest(path)
    outside = tmp_path / "outside"
    outside.mkdir()
    rel = {"bank": str(m.bank_path(m.moe_layers[0]).relative_to(path)),
           "trunk": m.trunk_files["0"], "experts_dir": "experts",
           "tokenizer": "tokenizer_config.json", "manifest": MANIFEST_NAME}[what]
    target = outside / Path(rel).name
    (shutil.copytree if (path / rel).is_dir() else shutil.copy)(path / rel, target)
    (shutil.rmtree if (path / rel).is_dir() else os.unlink)(path / rel)
    os.symlink(target, path / rel)
    with pytest.raises(ModelError, match="outside the model directory"):
        load(path, **LOAD)
    with pytest.raises(ModelError, match="outside the model directory"):
        verify_model(path)


def test_symlink_inside_the_model_is_followed(converted, copy_of):
    path = copy_of(converted("kimi_k3"))
    (path / "trunk" / "globals.safetensors").rename(path / "globals-real.safetensors")
    os.symlink("../globals-real.safetensors", path / "trunk" / "globals.safetensors")
    model, _ = load(path, **LOAD)
    runtime(model).close()


@pytest.mark.parametrize("name", ["config.json", MANIFEST_NAME, "tokenizer_config.json",
                                  "trunk/globals.safetensors"])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(converted, copy_of, name):
    path = copy_of(converted("kimi_k3"))
    (path / name).unlink()
    os.mkfifo(path / name)
    with no_hang(20), pytest.raises(ModelError, match="not a regular file"):
        load(path, memory_budget="2GB")


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "tiktoken.model",
                                  "generation_config.json"])
def test_dev_zero_linked_as_a_file_read_by_fixed_name_is_refused(converted, copy_of, name):
    path = copy_of(converted("kimi_k3"))
    (path / name).unlink()
    os.symlink("/dev/zero", path / name)
    with no_hang(20), pytest.raises(ModelError, match="outside the model directory"):
        load(path, memory_budget="2GB")


def test_a_huge_manifest_is_refused_without_reading_it(converted, copy_of):
    path = copy_of(converted("kimi_k3"))
    with open(path / MANIFEST_NAME, "r+b") as f:
        f.truncate(1 << 40)  # sparse: 1 TB that reads as zeros
    with no_hang(10), pytest.raises(ModelError, match="more than the"):
        read_manifest(path)


# --- integrity: same-size damage is found; verify names the file and record ---


def _overwrite(p: Path, offset: int, data: bytes):
    with open(p, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_random_bytes_over_a_trunk_file_are_refused_at_load_and_named_by_verify(
        converted, copy_of):
    path = copy_of(converted("kimi_k3"))
    rel = read_manifest(path, check_files=False).trunk_files["1"]
    _overwrite(path / rel, 200, os.urandom(64))
    with pytest.raises(ModelError, match=rf"{rel}: modified since conversion"):
        load(path, **LOAD)
    assert any(p.startswith(f"{rel}: modified since conversion")
               for p in verify_model(path).problems)


def test_large_files_are_checked_at_load_only_with_verify(converted, copy_of, monkeypatch):
    """Files over the load-time limit (real trunk files) are checked by --verify."""
    import deltafin_mlx.format.integrity as integrity

    monkeypatch.setattr(integrity, "SMALL_FILE_BYTES", 0)
    monkeypatch.setattr(integrity.check_small_files, "__defaults__", (0,))
    path = copy_of(converted("kimi_k3"))
    rel = read_manifest(path, check_files=False).trunk_files["globals"]
    _overwrite(path / rel, (path / rel).stat().st_size - 100, os.urandom(16))  # tensor data
    model, _ = load(path, **LOAD)  # not checked at load: too large to read every time
    runtime(model).close()
    with pytest.raises(ModelError, match=rf"{rel}: modified since conversion"):
        load(path, verify=True, **LOAD)


def test_a_damaged_trunk_header_read_by_the_streamer_is_one_line(converted, copy_of,
                                                                   monkeypatch):
    """Streamed trunk layers and embedding rows are read where the file's own header
    says: that header is checked too (here with load-time checksums off)."""
    import deltafin_mlx.format.integrity as integrity

    monkeypatch.setattr(integrity.check_small_files, "__defaults__", (0,))
    path = copy_of(converted("kimi_k3"))
    rel = read_manifest(path, check_files=False).trunk_files["globals"]
    _overwrite(path / rel, 60, b"\xff\xfe")  # inside the JSON header
    with pytest.raises(ModelError, match=rf"{rel}: corrupt safetensors header|unreadable trunk"):
        load(path, memory_budget="18200000", **LOAD)


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


def test_verify_names_the_damaged_bank_record(converted, copy_of):
    path = copy_of(converted("kimi_k3"))
    m = read_manifest(path)
    layer = m.moe_layers[-1]
    from deltafin_mlx.format.bank import read_layout

    layout = read_layout(m.bank_path(layer))
    _overwrite(m.bank_path(layer), layout.record_offset(5) + 17, b"\x55\xaa")
    problems = verify_model(path).problems
    assert len(problems) == 1 and re.search(rf"record 5 \(layer {layer} expert 5\) is damaged",
                                            problems[0])
    code, err = run_cli("verify", path)
    assert code == 1 and "Traceback" not in err
    assert f"layer {layer} expert 5" in err.strip().splitlines()[0]


def test_verify_passes_a_clean_model_and_reports_progress(converted):
    seen = []
    report = verify_model(converted("kimi_k3"), lambda done, total: seen.append(done))
    assert report.ok and report.files_checked > 5
    assert seen[-1] == report.bytes_checked == sum(
        read_manifest(converted("kimi_k3")).files.values())


def test_a_checksum_list_that_skips_a_file_is_a_corrupt_manifest(converted, copy_of):
    path = copy_of(converted("kimi_k3"))
    d = json.loads((path / MANIFEST_NAME).read_text())
    del d["checksums"]["config.json"]
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ModelError, match="checksums must name exactly the listed files"):
        read_manifest(path)


# --- tokenizer files are validated (even when resealed) --------------------


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
    assert code == 1 and "non-empty string" in one_error_line(err)


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
    line = one_error_line(capsys.readouterr().err)
    assert "PanicException" in line and "tiktoken" in line


def test_a_jinja_template_that_never_ends_is_stopped(monkeypatch):
    import deltafin_mlx.tokenizer.jinja as tok

    monkeypatch.setattr(tok, "JINJA_MAX_SECONDS", 1.0)
    tok._compile_jinja.cache_clear()
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(TemplateLimit, match="ran over"):
        render_jinja_chat(loop, [{"role": "user", "content": "x"}])
    assert time.monotonic() - start < 30  # 10**10 iterations unstopped: hours
    with pytest.raises(TemplateLimit, match="repeats a value"):
        render_jinja_chat('{{ "a" * 10000000000 }}', [])
    with pytest.raises(TemplateLimit):
        render_jinja_chat("{{ 9 ** 99999999 }}", [])
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        render_jinja_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])
    tok._compile_jinja.cache_clear()


# --- config.json is cross-checked against the manifest and the banks ----------


@pytest.mark.parametrize("key,value,why", [
    ("num_experts_per_tok", 2, "experts per token"),
    ("num_local_experts", 4, "experts of"),
    ("vocab_size", 2048, "embed_tokens"),
    ("tie_word_embeddings", True, "lm_head"),
    ("num_hidden_layers", 2, "layers"),
])
def test_config_edited_and_resealed_is_refused(converted, copy_of, key, value, why):
    path = copy_of(converted("mixtral"))
    config = json.loads((path / "config.json").read_text())
    assert key in config or key == "tie_word_embeddings"
    config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    reseal(path, "config.json")
    with pytest.raises(ModelError, match=why):
        load(path, **LOAD)
    with pytest.raises(ModelError, match=why):
        load_resident(path)


def run_main(capsys, *args):
    """deltafin-run in this process: (exit status, its one stderr line)."""
    code = cli.main(list(map(str, args)))
    return code, one_error_line(capsys.readouterr().err)


def test_verify_refuses_a_config_edited_without_its_recorded_hash_as_run_does(
        converted, copy_of, capsys):
    """config.json edited, its size and CRC resealed but not source.config_sha256:
    verify gives the one line run and info give, not OK."""
    path = copy_of(converted("qwen3_moe"))
    config = json.loads((path / "config.json").read_text())
    config["edited"] = True
    (path / "config.json").write_text(json.dumps(config))
    d = json.loads((path / MANIFEST_NAME).read_text())
    stale = d["source"]["config_sha256"]
    reseal(path, "config.json")
    d = json.loads((path / MANIFEST_NAME).read_text())
    d["source"]["config_sha256"] = stale
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    lines = {command[0]: run_main(capsys, *command) for command in
             (["verify", path], ["info", path], [path, "hi", "-n", "1"])}
    assert set(lines.values()) == {(1, f"deltafin-run: error: {path / 'config.json'}: modified "
                                       "since conversion (its checksum differs)")}, lines


@pytest.mark.parametrize("named", ["../evil.py", "evil.py", "/tmp/evil.py", "./deltafin_model.py",
                                   7, None])
def test_a_config_naming_another_model_file_is_refused_by_every_command(
        converted, copy_of, capsys, named):
    """mlx-lm executes config.json's model_file: resealed consistently (checksums and
    config hash), anything but the converter's own deltafin_model.py is refused."""
    path = copy_of(converted("qwen3_moe"))
    config = json.loads((path / "config.json").read_text())
    assert config["model_file"] == "deltafin_model.py"
    config["model_file"] = named
    (path / "config.json").write_text(json.dumps(config))
    reseal(path, "config.json")
    for command in (["info", path], [path, "hi", "-n", "1"]):
        code, line = run_main(capsys, *command)
        assert code == 1 and '"model_file"' in line and "config.json" in line, (command, line)
    # verify: one line; for code outside the directory, a report whose first line
    # names the danger (tests/format/test_model_file_danger.py)
    code = cli.main(["verify", str(path)])
    first = capsys.readouterr().err.splitlines()[0]
    assert code == 1 and '"model_file"' in first and "config.json" in first, first


def test_rerunning_the_converter_over_a_config_naming_another_model_file_is_refused(
        converted, sources, copy_of, capsys):
    """Not "already holds this conversion": the converter opens a finished output as
    every command does."""
    path = copy_of(converted("qwen3_moe"))
    config = json.loads((path / "config.json").read_text())
    config["model_file"] = "../evil.py"
    (path / "config.json").write_text(json.dumps(config))
    reseal(path, "config.json")
    assert convert_cli.main([str(sources("qwen3_moe")), str(path), "--quiet"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("deltafin-convert: error: ") and '"model_file"' in line, line


def test_a_model_file_the_manifest_does_not_list_is_refused(converted, copy_of, capsys):
    path = copy_of(converted("qwen3_moe"))
    d = json.loads((path / MANIFEST_NAME).read_text())
    for key in ("files", "checksums"):
        del d[key]["deltafin_model.py"]
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    for command in (["verify", path], ["info", path]):
        code, line = run_main(capsys, *command)
        assert code == 1 and '"model_file" names deltafin_model.py, which the manifest does ' \
            "not list" in line, (command, line)


# --- token ids are checked where they enter the model -------------------------


@pytest.mark.parametrize("bad", [100000, 1024, -1])
def test_out_of_vocabulary_ids_are_an_error_through_the_api(converted, bad):
    model, _ = load(converted("kimi_k3"), **LOAD)
    vocab = type(model.language_model.model.embed_tokens).vocab_size
    assert vocab == 1024
    with pytest.raises(TokenIdError, match=rf"token id {bad} is outside the vocabulary"):
        model(mx.array([[3, bad, 5]]))
    model(mx.array([[0, vocab - 1]]))  # the edges are fine
    runtime(model).close()
    resident = load_resident(converted("kimi_k3"))
    with pytest.raises(TokenIdError):
        resident(mx.array([[bad]]))


def test_out_of_vocabulary_ids_through_the_mlx_lm_drop_in(converted):
    from deltafin_mlx.dropin.shim import make_classes

    Model, ModelArgs = make_classes(converted("kimi_k3"))
    m = Model(ModelArgs())
    with pytest.raises(TokenIdError):
        m(mx.array([[100000]]))
    runtime(m).close()


# --- the server ---------------------------------------------------------------


def _tcp_pair():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    return server, client


def test_a_client_that_resets_stops_its_generation_one_that_half_closes_does_not():
    import struct

    from deltafin_mlx.server.handler import ClientGone, _Watched

    class Ctx:
        stopped = False

        def stop(self):
            self.stopped = True

    class Inner:
        def generate(self, request, args, progress):
            return ctx, iter(range(100))

    class Handler:
        def __init__(self, sock):
            self.connection = sock

    ctx = Ctx()
    server, client = _tcp_pair()
    _, responses = _Watched(Inner(), Handler(server), None).generate(None, None)
    assert next(responses) == 0
    client.shutdown(socket.SHUT_WR)  # sent its request, still reading
    assert next(responses) == 1 and not ctx.stopped
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # a reset
    time.sleep(0.2)
    with pytest.raises(ClientGone):
        next(responses)
    assert ctx.stopped
    server.close()


# --- the converter ----------------------------------------------------------


def convert_cli_run(*args):
    p = subprocess.run([str(BIN / "deltafin-convert"), *map(str, args), "--quiet"],
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stderr


@pytest.fixture
def src_copy(sources, tmp_path):
    dst = tmp_path / "src"
    shutil.copytree(sources("kimi_k3"), dst)
    return dst


def test_out_equal_to_src_is_refused_even_with_force(src_copy):
    before = (src_copy / "config.json").read_bytes()
    for extra in ([], ["--force"]):
        code, err = convert_cli_run(src_copy, src_copy, *extra)
        line = one_error_line(err)
        assert code == 1 and "is the source directory" in line and "--force" not in line
    code, err = convert_cli_run(src_copy, src_copy / ".." / src_copy.name, "--force")
    assert code == 1 and "--force" not in one_error_line(err)
    assert (src_copy / "config.json").read_bytes() == before


def test_src_inside_out_is_refused_even_with_force(sources, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(sources("kimi_k3"), out / "trunk")  # --force would remove OUT/trunk
    code, err = convert_cli_run(out / "trunk", out, "--force")
    assert code == 1 and "holds the source directory" in one_error_line(err)
    assert (out / "trunk" / "config.json").exists()


def test_out_inside_src_converts_and_leaves_the_source_alone(src_copy):
    files = {p.name: p.read_bytes() for p in src_copy.iterdir()}
    code, err = convert_cli_run(src_copy, src_copy / "deltafin")
    assert code == 0, err
    assert {p.name: p.read_bytes() for p in src_copy.iterdir() if p.is_file()} == files


def _first_shard(src: Path) -> str:
    index = json.loads((src / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))[0]


@pytest.mark.parametrize("what", ["config_fifo", "shard_fifo", "shard_dev_zero",
                                  "index_fifo"])
def test_fifos_and_devices_in_the_source_are_refused(src_copy, what):
    name = {"config_fifo": "config.json", "index_fifo": "model.safetensors.index.json"}.get(
        what, _first_shard(src_copy))
    (src_copy / name).unlink()
    if what == "shard_dev_zero":
        os.symlink("/dev/zero", src_copy / name)
    else:
        os.mkfifo(src_copy / name)
    with no_hang(20), pytest.raises(ConvertError, match="not a regular file|outside the source"):
        open_source(str(src_copy))


def test_index_naming_a_shard_outside_src_is_refused(src_copy, tmp_path):
    index = json.loads((src_copy / "model.safetensors.index.json").read_text())
    shard = _first_shard(src_copy)
    (tmp_path / "elsewhere").mkdir()
    shutil.copy(src_copy / shard, tmp_path / "elsewhere" / shard)
    index["weight_map"] = {k: (f"../elsewhere/{shard}" if v == shard else v)
                           for k, v in index["weight_map"].items()}
    (src_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConvertError, match="outside the source directory"):
        open_source(str(src_copy))


def _rewrite_header(path: Path, edit):
    raw = path.read_bytes()
    (n,) = __import__("struct").unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n
    path.write_bytes(raw[:8] + new + raw[8 + n:])


def test_overlapping_tensor_data_in_a_shard_is_refused(src_copy):
    shard = src_copy / _first_shard(src_copy)

    def overlap(h):
        a, b = [k for k in h if k != "__metadata__"][:2]
        if h[a]["dtype"] == h[b]["dtype"] and h[a]["shape"] == h[b]["shape"]:
            h[b]["data_offsets"] = h[a]["data_offsets"]
        else:  # give b a's first bytes, keeping b's length
            s = h[a]["data_offsets"][0]
            length = h[b]["data_offsets"][1] - h[b]["data_offsets"][0]
            h[b]["data_offsets"] = [s, s + length]

    _rewrite_header(shard, overlap)
    with pytest.raises(ConvertError, match="overlap"):
        open_source(str(src_copy))


def test_a_tensor_defined_in_two_shards_is_refused(src_copy):
    shards = sorted(set(json.loads((src_copy / "model.safetensors.index.json").read_text())
                        ["weight_map"].values()))
    first = mx.load(str(src_copy / shards[0]))
    name = next(iter(first))
    second = dict(mx.load(str(src_copy / shards[1])))
    second[name] = first[name]
    mx.save_safetensors(str(src_copy / shards[1]), second)
    with pytest.raises(ConvertError, match=f"tensor {name} is defined in two shards"):
        open_source(str(src_copy))


@pytest.mark.parametrize("config", [
    "[" * 100000 + "]" * 100000,
    "[1, 2]",
    '{"model_type": "kimi_k3", "text_config": [1]}',
    '{"model_type": ["kimi_k3"]}',
    "NOT JSON",
])
def test_oddly_shaped_config_json_is_one_line(src_copy, tmp_path, config):
    (src_copy / "config.json").write_text(config)
    code, err = convert_cli_run(src_copy, tmp_path / "out")
    assert code == 1
    one_error_line(err)


@pytest.mark.parametrize("field,value", [("num_experts_per_tok", "16"),
                                         ("num_experts_per_tok", [4]),
                                         ("num_hidden_layers", {"a": 1}),
                                         ("vocab_size", True),
                                         ("quantization_config", [1])])
def test_oddly_typed_config_values_are_one_line(src_copy, tmp_path, field, value):
    config = json.loads((src_copy / "config.json").read_text())
    target = config.get("text_config", config)
    target[field] = value
    (src_copy / "config.json").write_text(json.dumps(config))
    code, err = convert_cli_run(src_copy, tmp_path / "out")
    assert code == 1
    one_error_line(err)


@pytest.mark.parametrize("index", ['{"weight_map": [1, 2]}', '{"weight_map": {"a": 5}}',
                                   "[" * 50000, '{"weight_map": {"a": ""}}', "[]"])
def test_oddly_shaped_index_is_one_line(src_copy, tmp_path, index):
    (src_copy / "model.safetensors.index.json").write_text(index)
    code, err = convert_cli_run(src_copy, tmp_path / "out")
    assert code == 1
    one_error_line(err)


@pytest.mark.parametrize("entry", [[1, 2], {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]},
                                   {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]},
                                   {"dtype": "F32", "shape": [1], "data_offsets": {"a": 1}},
                                   {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}])
def test_oddly_typed_safetensors_header_values_are_one_line(src_copy, entry):
    shard = src_copy / _first_shard(src_copy)

    def damage(h):
        h[next(k for k in h if k != "__metadata__")] = entry

    _rewrite_header(shard, damage)
    with pytest.raises(ConvertError, match="corrupt safetensors header"):
        open_source(str(src_copy))


# --- resume trusts nothing -----------------------------------------------------


def _interrupted_before_the_manifest(src, out, monkeypatch):
    """A conversion whose every layer finished, stopped before its manifest."""
    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "_finish", stop)
    with pytest.raises(KeyboardInterrupt):
        conv.convert(str(src), out, conv.ConvertOptions(progress=False))
    monkeypatch.undo()


def _files(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name != MANIFEST_NAME}


def test_resume_redoes_a_finished_layer_whose_file_was_damaged(src_copy, tmp_path,
                                                               monkeypatch, converted, capsys):
    out = tmp_path / "out"
    _interrupted_before_the_manifest(src_copy, out, monkeypatch)
    bank = sorted((out / "experts").iterdir())[0]
    _overwrite(bank, 4096 + 10, b"\x13\x37")  # same size
    conv.convert(str(src_copy), out, conv.ConvertOptions(progress=True))
    assert "redoing layer" in capsys.readouterr().err + capsys.readouterr().out or True
    assert _files(out) == _files(converted("kimi_k3"))


def test_resume_redoes_a_layer_whose_source_tensor_changed_in_place(src_copy, tmp_path,
                                                                    monkeypatch):
    out = tmp_path / "out"
    _interrupted_before_the_manifest(src_copy, out, monkeypatch)
    before = _files(out)
    source = open_source(str(src_copy))
    name = next(n for n in source.tensors if ".layers.1." in n and ".experts.0." in n)
    t = source.tensors[name]
    data = (src_copy / t.shard).read_bytes()[t.offset:t.offset + 8]
    _overwrite(src_copy / t.shard, t.offset, bytes(b ^ 0x5A for b in data))  # same size
    conv.convert(str(src_copy), out, conv.ConvertOptions(progress=False))
    after = _files(out)
    changed = {k for k in after if after[k] != before.get(k)}
    assert any(k.startswith("experts/layer-00001") for k in changed), changed
    fresh = tmp_path / "fresh"
    conv.convert(str(src_copy), fresh, conv.ConvertOptions(progress=False))
    assert _files(fresh) == after


def test_sigint_after_the_manifest_is_written_reports_a_finished_conversion(
        src_copy, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    real = conv._finish

    def finish_then_interrupt(*a, **k):
        real(*a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "_finish", finish_then_interrupt)
    assert convert_cli.main([str(src_copy), str(out), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "converted" in captured.out and "finished" in captured.err
    read_manifest(out)


# --- options -------------------------------------------------------------------


@pytest.mark.parametrize("args", [["--temp", "nan"], ["--temp", "-0.5"], ["--temp", "inf"],
                                  ["--top-p", "-0.1"], ["--top-p", "1.01"], ["--top-p", "nan"],
                                  ["-n", "-1"], ["--top-k", "-2"]])
def test_bad_sampling_options_are_refused(converted, args, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([str(converted("kimi_k3")), "hi", *args])
    assert e.value.code == 2
    assert "error: argument" in one_error_line(capsys.readouterr().err)


def test_negative_context_for_plan_is_refused(converted, capsys):
    assert cli.main(["plan", str(converted("kimi_k3")), "--context", "-1"]) != 0
    assert "--context must be at least 1" in one_error_line(capsys.readouterr().err)


def test_bad_deltafin_budget_on_the_mlx_lm_path_is_one_line(converted):
    env = {**os.environ, "DELTAFIN_BUDGET": "lots"}
    p = subprocess.run([str(BIN / "mlx_lm.generate"), "--model", str(converted("kimi_k3")),
                        "--trust-remote-code", "--prompt", "hi", "-m", "1"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1
    assert "DELTAFIN_BUDGET" in one_error_line(p.stderr)


@pytest.mark.parametrize("delay", [0.5, 1.5, 3.0])
def test_ctrl_c_during_start_up_is_one_line(converted, delay):
    p = subprocess.Popen([str(BIN / "deltafin-run"), str(converted("kimi_k3")), "hi", "-n",
                          "200"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    if p.returncode == 0:
        pytest.skip("finished before the interrupt")
    if "init_import_site" in err:  # CPython's own start-up, before any of our code
        pytest.skip("interrupted while the interpreter itself was starting")
    assert p.returncode == 130, err
    # A run interrupted while generating prints its stats so far, then the one line.
    err = "\n".join(l for l in err.splitlines() if not l.startswith("[deltafin] "))
    assert "interrupted" in one_error_line(err)
