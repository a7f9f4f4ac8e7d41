"""`deltafin-run info`: what the manifest says, shown safely."""

import json

import deltafin_mlx
import deltafin_mlx.cli.convert
from deltafin_mlx.cli.main import main
from deltafin_mlx.format.manifest import MANIFEST_NAME, read_manifest


def test_info_describes_the_model(converted, capsys):
    model = converted("kimi_k3")
    assert main(["info", str(model), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    m = read_manifest(model)
    assert r["architecture"] == "kimi_k3" and r["layers"] == 4 and r["moe_layers"] == 3
    assert (r["experts_per_layer"], r["experts_per_token"]) == (16, 4)
    assert r["quantization"]["experts"]["mode"] == "mxfp4"
    assert r["bytes"]["total"] == sum(m.files.values())
    assert r["bytes"]["experts"] == sum(s for f, s in m.files.items() if f.endswith(".bank"))
    assert r["source"] == m.source["id"] and r["converted"] == m.source["converted"]
    assert r["converted_by"] == deltafin_mlx.__version__
    assert main(["info", str(model)]) == 0
    text = capsys.readouterr().out
    for word in ("architecture   kimi_k3, 4 layers", "16 per MoE layer", "mxfp4", "size on disk",
                 m.source["id"], m.source["converted"]):
        assert word in text, text


def test_every_model_is_named_by_its_model_type_as_mlx_lm_names_it(converted, capsys):
    """One display rule: config.json's model_type, never a mix of marketing names
    (Qwen3-MoE) and model types (glm4_moe)."""
    for model_type in ("kimi_k3", "qwen3_moe", "mixtral"):
        assert main(["info", str(converted(model_type))]) == 0
        line = capsys.readouterr().out.splitlines()[1]
        assert line.startswith(f"architecture   {model_type}, "), line
        assert main(["info", str(converted(model_type)), "--json"]) == 0
        assert "architecture_name" not in json.loads(capsys.readouterr().out)
    for name in ("Kimi K3", "Qwen3-MoE", "Mixtral"):
        assert name not in deltafin_mlx.cli.convert.build_parser().description


def test_info_reads_a_manifest_from_before_it_recorded_the_version(converted, copy_of, capsys):
    model = copy_of(converted("mixtral"))
    manifest = json.loads((model / MANIFEST_NAME).read_text())
    del manifest["source"]["deltafin_version"]
    (model / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert main(["info", str(model)]) == 0
    assert "converted      20" in capsys.readouterr().out


def test_info_shows_escape_sequences_from_the_manifest_escaped(converted, copy_of, capsys):
    path = copy_of(converted("qwen3_moe"))
    d = json.loads((path / MANIFEST_NAME).read_text())
    d["source"]["id"] = "evil\x1b]0;owned\x07\x1b[2J\u202e"
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out
    assert "evil\\x1b]0;owned\\x07\\x1b[2J\\u202e" in out
