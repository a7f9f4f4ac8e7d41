"""Every command downstream of conversion runs on a family the project did not convert
before (gpt_oss through mlx-lm's own class): plan, info, verify, score, batch, serve
and the mlx-lm drop-in."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load

from deltafin_mlx.cli.main import main
from deltafin_mlx.convert.convert import ConvertOptions, convert
from deltafin_mlx.format.manifest import read_manifest
from deltafin_mlx.format.verify import verify_model
from deltafin_mlx.testing import zoo
from deltafin_mlx.testing.server import chat, expected_reply, free_port, start_server, stop_server


FAMILY = "gpt_oss"


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(mlx-lm's 4-bit directory, its conversion) of the tiny gpt-oss."""
    root = tmp_path_factory.mktemp(FAMILY)
    src = zoo.write(root / "mlx-community", FAMILY, bits=4)
    convert(str(src), root / "out", ConvertOptions(progress=False))
    return src, root / "out"


def test_plan_sizes_the_new_family_before_and_after_conversion(family, capsys):
    src, out = family
    plans = []
    for model in (src / "config.json", out):
        assert main(["plan", str(model), "--budget", "50MB", "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    before, after = plans
    for plan in plans:
        assert plan["model_type"] == FAMILY
        assert (plan["experts_per_layer"], plan["experts_per_token"], plan["moe_layers"]) == \
            (zoo.NUM_EXPERTS, 2, 2)
    # Sized from config.json alone, as the conversion then lays it out.
    for key in ("whole_expert_record_bytes", "expert_bytes_on_disk", "whole_trunk_bytes",
                "floor_bytes"):
        assert before[key] == after[key], key
    assert main(["plan", str(out), "--budget", "50MB"]) == 0
    assert "experts" in capsys.readouterr().out


def test_info_and_verify_describe_and_check_the_new_family(family, capsys):
    _, out = family
    m = read_manifest(out)
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"] == FAMILY
    assert (info["experts_per_layer"], info["experts_per_token"]) == (zoo.NUM_EXPERTS, 2)
    assert info["moe_layers"] == len(m.moe_layers) == 2
    report = verify_model(out)
    assert report.ok and report.records_checked == zoo.NUM_EXPERTS * len(m.moe_layers)
    assert main(["verify", str(out)]) == 0
    assert ": OK: " in capsys.readouterr().out


def test_score_gives_mlx_lms_log_probabilities(family, tmp_path):
    src, out = family
    text = "The router scores every expert and keeps the top k."
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": 1, "text": text}) + "\n")
    assert main(["score", str(out), str(tmp_path / "in.jsonl"), "-o",
                 str(tmp_path / "out.jsonl"), "--budget", "50MB", "--no-progress"]) == 0
    line = json.loads((tmp_path / "out.jsonl").read_text())
    model, tokenizer = mlx_lm_load(str(src))
    ids = tokenizer.encode(text)
    model.set_dtype(mx.float32)
    logits = model(mx.array([ids]))[0, :-1].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = np.array(mx.take_along_axis(logprobs, mx.array(ids[1:])[:, None], axis=-1))[:, 0]
    assert line["tokens"] == ids
    got = np.array(line["token_logprobs"][1:], dtype=np.float32)
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_batch_answers_each_prompt_as_deltafin_run_does(family, tmp_path):
    _, out = family
    prompts = ["Hello there", "Stream the experts"]
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    assert main(["batch", str(out), str(tmp_path / "in.jsonl"), "-o",
                 str(tmp_path / "out.jsonl"), "--budget", "50MB", "-n", "6", "--temp", "0",
                 "--no-progress"]) == 0
    answers = {json.loads(l)["id"]: json.loads(l) for l in
               (tmp_path / "out.jsonl").read_text().splitlines()}
    for i, p in enumerate(prompts):
        assert answers[i]["text"] == expected_reply(out, p, 6), answers[i]


@pytest.mark.parametrize("server", ["deltafin", "mlx_lm"])
def test_serve_and_the_mlx_lm_drop_in_answer_as_deltafin_run(family, server, tmp_path):
    _, out = family
    port = free_port()
    proc = start_server(out, port, "50MB", tmp_path / "server.log", server=server)
    try:
        for stream in (False, True):
            assert chat(port, "Hello there", 6, stream) == expected_reply(out, "Hello there", 6)
    finally:
        stop_server(proc)
