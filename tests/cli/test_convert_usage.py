"""deltafin-convert's usage errors are one line, as deltafin-run's are: the error,
then where the help is, exit status 2; never the whole usage block."""

import subprocess

import pytest
from helpers import BIN



@pytest.mark.parametrize("args, named", [
    (["SRC", "OUT", "--scratch-limit", "-1GB"], "-1GB"),
    (["SRC", "OUT", "--bits", "5"], "--bits"),
    (["SRC", "OUT", "--no-such-option"], "--no-such-option"),
    (["SRC"], "out"),
    (["SRC", "OUT", "--ranks", "two"], "--ranks"),
])
def test_a_convert_usage_error_is_one_line(tmp_path, args, named):
    r = subprocess.run([str(BIN / "deltafin-convert"), *args], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("deltafin-convert: error: ") and named in lines[0], lines[0]
    assert "deltafin-convert --help" in lines[0]
    assert not list(tmp_path.iterdir())  # nothing written
