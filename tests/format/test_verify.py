"""`deltafin-run verify`: every file and record checked, the damaged ones named, progress shown."""

import json
import re

from deltafin_mlx.format.bank import read_layout
from deltafin_mlx.format.manifest import MANIFEST_NAME, read_manifest
from deltafin_mlx.format.verify import verify_model

from helpers import overwrite_bytes, reseal, run_cli, run_command, run_main


def test_verify_checks_every_record_with_progress(converted):
    from deltafin_mlx.format.verify import verify_model

    calls = []
    report = verify_model(converted("kimi_k3"), progress=lambda d, t: calls.append((d, t)))
    m = read_manifest(converted("kimi_k3"))
    assert report.ok and report.records_checked == 16 * 3
    assert report.bytes_checked == sum(m.files.values())  # every byte of every file
    assert calls[0][0] == 0 and calls[-1] == (report.bytes_checked, report.bytes_checked)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_verify_names_every_damaged_file_and_record(converted, copy_of):
    model = copy_of(converted("kimi_k3"))
    m = read_manifest(model)
    bank = m.bank_path(1)
    layout = read_layout(bank)
    data = bytearray(bank.read_bytes())
    for expert in (5, 11):
        data[layout.record_offset(expert) + 100] ^= 0xFF
    bank.write_bytes(bytes(data))
    other = m.bank_path(2)
    other.write_bytes(other.read_bytes()[:-4096])
    p = run_command(["verify", model])
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert any("experts/layer-00001.bank: record 5 (layer 1 expert 5)" in l for l in lines)
    assert any("experts/layer-00001.bank: record 11" in l for l in lines)
    assert any("experts/layer-00002.bank" in l and "truncated" in l for l in lines)
    assert lines[-1].endswith(f"3 problem(s) found; {len(m.files)} files, 32 expert records "
                              f"({lines[-1].split('(')[-1]}")
    good = run_command(["verify", converted("kimi_k3")])
    assert good.returncode == 0 and ": OK: " in good.stdout, good.stderr


def test_verify_names_the_damaged_bank_record(converted, copy_of):
    path = copy_of(converted("kimi_k3"))
    m = read_manifest(path)
    layer = m.moe_layers[-1]
    from deltafin_mlx.format.bank import read_layout

    layout = read_layout(m.bank_path(layer))
    overwrite_bytes(m.bank_path(layer), layout.record_offset(5) + 17, b"\x55\xaa")
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
