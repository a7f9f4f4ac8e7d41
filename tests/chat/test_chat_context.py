"""A chat's context grows with the conversation: re-planned in steps up to what
the budget holds (the expert cache shrinking), with one line saying so, the same
tokens as a model planned that large from the start; beyond that a turn is refused
with the way out (/drop the oldest turns), and /context shows where it stands.
Through the API and at a terminal."""


from deltafin_mlx import runtime
from deltafin_mlx.chat.session import ChatSession
from deltafin_mlx.chat.context import status
from deltafin_mlx.engine.load import load
from deltafin_mlx.generation.stream import ContextError
from test_chat_terminal import Terminal

BUDGET = 17_850_000  # the fixture holds 26 of its 48 experts at 1,024 tokens, 2 at 2,304
TURN = " ".join(["The quick brown fox jumps over the lazy dog."] * 30)  # about 385 tokens


def test_the_context_grows_in_steps_the_cache_shrinks_and_the_tokens_stay_mlx_lm_s(converted):
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
    grown, replies = [], []
    while True:
        try:
            replies.append(session.ask(TURN, 4).tokens)
        except ContextError:
            break
        if session.growth is not None:
            grown.append(session.growth)
    assert [(g.old_context, g.new_context) for g in grown] == [(1024, 2048), (2048, 2304)]
    assert grown[0].old_slots > grown[-1].new_slots  # the expert cache made the room
    st = status(session.model, len(session.tokens))
    assert st.planned == st.largest == 2304 and st.used > 1900
    held = list(session.tokens)

    # Exactly what one model planned for the whole conversation gives.
    big, _ = load(path, "200MB", context=4096, tokenizer=False)
    straight = ChatSession(big, tok)
    assert [straight.ask(TURN, 4).tokens for _ in replies] == replies
    runtime(big).close()

    assert session.tokens == held  # the refused turn changed nothing
    assert session.drop_oldest(2) == 4 and session.tokens == []
    assert session.ask(TURN, 4).prefilled > 1000  # the rest is prefilled again, and fits
    runtime(current[-1]).close()


def test_at_the_terminal_the_context_grows_then_drop_makes_room(converted, tmp_path):
    term = Terminal([converted("kimi_k3"), "--chat", "-n", "4", "--budget", str(BUDGET),
                     "--context", "1024"], env={"XDG_CACHE_HOME": str(tmp_path)})
    term.until(rb"> ")
    grew = []
    for _ in range(12):
        term.type(TURN + "\n")
        said = term.until(rb"(from the cache\)|/reset starts over\])[^>]*> ")
        if b"does not fit" in said:
            break
        grew += [line for line in said.split(b"\n") if b"context grown" in line]
    assert b"the budget holds at most 2,304 tokens" in said and b"/drop N" in said
    assert len(grew) == 2 and b"from 1,024 to 2,048 tokens: re-planned, the expert cache now" in grew[0]
    term.type("/context\n")
    said = term.until(rb"\]\r?\n")
    assert b"of 2,304 planned tokens in use; the budget holds up to 2,304" in said
    term.type("/drop 2\n")
    assert b"dropped the oldest 4 messages" in term.until(rb"\]\r?\n")
    term.type(TURN + "\n")
    term.until(rb"from the cache\)")
    assert term.close() == 0
