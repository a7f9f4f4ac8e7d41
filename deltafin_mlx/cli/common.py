"""What deltafin-run and deltafin-convert share as command-line tools: the version,
help that shows every default, and a quiet end when the reader of stdout goes away
(`deltafin-run plan ... | head`), and text from files made safe for a terminal."""

import argparse
import contextlib
import functools
import os
import sys
import unicodedata


def add_version(p: argparse.ArgumentParser):
    from deltafin_mlx._version import __version__

    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                   help="show the version and exit")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default, where it has one worth saying
    (an option whose default is None or off says in its help what that means)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "default:" in text or not action.option_strings
                or default is None or default is False or default == argparse.SUPPRESS
                or default == []):
            return text
        return f"{text} (default: %(default)s)"


def quiet_broken_pipe(main):
    """Wrap a CLI entry point: output cut short by a closed pipe ends the program
    quietly (exit status 141, as a shell reports SIGPIPE), without a traceback —
    also when the pipe breaks only as Python flushes stdout at exit."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            code = main(*args, **kwargs)
            sys.stdout.flush()
            return code
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so the flush at exit writes nowhere
            return 141

    return wrapper



@contextlib.contextmanager
def interrupts_in_finalizers_reach_main():
    """A Ctrl-C that lands while a finalizer runs (tqdm's __del__, as a finished
    progress bar is collected) cannot be raised there: Python prints it as an
    "Exception ignored" traceback and drops it. Within this block it is kept
    instead, and raised as the block ends, so the main code gets its
    KeyboardInterrupt and says "interrupted" in its one line."""
    default, caught = sys.unraisablehook, []

    def hook(unraisable):
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type,
                                                           KeyboardInterrupt):
            caught.append(unraisable.exc_type)
            return
        default(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = default
    if caught:
        raise KeyboardInterrupt


def printable(text: str) -> str:
    """`text` safe for a terminal: control and format characters (escape sequences,
    bidirectional overrides) that came from a file are shown escaped, not obeyed."""
    return "".join(c if unicodedata.category(c)[0] != "C" else ascii(c)[1:-1] for c in text)
