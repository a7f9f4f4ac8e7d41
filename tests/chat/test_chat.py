"""Chat sessions keep the model's cache across turns: a turn prefills only its own
tokens, a saved session continues after a restart with no prefill of its history
and the same tokens, and a cache that no longer matches the conversation is
trimmed or rebuilt, never used."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from deltafin_mlx.chat.session import ChatSession, SessionError, _consistent
from deltafin_mlx.generation.render import Channels
from deltafin_mlx.generation.stream import ContextError
from deltafin_mlx.engine.load import load
from deltafin_mlx import runtime

QUESTION = "Tell me about the fox and the dog."


@pytest.fixture(scope="module")
def k3(converted):
    model, tok = load(converted("kimi_k3"), "200MB", context=2048)
    yield model, tok
    runtime(model).close()


def test_three_equal_turns_prefill_only_the_new_turn(k3):
    model, tok = k3
    session = ChatSession(model, tok)
    turns = [session.ask(QUESTION, 8) for _ in range(3)]
    first, second, third = (t.prefilled for t in turns)
    assert third <= 1.2 * first
    assert second == third  # equal turns cost the same, whatever the history's length
    assert turns[2].reused == len(session.tokens) - third - len(turns[2].tokens)
    assert turns[2].reused > first  # the history came from the cache
    assert _consistent(session.cache, len(session.tokens))


def test_a_turn_equals_a_fresh_prefill_of_the_same_tokens(converted):
    # Reusing the cache changes what is computed, not what it means: the same
    # conversation tokens prefilled from an empty cache give the same reply (greedy).
    model, tok = load(converted("qwen3_moe"), "200MB", context=1024)
    session = ChatSession(model, tok)
    session.ask(QUESTION, 6)
    prompt = session.prompt_for("And then?")
    fresh = ChatSession(model, tok)
    fresh.messages = list(session.messages)
    reply = session.ask("And then?", 6)
    again = fresh.ask("And then?", 6, prompt=prompt)
    assert again.prefilled == len(prompt) and reply.prefilled < len(prompt) / 2
    assert again.tokens == reply.tokens
    runtime(model).close()


def test_saved_session_continues_with_no_prefill_of_history_and_the_same_tokens(k3, tmp_path):
    model, tok = k3
    straight = ChatSession(model, tok, system="Be brief.")
    for _ in range(2):
        straight.ask(QUESTION, 6)
    saved = ChatSession(model, tok, system="Be brief.")
    for _ in range(2):
        saved.ask(QUESTION, 6)
    saved.save(tmp_path / "chat")
    assert (tmp_path / "chat.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]  # written atomically

    restored = ChatSession.restore(tmp_path / "chat", model, tok, system="Be brief.")
    assert restored.tokens == straight.tokens and restored.messages == straight.messages
    a, b = straight.ask("And then?", 6), restored.ask("And then?", 6)
    assert b.reused == len(straight.tokens) - len(a.tokens) - a.prefilled  # all history reused
    assert b.prefilled == a.prefilled
    assert b.tokens == a.tokens


def edited_copy(path, to, key, edit):
    """The session file at `path` with its metadata `key` changed by `edit`, written
    back as a consistent safetensors file (what someone editing it on purpose does)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    meta = dict(meta)
    meta[key] = edit(meta[key])
    mx.save_safetensors(str(to), arrays, meta)
    return to


@pytest.mark.parametrize("key,edit", [
    ("0.messages", lambda v: v.replace("fox", "cat", 1)),
    ("0.tokens", lambda v: json.dumps([json.loads(v)[0] + 1] + json.loads(v)[1:])),
])
def test_a_session_edited_in_its_messages_or_tokens_is_refused(k3, tmp_path, key, edit):
    """Every part of the file is under its checksum, not only the cached tensors: an
    edited message or token id (inside the cached part) is one line at restore."""
    model, tok = k3
    session = ChatSession(model, tok)
    session.ask(QUESTION, 4)
    session.save(tmp_path / "chat.safetensors")
    same = edited_copy(tmp_path / "chat.safetensors", tmp_path / "same.safetensors", key,
                       lambda v: v)
    assert ChatSession.restore(same, model, tok).messages == session.messages  # rewrite alone: fine
    edited = edited_copy(tmp_path / "chat.safetensors", tmp_path / "edited.safetensors", key, edit)
    with pytest.raises(SessionError) as e:
        ChatSession.restore(edited, model, tok)
    assert str(e.value) == (f"{edited}: damaged or edited (its content does not match its "
                            "checksum); start a new session file")


def test_a_session_of_the_previous_format_version_is_refused_with_what_to_do(k3, tmp_path):
    model, tok = k3
    session = ChatSession(model, tok)
    session.ask(QUESTION, 4)
    session.save(tmp_path / "chat.safetensors")
    old = edited_copy(tmp_path / "chat.safetensors", tmp_path / "v2.safetensors", "0.version",
                      lambda v: "2")
    with pytest.raises(SessionError, match="session format version 2, this Deltafin reads "
                       "version 3; start a new session file"):
        ChatSession.restore(old, model, tok)


def test_a_session_of_another_model_or_format_version_is_refused(k3, converted, tmp_path):
    model, tok = k3
    session = ChatSession(model, tok)
    session.ask(QUESTION, 4)
    session.save(tmp_path / "k3.safetensors")
    other, other_tok = load(converted("qwen3_moe"), "200MB", context=1024)
    with pytest.raises(SessionError, match="another model"):
        ChatSession.restore(tmp_path / "k3.safetensors", other, other_tok)
    runtime(other).close()

    cache, meta = load_prompt_cache(str(tmp_path / "k3.safetensors"), return_metadata=True)
    save_prompt_cache(str(tmp_path / "v9.safetensors"), cache, {**meta, "version": "9"})
    with pytest.raises(SessionError, match="version 9"):
        ChatSession.restore(tmp_path / "v9.safetensors", model, tok)
    (tmp_path / "junk.safetensors").write_bytes(b"not a session")
    with pytest.raises(SessionError, match="not a Deltafin chat session"):
        ChatSession.restore(tmp_path / "junk.safetensors", model, tok)
    with pytest.raises(SessionError, match="thinking"):
        ChatSession.restore(tmp_path / "k3.safetensors", model, tok, thinking=False)


def test_a_diverging_history_is_trimmed_where_it_can_be_else_rebuilt(k3, converted):
    qwen, qtok = load(converted("qwen3_moe"), "200MB", context=1024)
    for model, tok, trimmable in ((qwen, qtok, True), (*k3, False)):
        session = ChatSession(model, tok)
        session.ask(QUESTION, 6)
        held = list(session.tokens)
        edited = held[:10] + [held[10] + 1] + held[11:] + [5]
        kept = session.sync(edited)
        assert kept == (10 if trimmable else 0)  # recurrent state cannot be trimmed
        assert session.tokens == held[:kept] and _consistent(session.cache, kept)
    runtime(qwen).close()


def test_an_interrupted_reply_is_kept_and_the_next_turn_continues(k3):
    model, tok = k3
    session = ChatSession(model, tok)
    seen = []
    turn = session.ask(QUESTION, 50, stop_requested=lambda: len(seen) >= 3,
                       on_text=lambda channel, text: seen.append(text))
    assert turn.finish_reason == "interrupted" and len(turn.tokens) < 50
    assert session.messages[-1]["role"] == "assistant"
    assert _consistent(session.cache, len(session.tokens))
    nxt = session.ask(QUESTION, 4)
    assert nxt.reused == len(session.tokens) - nxt.prefilled - len(nxt.tokens)



LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)


def cache_arrays(session):
    """Every array a conversation's cache holds, up to each attention layer's length."""
    out = []
    for c in session.cache:
        if hasattr(c, "offset") and c.is_trimmable():
            out += [a[..., : c.offset, :] for a in (c.keys, c.values) if a is not None] \
                if getattr(c, "keys", None) is not None else []
        else:
            out += [a for a in c.state[0] if a is not None]
    mx.eval(out)
    return out


@pytest.mark.parametrize("when", ["prefill", "forward pass"])
def test_a_turn_stopped_before_its_reply_leaves_the_conversation_exactly_as_before(k3, when):
    """Ctrl-C during the prefill (between chunks), or a second one inside a forward
    pass: the messages, tokens and every cache array are as before the turn, and the
    next turn gives the reply it would have given without the stopped one."""
    model, tok = k3
    straight, session = ChatSession(model, tok), ChatSession(model, tok)
    straight.ask(QUESTION, 4)
    session.ask(QUESTION, 4)
    messages, tokens = json.dumps(session.messages), list(session.tokens)
    arrays = cache_arrays(session)
    done = []

    def progress(n, total):
        done.append(n)
        if when == "forward pass" and n > 0:
            raise KeyboardInterrupt  # as a second Ctrl-C lands inside a step

    if when == "prefill":
        turn = session.ask(LONG, 4, prefill_step_size=32, progress=progress,
                           stop_requested=lambda: bool(done) and done[-1] > 0)
        assert turn.dropped and turn.finish_reason == "interrupted" and not turn.tokens
    else:
        with pytest.raises(KeyboardInterrupt):
            session.ask(LONG, 4, prefill_step_size=32, progress=progress)
    assert done[-1] >= 32  # some of the prefill ran
    assert json.dumps(session.messages) == messages and session.tokens == tokens
    after = cache_arrays(session)
    assert len(after) == len(arrays) and all(mx.array_equal(a, b) for a, b in zip(arrays, after))
    assert _consistent(session.cache, len(session.tokens))
    assert session.ask("And then?", 6).tokens == straight.ask("And then?", 6).tokens


def test_a_first_turn_stopped_in_its_prefill_leaves_an_empty_conversation(k3):
    model, tok = k3
    session = ChatSession(model, tok, system="Be brief.")
    done = []
    turn = session.ask(LONG, 4, prefill_step_size=32, progress=lambda n, t: done.append(n),
                       stop_requested=lambda: bool(done) and done[-1] > 0)
    assert turn.dropped and session.tokens == [] and session.messages == [
        {"role": "system", "content": "Be brief."}]
    assert session.ask(QUESTION, 4).reused == 0  # nothing of the stopped turn is reused


def test_a_prompt_beyond_the_planned_context_is_refused_and_nothing_changes(converted):
    model, tok = load(converted("kimi_k3"), "200MB", context=300)
    session = ChatSession(model, tok)
    session.ask("Hi.", 4)
    held = list(session.tokens)
    with pytest.raises(ContextError, match=r"beyond the planned context of 300 tokens"):
        session.ask(" ".join(["The quick brown fox."] * 40), 4)
    assert session.tokens == held and len(session.messages) == 2
    runtime(model).close()


def test_thinking_is_split_from_the_answer_and_markup_never_shown(k3):
    _, tok = k3
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    special = lambda name: tok.convert_tokens_to_ids(name)  # noqa: E731
    reply = (enc("let me see") + [special("<|close|>")] + enc("think") + [special("<|sep|>")]
             + [special("<|open|>")] + enc("response") + [special("<|sep|>")] + enc("the answer")
             + [special("<|close|>")] + enc("response") + [special("<|sep|>")]
             + [special("<|end_of_msg|>")])
    channels = Channels(tok, thinking=True)
    pieces = [p for i, t in enumerate(reply) for p in channels.add(t, final=i == len(reply) - 1)]
    shown = lambda channel: "".join(t for c, t in pieces if c == channel)  # noqa: E731
    assert shown("think") == "let me see" and shown("answer") == "the answer"
    assert not any("<|" in text or text in ("think", "response") for _, text in pieces)
    assert {c for c, _ in pieces} == {"think", "answer"}


def run_chat(args, script, timeout=300):
    return subprocess.run([sys.executable, "-m", "deltafin_mlx.cli.main", *args], input=script,
                          capture_output=True, text=True, timeout=timeout)


def test_cli_chat_commands_multiline_and_a_resumed_session(converted, tmp_path):
    model = str(converted("kimi_k3"))
    base = [model, "--chat", "-n", "4", "--budget", "200MB", "--session",
            str(tmp_path / "talk")]
    p = run_chat(base, 'Hello\n/frobnicate\n/help\nline one\\\nline two\n"""\nA\nB\n"""\n')
    assert p.returncode == 0, p.stderr
    assert "unknown command /frobnicate: not sent" in p.stderr
    assert "/reset" in p.stderr and "KEPT" in p.stderr  # the help says what Ctrl-C keeps
    assert p.stderr.count("from the cache)") == 3  # /frobnicate and /help were not sent
    assert "<|" not in p.stdout  # markup is never printed
    meta = json.loads(json.dumps(load_prompt_cache(str(tmp_path / "talk.safetensors"),
                                                   return_metadata=True)[1]))
    users = [m["content"] for m in json.loads(meta["messages"]) if m["role"] == "user"]
    assert users == ["Hello", "line one\nline two", "A\nB"]

    p = run_chat(base, "Again\n")
    assert p.returncode == 0, p.stderr
    held = len(json.loads(meta["tokens"]))
    assert f"restored 6 messages ({held} tokens" in p.stderr
    assert f"({held} from the cache)" in p.stderr

    p = run_chat([model, "--chat", "--budget", "200MB", "--session",
                  str(tmp_path / "talk"), "--system", "Other."], "Again\n")
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith(
        "deltafin-run: error:") and "Traceback" not in p.stderr


def test_a_cache_written_in_place_is_rebuilt_not_kept_by_a_dropped_turn(k3):
    """A rotating window cannot be restored from a snapshot: the turn's drop leaves
    the messages as they were and a fresh cache for the next turn to prefill."""
    from types import SimpleNamespace

    from mlx_lm.models.cache import RotatingKVCache

    from deltafin_mlx.chat.session import Snapshot

    model, _ = k3
    window = RotatingKVCache(max_size=4)
    window.update_and_fetch(mx.zeros((1, 1, 6, 2)), mx.zeros((1, 1, 6, 2)))  # past its size
    session = SimpleNamespace(model=model, cache=[window], tokens=[1] * 6,
                              messages=[{"role": "user", "content": "Hi"}])
    before = Snapshot.take(session)
    session.messages.append({"role": "user", "content": "more"})
    before.restore(session)
    assert session.messages == [{"role": "user", "content": "Hi"}] and session.tokens == []
    assert session.cache is not before.cache and _consistent(session.cache, 0)
