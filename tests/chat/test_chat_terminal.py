"""The chat at a real terminal (a pseudo-terminal, Ctrl-C typed as the terminal's
interrupt character): a Ctrl-C while a long message is prefilled drops the turn
and leaves the session file as it was; one during the reply keeps the reply so far;
each says which in one line."""

import json
import os
import pty
import re
import select
import sys
import time

import pytest
from mlx_lm.models.cache import load_prompt_cache
from helpers import BIN

LINE = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)  # < a tty's 4096-byte line


class Terminal:
    """`deltafin-run ARGS` on a pseudo-terminal it has as its controlling terminal."""

    def __init__(self, args, env=None):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the terminal's session leader
            os.environ.update(env or {})
            os.execv(str(BIN / "deltafin-run"), ["deltafin-run", *map(str, args)])
        self.out = b""
        self.pos = 0  # where the last match ended

    def until(self, pattern: bytes, timeout=120) -> bytes:
        """Read until `pattern` appears in what was printed since the last match."""
        end, start = time.time() + timeout, self.pos
        while time.time() < end:
            m = re.search(pattern, self.out[start:])
            if m:
                self.pos = start + m.end()
                return self.out[start: self.pos]
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    self.out += os.read(self.fd, 65536)
                except OSError:  # the child has exited
                    break
        raise AssertionError(f"{pattern!r} never appeared; last output: {self.out[-2000:]!r}")

    def type(self, text: str):
        os.write(self.fd, text.encode())

    def block(self, lines):
        self.type('"""\n')
        for line in lines:
            self.type(line + "\n")
            time.sleep(0.02)
        self.type('"""\n')

    def close(self):
        self.type("/quit\n")
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)


def saved(path):
    meta = load_prompt_cache(str(path), return_metadata=True)[1]
    return json.loads(meta["messages"]), json.loads(meta["tokens"])


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_ctrl_c_in_the_prefill_drops_the_turn_and_in_the_reply_keeps_it(converted, tmp_path):
    session = tmp_path / "talk.safetensors"
    base = [converted("kimi_k3"), "--chat", "--budget", "200MB", "--session", session]
    term = Terminal([*base, "-n", "4"], env={"XDG_CACHE_HOME": str(tmp_path)})
    term.until(rb"> ")
    term.type("Hello\n")
    term.until(rb"from the cache\)[^>]*> ")  # saved once the next prompt shows
    before, stamp = saved(session), session.stat().st_mtime_ns

    term.block([LINE] * 8)  # about 3,500 tokens: several prefill passes
    # After the first pass: on Linux, mlx[cpu] builds its fused kernels at a process's
    # first forward by running g++ through system(), which ignores SIGINT meanwhile, so
    # a Ctrl-C typed then is lost (on Metal there is no such step).
    term.until(rb"\[prefill\] [1-9][\d,]*/")
    term.type("\x03")  # the terminal's interrupt character: SIGINT to the chat
    said = term.until(rb"\]\r?\n")
    assert b"the turn is dropped; the conversation, the cache and the session file are as " \
           b"before it" in said
    assert saved(session) == before and session.stat().st_mtime_ns == stamp

    term.type("Again\n")  # the whole history comes from the cache, nothing of the dropped turn
    said = term.until(rb"from the cache\)")
    assert f"({len(before[1])} from the cache)".encode() in said
    assert term.close() == 0
    messages, tokens = saved(session)
    assert [m["content"] for m in messages if m["role"] == "user"] == ["Hello", "Again"]

    # A random-weight model may end its reply early; the Ctrl-C must land inside it.
    for attempt in range(4):
        term = Terminal([*base, "-n", "3000"], env={"XDG_CACHE_HOME": str(tmp_path)})
        term.until(rb"> ")
        term.type(f"Tell me a long story, part {attempt}.\n")
        # The reply has begun (3,000 tokens take far longer); readline ends its
        # bracketed-paste mode after the line first.
        term.until(rb"\.\r\n(?:\x1b\[\?2004l\r)?(?!\x1b\[\?2004)(?!\r).")
        term.type("\x03")
        said = term.until(rb"(kept in the history as a finished turn\]|\[deltafin\][^\n]*\n)")
        if b"kept" in said:
            break
        term.close()  # the reply ended before the Ctrl-C: try another
        tokens = saved(session)[1]
    kept = int(re.search(rb"the reply so far \((\d+) tokens\)", said).group(1))
    term.until(rb"from the cache\)[^>]*> ")
    assert term.close() == 0
    messages, after = saved(session)
    assert 0 < kept < 3000 and messages[-1]["role"] == "assistant"
    assert len(after) > len(tokens) + kept  # the new turn and its partial reply were saved
