"""`--force` replaces only a Deltafin output or an unfinished conversion."""

from deltafin_mlx.cli import convert as convert_cli
from deltafin_mlx.format.manifest import MANIFEST_NAME, read_manifest

from helpers import only_stderr_line


def convert_run(capsys, *args):
    code = convert_cli.main([*map(str, args), "--quiet"])
    return code, capsys.readouterr().err


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
        line = only_stderr_line(err)
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
