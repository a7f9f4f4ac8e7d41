"""A Ctrl-C right as deltafin-convert finishes prints no KeyboardInterrupt
traceback: one landing in a finalizer (tqdm's __del__, as the finished progress
bar is collected), which Python would print as "Exception ignored" and drop, is
raised in the main code. A conversion whose manifest was written when the Ctrl-C
came has finished, and says so as any finished conversion does (its "converted"
line, status 0, no "interrupted"); the model is whole."""

import shutil
import signal
import subprocess
import time

from deltafin_mlx.format.manifest import MANIFEST_NAME, read_manifest
from helpers import BIN, run_convert_patched



def test_a_ctrl_c_in_a_finalizer_as_the_conversion_ends_is_one_line(sources, tmp_path):
    """Deterministic: an object collected inside the conversion's last step gets
    the SIGINT while its __del__ runs."""
    patch = ("import deltafin_mlx.convert.convert as library\n"
             "real = library.convert\n"
             "class Bar:\n"
             "    def __del__(self):\n"
             "        os.kill(os.getpid(), signal.SIGINT)\n"
             "        sum(range(1000))  # the handler runs here, inside the finalizer\n"
             "def convert(*a, **k):\n"
             "    m = real(*a, **k)\n"
             "    Bar()\n"
             "    return m\n"
             "library.convert = convert  # what the command imports when it runs\n")
    out = tmp_path / "out"
    p = run_convert_patched(patch, sources("mixtral"), out)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr and "KeyboardInterrupt" not in p.stderr, p.stderr
    assert "interrupted" not in p.stderr and p.stdout.startswith("converted "), p.stderr
    read_manifest(out)


# Delays after the manifest appears: the last writes, the progress bar's close and
# collection, the result line, the interpreter's exit.
DELAYS = [0, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.03, 0.1, 0.3]


def test_ctrl_c_once_the_manifest_is_written_finds_a_finished_conversion(sources, tmp_path):
    src = sources("kimi_k3")
    for delay in DELAYS:
        out = tmp_path / "out"
        shutil.rmtree(out, ignore_errors=True)
        p = subprocess.Popen([str(BIN / "deltafin-convert"), str(src), str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while not (out / MANIFEST_NAME).exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.0002)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        said, err = p.communicate(timeout=120)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (delay, err)
        assert p.returncode == 0 and "interrupted" not in err, (delay, p.returncode, err)
        assert said.startswith("converted "), (delay, said)
        read_manifest(out)
