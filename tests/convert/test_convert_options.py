"""Converter options that do not apply to a source are refused in one line."""

from helpers import one_line_error, run_tool


def test_expert_options_on_an_mxfp4_source_are_refused_in_one_line(sources, tmp_path):
    err = one_line_error(run_tool("deltafin-convert", sources("kimi_k3"), tmp_path / "out",
                             "--expert-bits", "8"))
    assert "--expert-bits/--expert-group-size" in err and "MXFP4" in err
    assert not (tmp_path / "out" / "deltafin.json").exists()
