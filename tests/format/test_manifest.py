"""The manifest read defensively: huge, without checksums, skipping a file, odd integers."""

import json

import pytest

from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.manifest import MANIFEST_NAME, read_manifest

from helpers import no_hang


def test_a_huge_manifest_is_refused_without_reading_it(converted, copy_of):
    path = copy_of(converted("kimi_k3"))
    with open(path / MANIFEST_NAME, "r+b") as f:
        f.truncate(1 << 40)  # sparse: 1 TB that reads as zeros
    with no_hang(10), pytest.raises(ModelError, match="more than the"):
        read_manifest(path)


def test_a_checksum_list_that_skips_a_file_is_a_corrupt_manifest(converted, copy_of):
    path = copy_of(converted("kimi_k3"))
    d = json.loads((path / MANIFEST_NAME).read_text())
    del d["checksums"]["config.json"]
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ModelError, match="checksums must name exactly the listed files"):
        read_manifest(path)


@pytest.mark.parametrize("checksums", [None, {}])
def test_a_manifest_without_checksums_is_refused(converted, copy_of, checksums):
    path = copy_of(converted("qwen3_moe"))
    d = json.loads((path / MANIFEST_NAME).read_text())
    if checksums is None:
        del d["checksums"]
    else:
        d["checksums"] = checksums
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ModelError, match="no checksums|checksums must name exactly"):
        read_manifest(path)


@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_a_format_version_that_only_equals_an_integer_is_refused(converted, copy_of, version):
    """JSON true is not format version 1 (Python's True == 1), nor is 1.0 or "1"."""
    path = copy_of(converted("qwen3_moe"))
    d = json.loads((path / MANIFEST_NAME).read_text())
    d["format_version"] = version
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ModelError, match="format version .* is not supported"):
        read_manifest(path)


@pytest.mark.parametrize("layer", [True, 1.0])
def test_a_link_table_whose_layer_only_equals_an_integer_is_refused(tmp_path, layer):
    """A link table saying layer true is not layer 1's table."""
    import numpy as np

    from deltafin_mlx.format.bank import Section
    from deltafin_mlx.format.links import ENTRY, read_links, write_links

    section = Section("gate_proj.weight", "uint8", (4,), 0, 4)
    experts = {"num_experts": 2, "record_size": 64, "sections": [section.to_dict()]}
    path = tmp_path / "layer-00001.links"
    write_links(path, 1, [section.name], ["model.safetensors"], np.zeros((2, 1), ENTRY),
                np.zeros(2, "<u4"))
    files = {"model.safetensors": {"size": 64}}
    assert read_links(path, experts, 1, files).num_experts == 2  # as written: reads
    write_links(path, layer, [section.name], ["model.safetensors"], np.zeros((2, 1), ENTRY),
                np.zeros(2, "<u4"))
    with pytest.raises(ModelError, match="corrupt link table .*layer .* is not an integer"):
        read_links(path, experts, 1, files)


@pytest.mark.parametrize("edit, said", [
    (lambda e: e.update(record_size=e["record_size"] + 4096), "record_size does not match"),
    (lambda e: e.pop("quantization"), "sections without quantization"),
    (lambda e: e["quantization"]["linears"]["down_proj"].update(bits=4),
     "scales shape .* does not fit"),
])
def test_a_layers_own_expert_layout_is_checked_as_the_models_is(sources, tmp_path, edit, said):
    """mlx-lm's mixed_* recipes: a layer quantized otherwise than the first has its own
    quantization, sections and record size in its entry, each checked."""
    from deltafin_mlx.convert.convert import ConvertOptions, convert
    from deltafin_mlx.testing.mlx_lm_format import write_mlx_lm_format

    src = write_mlx_lm_format(sources("qwen3_moe"), tmp_path / "src", 4, recipe="mixed_3_6")
    path = tmp_path / "out"
    convert(str(src), path, ConvertOptions(progress=False))
    assert read_manifest(path).mixed
    d = json.loads((path / MANIFEST_NAME).read_text())
    edit(next(e for e in d["experts"]["layers"].values() if "quantization" in e))
    (path / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(ModelError, match=said):
        read_manifest(path)
