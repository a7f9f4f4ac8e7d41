"""A model's chat template runs within one bound of time and output size
(tokenizer/jinja.py's BoundedSandbox), whatever renders it: Deltafin's own
renderer for K2, transformers for a Hugging Face template (compat.bound_chat_templates).
A template that loops or multiplies a string is one error line in `run`, `chat` and
`batch` (an error line in the output), a 400 in `serve`, which goes on answering."""

import io
import json
import shutil
import sys

import pytest

import deltafin_mlx.tokenizer.jinja as jinja
from deltafin_mlx.cli.main import main
from deltafin_mlx.testing.server import free_port, post, start_server, stop_server
from helpers import reseal, run_main

TEMPLATES = {
    "loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "multiplier": '{{ "a" * 10000000000 }}',
}
SAYS = {"loop": "the chat template ran over",
        "multiplier": "the chat template uses a value of 10000000000 items"}


@pytest.fixture(scope="module")
def hostile(converted, tmp_path_factory):
    """name -> a copy of a Hugging Face model whose chat template is that template."""
    root = tmp_path_factory.mktemp("hostile_templates")
    out = {}
    for name, template in TEMPLATES.items():
        model = root / name
        shutil.copytree(converted("qwen3_moe"), model)
        config = json.loads((model / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (model / "tokenizer_config.json").write_text(json.dumps(config))
        assert not (model / "chat_template.jinja").exists()
        reseal(model, "tokenizer_config.json")
        out[name] = model
    return out


@pytest.fixture
def short_bound(monkeypatch):
    monkeypatch.setattr(jinja, "JINJA_MAX_SECONDS", 1.0)


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_hostile_template_is_one_line_in_run(hostile, name, short_bound, capsys):
    code, line = run_main(capsys, hostile[name], "hi", "-n", "1")
    assert code == 1 and SAYS[name] in line and len(line) < 200, line


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_hostile_template_is_one_line_in_chat(hostile, name, short_bound, capsys,
                                                 monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    assert main([str(hostile[name]), "--chat", "-n", "1"]) == 1
    err = capsys.readouterr().err
    banner, line = err.strip().splitlines()  # the chat's greeting, then the error
    assert banner.startswith("Deltafin chat:") and "Traceback" not in err
    assert SAYS[name] in line and len(line) < 200, line


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_hostile_template_is_an_error_line_in_batch(hostile, name, short_bound, capsys,
                                                       tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"id": 1, "messages": [{"role": "user", "content": "hi"}]}))
    assert main(["batch", str(hostile[name]), str(requests), "-o", str(tmp_path / "out.jsonl"),
                 "-n", "1"]) == 1
    err = capsys.readouterr().err
    stats, line = err.strip().splitlines()  # the batch's stats line, then the error
    assert stats.startswith("[deltafin] 1 requests") and "Traceback" not in err
    assert "every line failed" in line and SAYS[name] in line, line
    (result,) = [json.loads(r) for r in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert SAYS[name] in result["error"]


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_hostile_template_is_a_400_in_serve_which_goes_on_answering(hostile, name, tmp_path):
    port = free_port()
    proc = start_server(hostile[name], port, "200MB", tmp_path / "server.log", server="deltafin",
                        context=512)
    try:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        for _ in range(2):
            status, reply = post(port, "/v1/chat/completions", chat, timeout=60)
            assert status == 400 and SAYS[name] in reply["error"]["message"], reply
        status, reply = post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert status == 200, reply
    finally:
        stop_server(proc)


def test_a_filter_transformers_adds_is_bounded_before_it_runs(monkeypatch):
    """transformers sets its own `tojson` on the sandbox after making it: its
    arguments are bounded as every filter's are, so `tojson(indent=N)` past the
    bound is refused before json builds N-wide lines (here the bound is made small,
    so that without the check only the output's size, after the build, refuses it)."""
    monkeypatch.setattr(jinja, "JINJA_MAX_OUTPUT_CHARS", 1000)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(jinja.TemplateLimit, match="uses a value of 10000 items, past 1000"):
        jinja.render_jinja_chat("{{ [[[[1]]]] | tojson(indent=10000) }}", messages)
    assert jinja.render_jinja_chat("{{ [1] | tojson(indent=2) }}", messages) == "[\n  1\n]"
