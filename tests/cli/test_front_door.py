"""The front door is lazy: `import deltafin_mlx`, `deltafin-run --version`, `--help`,
`list` (of models too: their floors are planned from the manifest) and `rm --help` load neither mlx-lm (whose
package import pulls in its generation code and transformers) nor MLX's runtime,
and the converter's process imports no module of the runtime above it.

Each case runs in a fresh interpreter and reads its `sys.modules` at the end.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltafin_mlx.format.manifest import MANIFEST_NAME

# What a command that loads no model must not import.
HEAVY = ("mlx_lm", "mlx_lm.generate", "transformers")
# The stages above the converter: its process imports none of them.
RUNTIME = ("deltafin_mlx.engine", "deltafin_mlx.generation", "deltafin_mlx.chat",
           "deltafin_mlx.jobs", "deltafin_mlx.server", "deltafin_mlx.dropin")


def modules_after(code: str, tmp_path) -> set:
    """The modules a fresh interpreter holds after running `code` (whose SystemExit,
    as argparse's --help and --version raise, ends it as usual)."""
    out = tmp_path / "modules.json"
    script = (f"import sys, json, atexit\n"
              f"atexit.register(lambda: open({str(out)!r}, 'w').write(json.dumps(sorted(sys.modules))))\n"
              f"{code}\n")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300)
    assert out.exists(), p.stderr
    return set(json.loads(out.read_text())), p


def of(found: set, names) -> list:
    return sorted(m for m in found if m in names or m.startswith(tuple(n + "." for n in names)))


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["rm", "--help"], ["list", "EMPTY"],
                                  ["list", "EMPTY", "--json"]])
def test_commands_that_load_no_model_import_neither_mlx_lm_nor_transformers(argv, tmp_path):
    (tmp_path / "empty").mkdir()
    argv = [str(tmp_path / "empty") if a == "EMPTY" else a for a in argv]
    found, p = modules_after(f"from deltafin_mlx.cli.main import main\nsys.exit(main({argv!r}))",
                             tmp_path)
    assert p.returncode == 0, p.stderr
    assert of(found, HEAVY) == []


def test_list_of_converted_models_imports_neither_mlx_lm_nor_transformers(converted, tmp_path):
    import shutil

    shutil.copytree(converted("qwen3_moe"), tmp_path / "models" / "qwen3")
    argv = ["list", str(tmp_path / "models")]
    found, p = modules_after(f"from deltafin_mlx.cli.main import main\nsys.exit(main({argv!r}))",
                             tmp_path)
    assert p.returncode == 0 and "qwen3" in p.stdout, p.stderr
    assert of(found, HEAVY) == []


def test_help_lists_every_command_without_importing_one(tmp_path):
    from deltafin_mlx.cli.main import COMMANDS

    found, p = modules_after("from deltafin_mlx.cli.main import main\nsys.exit(main(['--help']))",
                             tmp_path)
    for c in COMMANDS:
        assert f"  {c.name} " in p.stdout, c.name
    modules = {f"deltafin_mlx.cli.{t.partition(':')[0]}" for c in COMMANDS for t in (c.run, c.parser)}
    assert of(found, modules - {"deltafin_mlx.cli.main"}) == []


def test_the_package_imports_nothing_heavy(tmp_path):
    found, p = modules_after("import deltafin_mlx", tmp_path)
    assert p.returncode == 0, p.stderr
    assert of(found, HEAVY + ("mlx",) + RUNTIME) == []


def test_the_converter_imports_no_runtime_module(tmp_path):
    modules = sorted(f"deltafin_mlx.convert.{p.stem}" for p in
                     (Path(__file__).parents[2] / "deltafin_mlx" / "convert").glob("*.py"))
    code = "\n".join(f"import {m}" for m in modules + ["deltafin_mlx.cli.convert"])
    found, p = modules_after(code, tmp_path)
    assert p.returncode == 0, p.stderr
    assert of(found, RUNTIME) == []


def test_a_conversion_imports_no_runtime_module(sources, tmp_path):
    src, out = sources("kimi_k3"), tmp_path / "out"
    found, p = modules_after("from deltafin_mlx.cli.convert import main\n"
                             f"sys.exit(main([{str(src)!r}, {str(out)!r}, '--quiet']))", tmp_path)
    assert p.returncode == 0, p.stderr
    assert (out / MANIFEST_NAME).exists()
    assert of(found, RUNTIME) == []
