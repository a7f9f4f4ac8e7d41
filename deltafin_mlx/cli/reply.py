"""A reply as `deltafin-run` shows it, in a chat and in a one-shot run alike: its
thinking apart from its answer (dimmed on a terminal, `[thinking]`/`[answer]`
otherwise), markup tokens never (generation/render.py decides what is which), and the
answer cut before the first stop string."""

import sys

DIM, PLAIN = "\033[2m", "\033[0m"


class ReplyPrinter:
    """Feed it `(channel, text)` pieces as generation/engine.py's events give them
    (cut at the stop already); `finish()` ends the reply's line. With `echo` off
    it prints nothing (--json)."""

    def __init__(self, tty: bool, echo: bool = True, out=None):
        self.tty, self.echo = tty, echo
        self.out = out or sys.stdout
        self.shown = None  # the channel printed last

    def __call__(self, channel: str, piece: str):
        if not piece or not self.echo:
            return
        if channel != self.shown:
            if channel == "think":
                self.out.write(DIM if self.tty else "[thinking] ")
            elif self.shown == "think":
                self.out.write(PLAIN + "\n" if self.tty else "\n[answer] ")
            self.shown = channel
        self.out.write(piece)
        self.out.flush()

    def finish(self):
        if self.echo:
            self.out.write((PLAIN if self.tty and self.shown == "think" else "") + "\n")
            self.out.flush()
