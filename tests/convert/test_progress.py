"""The converter's progress: one bar ending at 100%, notes on stderr, Ctrl-C while it reports."""

import re

from deltafin_mlx.cli import convert as convert_cli
from deltafin_mlx.format.manifest import read_manifest

from helpers import run_convert_patched, run_tool


def test_progress_ends_at_100_percent_with_rates_and_notes_go_to_stderr(tmp_path, sources, capsys):
    assert convert_cli.main([str(sources("kimi_k3")), str(tmp_path / "o")]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("converted ") and len(captured.out.splitlines()) == 1
    assert "note: skipping" in captured.err  # K3's vision tensors
    final = captured.err.replace("\r", "\n").strip().splitlines()[-1]
    assert final.startswith("converted: 100%"), final
    assert re.search(r"[0-9.]+[kMG]?B/s", final) and re.search(r"[0-9.]+ layers/s", final), final


def test_the_converters_bar_ends_once(sources, tmp_path):
    out = run_tool("deltafin-convert", sources("kimi_k3"), tmp_path / "out")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("100%") == 1, out.stderr


def test_ctrl_c_while_the_converter_reports_is_not_a_traceback(sources, tmp_path):
    """Ctrl-C just after the manifest is written (here: while the result is printed)
    changes nothing and prints no KeyboardInterrupt traceback."""
    patch = ("real = c.human_bytes\n"
             "def late_ctrl_c(n):\n"
             "    os.kill(os.getpid(), signal.SIGINT)\n"
             "    return real(n)\n"
             "c.human_bytes = late_ctrl_c\n")
    out = tmp_path / "out"
    p = run_convert_patched(patch, sources("mixtral"), out, "--quiet")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "converted" in p.stdout
    read_manifest(out)
