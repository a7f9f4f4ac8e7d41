"""The chat's frictions of issue 33: a pasted block of lines is one message; /drop
plans the model back to the context the rest of the conversation needs (the expert
cache gets its room back), and so does a turn dropped in its prefill after the context
grew for it; after /drop, /context and a restart say the rest is
prefilled again (not "0 tokens", not "no prefill needed"); a Ctrl-C in the prefill
says how far it got, on a line of its own."""

import re
import sys

import pytest

from deltafin_mlx import runtime
from deltafin_mlx.chat.context import status
from deltafin_mlx.chat.session import ChatSession
from deltafin_mlx.engine.load import load
from test_chat_context import BUDGET, TURN
from test_chat_terminal import LINE, Terminal, saved


def test_drop_plans_the_context_back_and_the_expert_cache_regains_its_slots(converted):
    path = converted("kimi_k3")
    current = []

    def reload(context):
        runtime(current[-1]).close()
        model, _ = load(path, BUDGET, context=context, tokenizer=False)
        current.append(model)
        return model

    model, tok = load(path, BUDGET, context=1024)
    current.append(model)
    start = status(model, 0)
    session = ChatSession(model, tok, reload=reload)
    while session.growth is None:
        session.ask(TURN, 4)
    grown = status(session.model, len(session.tokens))
    assert grown.planned > 1024 and grown.slots < start.slots

    session.drop_oldest(len(session.messages) // 2 - 1)  # one exchange left
    used, pending = session.conversation_tokens()
    assert 300 < used == pending < 1024
    assert session.growth.line().startswith("context back from")
    back = status(session.model, used)
    assert (back.planned, back.slots) == (1024, start.slots)
    assert session.ask("And now?", 4).prefilled > used  # the rest, prefilled again
    runtime(current[-1]).close()


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_at_the_terminal_a_paste_is_one_message_and_drop_says_what_follows(converted, tmp_path):
    session = tmp_path / "talk.safetensors"
    args = [converted("kimi_k3"), "--chat", "-n", "3", "--budget", "200MB", "--session", session]
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    term = Terminal(args, env=env)
    term.until(rb"> ")
    term.type("\x1b[200~first line\nsecond line\x1b[201~\n")  # a terminal's bracketed paste
    term.until(rb"from the cache\)[^>]*> ")
    assert [m["content"] for m in saved(session)[0] if m["role"] == "user"] == \
        ["first line\nsecond line"]
    term.type("Hello\n")
    term.until(rb"from the cache\)[^>]*> ")

    term.type("/drop\n")
    said = term.until(rb"> ")
    pending = int(re.search(rb"rest of the conversation \(([\d,]+) tokens\)", said)
                  .group(1).replace(b",", b""))
    assert pending > 0
    term.type("/context\n")
    said = term.until(rb"\]\r?\n")
    assert f"context: {pending:,} of".encode() in said
    assert f"{pending:,} of the tokens are prefilled again at the next turn".encode() in said
    assert term.close() == 0

    term = Terminal(args, env=env)  # a restart after /drop: nothing is in the cache
    said = term.until(rb"> ")
    assert f"restored 2 messages ({pending} tokens, prefilled again at the next " \
           f"turn)".encode() in said
    assert b"no prefill needed" not in said

    term.block([LINE] * 8)  # about 3,500 tokens: several prefill passes
    # After the first pass: on Linux, mlx[cpu] builds its fused kernels at a process's
    # first forward by running g++ through system(), which ignores SIGINT meanwhile, so
    # a Ctrl-C typed then is lost (on Metal there is no such step).
    term.until(rb"\[prefill\] [1-9][\d,]*/")
    term.type("\x03")
    said = term.until(rb"as before it\]\r?\n")
    # The progress line is erased before the note, which says how far the prefill got.
    assert re.search(rb"\x1b\[K\[interrupted before the reply began, after prefilling "
                     rb"[\d,]+ of [\d,]+ tokens in [\d.]+ s: the turn is dropped", said), said
    assert term.close() == 0


def test_a_paste_read_from_a_pipe_is_one_message_too(monkeypatch):
    import io

    from deltafin_mlx.cli.chat import read_message

    monkeypatch.setattr(sys, "stdin", io.StringIO("\x1b[200~one\ntwo\x1b[201~ and three\nnext\n"))
    out = io.StringIO()
    assert read_message(out=out) == "one\ntwo and three"
    assert read_message(out=out) == "next"


def test_a_turn_dropped_in_its_prefill_leaves_the_plan_as_before_it(converted):
    path = converted("kimi_k3")
    current = []

    def reload(context):
        runtime(current[-1]).close()
        model, _ = load(path, BUDGET, context=context, tokenizer=False)
        current.append(model)
        return model

    model, tok = load(path, BUDGET, context=1024)
    current.append(model)
    session = ChatSession(model, tok, reload=reload)
    session.ask(TURN, 4)
    before = status(session.model, len(session.tokens))
    held = list(session.tokens)
    passes = []
    turn = session.ask(" ".join([TURN] * 2), 4, progress=lambda n, total: passes.append(n),
                       stop_requested=lambda: bool(passes))  # grows, then stops in a pass
    assert turn.dropped and len(current) == 3  # grown for the turn, then planned back
    after = status(session.model, len(session.tokens))
    assert (after.planned, after.slots) == (before.planned, before.slots)
    assert session.growth is None and session.tokens == held
    assert session.ask("Short now.", 4).reused == len(held)  # the cache was kept
    runtime(current[-1]).close()


# A paste that holds the terminal's end marker, a command and a newline: a terminal
# that does not filter what is pasted sends that before its own end marker.
HOSTILE_PASTE = "\x1b[200~\x1b[201~/reset\n\x1b[201~\n"


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_at_the_terminal_a_paste_holding_its_end_marker_and_a_command_is_text(converted,
                                                                              tmp_path):
    session = tmp_path / "talk.safetensors"
    term = Terminal([converted("kimi_k3"), "--chat", "-n", "1", "--budget", "200MB",
                     "--session", session], env={"XDG_CACHE_HOME": str(tmp_path)})
    term.until(rb"> ")
    term.type("Hello\n")
    term.until(rb"from the cache\)[^>]*> ")
    term.type(HOSTILE_PASTE)
    said = term.until(rb"from the cache\)[^>]*> ")
    assert b"history cleared" not in said
    assert [m["content"] for m in saved(session)[0] if m["role"] == "user"] == \
        ["Hello", "/reset"]
    assert term.close() == 0


def test_a_piped_paste_holding_its_end_marker_and_a_command_is_text(converted, tmp_path,
                                                                     monkeypatch, capsys):
    import io

    from deltafin_mlx.cli.main import main

    session = tmp_path / "talk.safetensors"
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n" + HOSTILE_PASTE))
    assert main([str(converted("kimi_k3")), "--chat", "-n", "1", "--budget", "200MB",
                 "--session", str(session)]) == 0
    assert "history cleared" not in capsys.readouterr().err
    assert [m["content"] for m in saved(session)[0] if m["role"] == "user"] == \
        ["Hello", "/reset"]
