"""Chat commands and session saves never end a chat: `/drop` with anything but a
plain number (a superscript digit, 5,000 digits) prints its usage and the chat goes
on; a session that cannot be saved (a full disk) is one line naming the file and
the disk, the file keeps the conversation as last saved, and the chat goes on."""

import hashlib
import subprocess

import pytest
from helpers import BIN, fill, small_filesystem

USAGE = "[/drop N: N is how many of the oldest exchanges to forget, 1 or more]"


def chat(model, stdin: str, *more):
    return subprocess.run([str(BIN / "deltafin-run"), str(model), "--chat", "-n", "3",
                           "--budget", "200MB", "--no-warm-start", *map(str, more)],
                          input=stdin, capture_output=True, text=True, timeout=300)


def replies(err: str) -> int:
    """How many turns were answered (each ends with its stats line)."""
    return sum(l.lstrip("> ").startswith("[deltafin] ") and "prefilled" in l
               for l in err.splitlines())


@pytest.mark.parametrize("arg", ["²", "1" * 5000, "٣", "-1", "0", "1 2"])
def test_drop_with_anything_but_a_number_prints_its_usage_and_goes_on(converted, arg):
    r = chat(converted("kimi_k3"), f"Hello\n/drop {arg}\nAgain\n/quit\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert USAGE in r.stderr and replies(r.stderr) == 2, r.stderr


@pytest.fixture
def small_fs(tmp_path):
    with small_filesystem(tmp_path, "4m") as mnt:
        yield mnt


def test_a_session_on_a_full_disk_says_so_keeps_the_file_and_the_chat_goes_on(
        converted, small_fs):
    model = converted("kimi_k3")
    session = small_fs / "talk.safetensors"
    r = chat(model, "Hello\n/quit\n", "--session", session)
    assert r.returncode == 0 and session.is_file(), r.stderr
    saved = hashlib.sha256(session.read_bytes()).hexdigest()
    fill(small_fs)
    r = chat(model, "Again\n/drop 1\nMore\n/quit\n", "--session", session)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert replies(r.stderr) == 2, r.stderr
    said = [l for l in r.stderr.splitlines() if "not saved" in l]
    assert len(said) == 3, r.stderr  # after each turn and the /drop
    assert all("disk full" in l and str(session) in l for l in said), said
    assert hashlib.sha256(session.read_bytes()).hexdigest() == saved
    assert sorted(p.name for p in small_fs.iterdir()) == ["filler", "talk.safetensors"]


def test_ollamas_set_show_save_and_load(converted, tmp_path):
    """ollama's chat commands, with its wording: /set parameter (checked by the rule
    the option's flag gets; a bad value changes nothing), /set system, /show, and
    /save NAME, /load NAME carrying the conversation, its system message and the
    parameters set into another chat."""
    model, saved = converted("kimi_k3"), tmp_path / "talk"
    r = chat(model, "/set parameter temperature 0.7\n/set temperature 2000\n"
                    "/set parameter nonsense 1\n/set parameter num_predict 2\n"
                    "/set system Be brief.\n/show system\n/show parameters\n/show info\n"
                    f"Hello\n/save {saved}\n/quit\n")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    for said in ("[Set parameter 'temperature' to '0.7']",
                 "[Couldn't set parameter: temperature: must be in [0, 100], not 2000.0]",
                 "[Couldn't set parameter: unknown parameter 'nonsense'",
                 "[Set system message.]", "> Be brief.\n", "  temperature                    0.7\n",
                 "  num_predict                    2\n", "  architecture   kimi_k3, 4 layers",
                 f"[Saved the conversation as '{saved}.safetensors']"):
        assert said in r.stderr, said
    assert replies(r.stderr) == 1 and "[deltafin] 2 tokens in" in r.stderr  # num_predict 2
    again = chat(model, f"/load {saved}\n/show system\n/show parameters\nAgain\n"
                        "/load nowhere\n/bye\n")
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    for said in (f"[Loading session '{saved}' (3 messages)]", "> Be brief.\n",
                 "  temperature                    0.7\n", "[deltafin] 2 tokens in",
                 "[Couldn't load 'nowhere': "):
        assert said in again.stderr, said
    assert replies(again.stderr) == 1


def test_a_new_system_message_is_in_the_next_turns_prompt(converted):
    """/set system renders the conversation again with it (the cache's tokens hold
    the old one, so no turn is appended to them)."""
    from deltafin_mlx.chat.session import ChatSession
    from deltafin_mlx.engine.load import load
    from deltafin_mlx.engine.runtime import runtime

    model, tokenizer = load(converted("qwen3_moe"), "200MB", warm_start=False)
    try:
        session = ChatSession(model, tokenizer, system="Be long.")
        session.ask("Hello", 2)
        session.set_system("Be brief.")
        expected = session.render([{"role": "system", "content": "Be brief."},
                                   *session.messages[1:], {"role": "user", "content": "Again"}])
        assert session.prompt_for("Again") == expected
        assert session.messages[0] == {"role": "system", "content": "Be brief."}
    finally:
        runtime(model).close()
