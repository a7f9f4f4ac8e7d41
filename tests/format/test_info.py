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
    # On this CPU a run computes in float32 unless told; mlx-lm in the saved bf16.
    assert r["activation_dtype"] == {"auto": "float32", "model": m.dtype} and m.dtype == "bfloat16"
    assert main(["info", str(model)]) == 0
    text = capsys.readouterr().out
    for word in ("architecture   kimi_k3, 4 layers", "16 per MoE layer", "mxfp4", "size on disk",
                 "activations    float32 here by default; bfloat16 with --activation-dtype model",
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


def test_info_and_list_show_each_parts_quantization_not_config_jsons_default(tmp_path, capsys):
    """gpt-oss as mlx-community publishes it: mxfp4 at config.json's top level, while
    its attention is affine 4-bit/64 and its router 8-bit (per-module entries)."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    from deltafin_mlx.convert.convert import ConvertOptions, convert
    from deltafin_mlx.testing import zoo
    from deltafin_mlx.testing.tokenizers import write_bpe_tokenizer_files

    src = tmp_path / "gpt-oss-mxfp4"
    src.mkdir()
    vocab, _ = write_bpe_tokenizer_files(src, "qwen3_moe")
    model = zoo.build(zoo.config("gpt_oss", vocab))

    def recipe(path, module):
        if "attn" in path:
            return {"group_size": 64, "bits": 4, "mode": "affine"}
        return {"group_size": 64, "bits": 8, "mode": "affine"} if path.endswith("router") else True

    model, cfg = quantize_model(model, zoo.config("gpt_oss", vocab), 32, 4, mode="mxfp4",
                                quant_predicate=recipe)
    save_model(src, model, donate_model=True)
    save_config(cfg, config_path=src / "config.json")
    assert cfg["quantization"]["mode"] == "mxfp4"  # all that the top level says
    out = tmp_path / "models" / "gpt-oss"
    convert(str(src), str(out), ConvertOptions(progress=False))
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    parts = json.loads(capsys.readouterr().out)["quantization_by_part"]
    assert (parts["attention"], parts["router"], parts["experts"]) == (
        ["affine 4-bit/64"], ["affine 8-bit/64"], ["mxfp4"])
    said = "mxfp4 except attention affine 4-bit/64, router affine 8-bit/64"
    assert main(["info", str(out)]) == 0
    assert f"quantization   {said} (experts carried over" in capsys.readouterr().out
    assert main(["list", str(tmp_path / "models")]) == 0
    assert f"  {said}  " in capsys.readouterr().out
