"""Token ids outside the vocabulary are an error, through the API and the mlx-lm drop-in."""

import mlx.core as mx
import pytest

from deltafin_mlx import runtime
from deltafin_mlx.engine.load import TokenIdError, load
from deltafin_mlx.testing.decode import load_resident

from helpers import LOAD


@pytest.mark.parametrize("bad", [100000, 1024, -1])
def test_out_of_vocabulary_ids_are_an_error_through_the_api(converted, bad):
    model, _ = load(converted("kimi_k3"), **LOAD)
    vocab = type(model.language_model.model.embed_tokens).vocab_size
    assert vocab == 1024
    with pytest.raises(TokenIdError, match=rf"token id {bad} is outside the vocabulary"):
        model(mx.array([[3, bad, 5]]))
    model(mx.array([[0, vocab - 1]]))  # the edges are fine
    runtime(model).close()
    resident = load_resident(converted("kimi_k3"))
    with pytest.raises(TokenIdError):
        resident(mx.array([[bad]]))


def test_out_of_vocabulary_ids_through_the_mlx_lm_drop_in(converted):
    from deltafin_mlx.dropin.shim import make_classes

    Model, ModelArgs = make_classes(converted("kimi_k3"))
    m = Model(ModelArgs())
    with pytest.raises(TokenIdError):
        m(mx.array([[100000]]))
    runtime(m).close()
