"""config.json edited and resealed: values the model rules refuse."""

import json

import pytest

from deltafin_mlx.engine.load import load
from deltafin_mlx.testing.decode import load_resident
from deltafin_mlx.format.manifest import ModelError

from helpers import LOAD, reseal


@pytest.mark.parametrize("key,value,why", [
    ("num_experts_per_tok", 2, "experts per token"),
    ("num_local_experts", 4, "experts of"),
    ("vocab_size", 2048, "embed_tokens"),
    ("tie_word_embeddings", True, "lm_head"),
    ("num_hidden_layers", 2, "layers"),
])
def test_config_edited_and_resealed_is_refused(converted, copy_of, key, value, why):
    path = copy_of(converted("mixtral"))
    config = json.loads((path / "config.json").read_text())
    assert key in config or key == "tie_word_embeddings"
    config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    reseal(path, "config.json")
    with pytest.raises(ModelError, match=why):
        load(path, **LOAD)
    with pytest.raises(ModelError, match=why):
        load_resident(path)
