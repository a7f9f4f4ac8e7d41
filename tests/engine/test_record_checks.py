"""Expert records and trunk headers checked as they are read: random bytes refused without
--verify, each record checked on its first read only."""

import pytest

from deltafin_mlx.cli.main import main
from deltafin_mlx.engine.load import load
from deltafin_mlx.format.manifest import ModelError, read_manifest

from helpers import LOAD, only_stderr_line, overwrite_bytes


def test_a_damaged_trunk_header_read_by_the_streamer_is_one_line(converted, copy_of,
                                                                   monkeypatch):
    """Streamed trunk layers and embedding rows are read where the file's own header
    says: that header is checked too (here with load-time checksums off)."""
    import deltafin_mlx.format.integrity as integrity

    monkeypatch.setattr(integrity.check_small_files, "__defaults__", (0,))
    path = copy_of(converted("kimi_k3"))
    rel = read_manifest(path, check_files=False).trunk_files["globals"]
    overwrite_bytes(path / rel, 60, b"\xff\xfe")  # inside the JSON header
    with pytest.raises(ModelError, match=rf"{rel}: corrupt safetensors header|unreadable trunk"):
        load(path, memory_budget="18200000", **LOAD)


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
    line = only_stderr_line(capsys.readouterr().err)
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
