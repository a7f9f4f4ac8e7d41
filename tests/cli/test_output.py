"""What the commands print when output goes wrong: a closed pipe, Ctrl-C at start-up, escape
sequences in a path."""

import signal
import subprocess
import time

import pytest

from deltafin_mlx.cli.main import main

from helpers import BIN, only_stderr_line


@pytest.mark.parametrize("command", ["plan", "info"])
def test_output_into_a_closed_pipe_ends_quietly(command, converted):
    args = [str(BIN / "deltafin-run"), command, str(converted("kimi_k3"))]
    if command == "plan":
        args += ["--disk-gbps", "2", "--compute-gwps", "3"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # as `| head` does once it has read enough
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141
    assert err == "", err


def test_plan_piped_to_head_prints_no_traceback(converted):
    p = subprocess.run(f"{BIN / 'deltafin-run'} plan {converted('kimi_k3')} --disk-gbps 2 "
                       "--compute-gwps 3 | head -1", shell=True, capture_output=True, text=True)
    assert p.stdout.startswith("model") and p.stderr == ""


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
    assert "interrupted" in only_stderr_line(err)


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
    line = only_stderr_line(err)
    assert "\x1b" not in err and "\x07" not in err
    assert "evil\\x1b[31m\\x07model" in line and "tokenizer_config.json" in line
