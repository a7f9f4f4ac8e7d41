"""A manifest's switch_path names the routed-expert module whose parameters are the
bank's records: the trunk holds nothing under it (its parent may be a wrapper with no
parameters of its own, gemma4's `experts.switch_glu`, or the MoE block beside its
router)."""

import json
import shutil

import pytest

from deltafin_mlx.errors import ModelError
from deltafin_mlx.format.manifest import MANIFEST_NAME, read_manifest


def _with_manifest(converted, tmp_path, edit):
    src = converted("qwen3_moe")
    d = json.loads((src / MANIFEST_NAME).read_text())
    edit(d)
    out = tmp_path / "model"
    shutil.copytree(src, out)
    (out / MANIFEST_NAME).write_text(json.dumps(d))
    return out


def test_a_trunk_tensor_under_the_switch_path_is_refused(converted, tmp_path):
    def edit(d):
        entry = next(iter(d["experts"]["layers"].values()))
        info = next(iter(d["tensors"].values()))
        d["tensors"][f"{entry['switch_path']}.gate_proj.weight"] = dict(info)

    with pytest.raises(ModelError, match="the trunk holds tensors under it"):
        read_manifest(_with_manifest(converted, tmp_path, edit), check_files=False)


def test_a_switch_path_under_a_wrapper_with_no_parameters_is_accepted(converted, tmp_path):
    def edit(d):
        for entry in d["experts"]["layers"].values():
            entry["switch_path"] += ".switch_glu"  # its parent holds no trunk tensor

    m = read_manifest(_with_manifest(converted, tmp_path, edit), check_files=False)
    assert m.switch_path(m.moe_layers[0]).endswith(".switch_glu")


def test_a_switch_path_names_its_layer(converted, tmp_path):
    def edit(d):
        layer, entry = next(iter(d["experts"]["layers"].items()))
        entry["switch_path"] = entry["switch_path"].replace(f".{layer}.", f".{int(layer) + 1}.")

    with pytest.raises(ModelError, match="switch_path"):
        read_manifest(_with_manifest(converted, tmp_path, edit), check_files=False)
