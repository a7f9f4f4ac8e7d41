"""The drop-in patches mlx-lm only when mlx-lm builds a Deltafin model: importing
it (as any Deltafin code may) leaves mlx-lm's tokenizer loading and its server
classes as they are; loading a Deltafin directory with `mlx_lm.load` patches them,
once however many models are built. Each case runs in a fresh interpreter. A bad
DELTAFIN_SEQUENCES is one error line before anything loads."""

import os
import subprocess
import sys
import textwrap

import pytest

from deltafin_mlx.dropin.shim import load_for_mlx_lm


def run(code: str, **env):
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=600, env={**os.environ, **env})
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_importing_the_drop_in_patches_nothing():
    out = run("""
        import mlx_lm.server
        import mlx_lm.utils

        tokenizer = mlx_lm.utils.load_tokenizer
        next_request = mlx_lm.server.ResponseGenerator._next_request
        import deltafin_mlx.dropin.shim
        import deltafin_mlx.mlx_lm_shim  # the name older model directories import

        assert mlx_lm.utils.load_tokenizer is tokenizer
        assert not hasattr(mlx_lm.server.APIHandler, "_deltafin_guard")
        assert mlx_lm.server.ResponseGenerator._next_request is next_request
        print("untouched")
    """)
    assert out.split() == ["untouched"]


def test_loading_a_deltafin_directory_through_mlx_lm_patches_it_once(converted):
    out = run(f"""
        import mlx_lm
        import mlx_lm.utils

        original = mlx_lm.utils.load_tokenizer
        model, tokenizer = mlx_lm.load({str(converted("kimi_k3"))!r}, trust_remote_code=True)
        from deltafin_mlx.dropin import shim
        from deltafin_mlx.engine.runtime import runtime

        assert mlx_lm.utils.load_tokenizer is shim.load_tokenizer
        assert shim._mlx_lm_load_tokenizer is original
        runtime(model._inner).close()
        shim.make_classes({str(converted("kimi_k3"))!r})  # a second model: patched once
        assert shim._mlx_lm_load_tokenizer is original
        print(type(tokenizer).__name__)
    """, DELTAFIN_BUDGET="200MB")
    assert out.strip()


@pytest.mark.parametrize("value", ["\u00b2", "0", "many"])
def test_a_bad_deltafin_sequences_is_one_error_line(value, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("DELTAFIN_SEQUENCES", value)  # "\u00b2".isdigit(), but not int()
    with pytest.raises(SystemExit) as exit_:
        load_for_mlx_lm(tmp_path)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("deltafin: error: DELTAFIN_SEQUENCES=") and err.count("\n") == 1, err
