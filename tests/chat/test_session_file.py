"""A session file that is damaged or not a file is refused."""

import pytest


@pytest.fixture(scope="module")
def chat_model(converted):
    from deltafin_mlx import runtime
    from deltafin_mlx.engine.load import load

    model, tok = load(converted("kimi_k3"), "200MB", context=1024)
    yield model, tok
    runtime(model).close()


def test_a_session_with_flipped_bytes_in_its_cached_tensors_is_refused(chat_model, tmp_path):
    from deltafin_mlx.chat.session import ChatSession, SessionError

    model, tok = chat_model
    session = ChatSession(model, tok)
    session.ask("Tell me about the fox.", 4)
    path = tmp_path / "chat.safetensors"
    session.save(path)
    assert ChatSession.restore(path, model, tok).tokens == session.tokens  # intact: restores
    data = bytearray(path.read_bytes())
    data[-64] ^= 0x40  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(SessionError, match="damaged .*checksum"):
        ChatSession.restore(path, model, tok)


def test_a_fifo_as_the_session_file_is_refused_without_blocking(chat_model, tmp_path):
    import os
    import time

    from deltafin_mlx.chat.session import ChatSession, SessionError

    model, tok = chat_model
    fifo = tmp_path / "chat.safetensors"
    os.mkfifo(fifo)
    start = time.monotonic()
    with pytest.raises(SessionError, match="not a regular file"):
        ChatSession.restore(fifo, model, tok)
    assert time.monotonic() - start < 5


def test_saving_over_a_file_that_is_not_a_session_is_refused(chat_model, tmp_path):
    """`/save model` beside a checkpoint names model.safetensors: a file there that is
    not a session (its safetensors metadata says another format, or it is no
    safetensors at all) is left as it was, with one line; a session is replaced."""
    import numpy as np
    from safetensors.numpy import save_file

    from deltafin_mlx.chat.session import ChatSession
    from deltafin_mlx.errors import SessionSaveError

    model, tok = chat_model
    session = ChatSession(model, tok)
    session.ask("Tell me about the fox.", 2)
    weights, notes = tmp_path / "model.safetensors", tmp_path / "notes.safetensors"
    save_file({"w": np.ones(4, np.float32)}, str(weights), metadata={"format": "pt"})
    notes.write_text("not safetensors")
    for path in (weights, notes):
        before = path.read_bytes()
        with pytest.raises(SessionSaveError, match=f"{path} is there and is not a chat session"):
            session.save(path)
        assert path.read_bytes() == before
    path = tmp_path / "chat.safetensors"
    session.save(path)
    session.ask("And the dog?", 2)
    session.save(path)  # a session is replaced
    assert ChatSession.restore(path, model, tok).tokens == session.tokens
