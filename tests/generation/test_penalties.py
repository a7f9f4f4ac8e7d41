"""Repetition, presence and frequency penalties give mlx-lm's tokens in run, chat and batch."""

import json

import pytest

from deltafin_mlx.cli.main import main, run_parser
from deltafin_mlx.engine.load import open_tokenizer
from deltafin_mlx.format.model_dir import open_model_dir
from deltafin_mlx.generation.engine import chat_prompt

from helpers import run_json


PENALTIES = ["--repetition-penalty", "1.8", "--presence-penalty", "0.5", "--penalty-context", "8"]


def mlx_lm_tokens(reference, prompt, steps, **sampling):
    """mlx-lm itself, the model fully in memory, with mlx-lm's own processors."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(**sampling)
    out = []
    for token, _ in generate_step(mx.array(prompt), reference, max_tokens=steps,
                                  logits_processors=processors):
        out.append(int(token))
    return out


@pytest.mark.usefixtures("no_disk_measurement")
def test_penalties_in_run_chat_and_batch_give_mlx_lm_s_tokens(converted, references, capsys,
                                                                tmp_path):
    from mlx_lm.models.cache import load_prompt_cache

    from deltafin_mlx.cli.chat import cmd_chat

    model = converted("kimi_k3")
    tok = open_tokenizer(open_model_dir(model))
    prompt = chat_prompt(tok, [{"role": "user", "content": "Hello there"}])
    expected = mlx_lm_tokens(references("kimi_k3"), prompt, 12, repetition_penalty=1.8,
                             repetition_context_size=8, presence_penalty=0.5,
                             presence_context_size=8)
    plain = run_json(capsys, model, "Hello there", "-n", "12", "--budget", "200MB")["tokens"]
    assert expected != plain  # the penalties change the reply
    run = run_json(capsys, model, "Hello there", "-n", "12", "--budget", "200MB", *PENALTIES)
    assert run["tokens"] == expected

    session = tmp_path / "chat"
    args = run_parser().parse_args([str(model), "--chat", "-n", "12", "--budget", "200MB",
                                    "--session", str(session), *PENALTIES])
    import io, sys
    stdin, sys.stdin = sys.stdin, io.StringIO("Hello there\n")
    try:
        assert cmd_chat(args) == 0
    finally:
        sys.stdin = stdin
    tokens = json.loads(load_prompt_cache(str(session) + ".safetensors", return_metadata=True)[1]
                        ["tokens"])
    assert tokens == prompt + expected

    jobs = tmp_path / "in.jsonl"
    jobs.write_text('{"id": 1, "prompt": "Hello there"}\n')
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(model), str(jobs), "-o", str(out), "-n", "12", "--budget", "200MB",
                 *PENALTIES]) == 0
    assert json.loads(out.read_text())["tokens"] == expected
