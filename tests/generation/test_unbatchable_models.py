"""A model whose caches mlx-lm's BatchGenerator cannot merge (llama4's chunked
cache, deepseek_v41's own) is batched one sequence at a time: each gets the
tokens `stream` gives it alone, where mlx-lm's batch_generate refuses; a model
whose caches merge is decoded together (tests/generation/test_one_engine.py)."""

import pytest
from mlx_lm.generate import batch_generate

from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.engine.load import load
from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.generation.engine import (Completion, Defaults, Scheduler, batch, batchable,
                                            complete, model_limits, prepare, stream)
from deltafin_mlx.generation.request import GenerationRequest
from deltafin_mlx.testing import zoo

PROMPTS = ["the experts stream from disk while the trunk stays in memory " * 3, "Hello there",
           "Count to five."]


@pytest.mark.parametrize("model_type", ["llama4", "deepseek_v41"])
def test_a_model_mlx_lm_cannot_batch_runs_each_sequence_as_stream_does(model_type, tmp_path):
    convert(str(zoo.write(tmp_path / "src", model_type, 4)), tmp_path / "out",
            ConvertOptions(progress=False))
    model, tok = load(tmp_path / "out", "200MB")
    try:
        assert not batchable(model)
        with pytest.raises(ValueError, match="does not yet support batching"):
            batch_generate(model, tok, [tok.encode(p) for p in PROMPTS], max_tokens=2)
        prepareds = [prepare(GenerationRequest(prompt=p), tok, model_limits(model),
                             Defaults(max_tokens=6)) for p in PROMPTS]
        got = {}
        for p, e in batch(model, prepareds, Scheduler(batch_size=3)):
            assert not isinstance(e, Exception), e
            got.setdefault(id(p), Completion()).add(e)
        for p in prepareds:
            want = complete(stream(model, p))
            assert got[id(p)].tokens == want.tokens and len(want.tokens) == 6
            assert got[id(p)].stats.mean_batch == 1
    finally:
        runtime(model).close()


def test_a_model_whose_caches_merge_is_batchable():
    assert batchable(zoo.build(zoo.config("qwen3_moe", 64)))
