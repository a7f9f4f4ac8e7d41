"""What deltafin-run and deltafin-convert share as command-line tools: the version,
help that shows every default, the one error policy (`guarded`), a quiet end when
the reader of stdout goes away (`deltafin-run plan ... | head`), and text from files
made safe for a terminal.

Only the standard library is imported here: `--version` and `--help` load nothing else.
"""

import argparse
import contextlib
import errno
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

def guarded(prog: str, body, debug: bool = False) -> int:
    """`body()`'s exit status, under the one error policy of both commands: a Ctrl-C
    is one line and status 130 (also while MLX and mlx-lm import, which takes
    seconds), any other failure one line (`one_line`) and status 1 unless `debug`
    (then the traceback). A closed stdout is left to quiet_broken_pipe."""
    try:
        return body()
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except (BrokenPipeError, SystemExit, GeneratorExit):  # quiet_broken_pipe's, or not failures
        raise
    except BaseException as e:  # tiktoken's Rust panics are BaseExceptions, not Exceptions
        if interrupted(e):  # a Ctrl-C a library re-raised as its own error (transformers'
            print(f"\n{prog}: interrupted", file=sys.stderr)  # lazy imports do)
            return 130
        if debug:
            raise
        print(printable(f"{prog}: error: {one_line(e)}"), file=sys.stderr)
        return 1


def interrupted(e: BaseException) -> bool:
    """Whether a Ctrl-C caused `e` (anywhere in its chain of causes)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def one_line(e: BaseException) -> str:
    """A DeltafinError's message as it is; the system's errors with the path they
    name (a full disk says so, and that rerunning resumes); anything else is a bug,
    shown with its type. Only the first line of a message is kept."""
    from deltafin_mlx.errors import DeltafinError

    msg = first_line(e)
    if isinstance(e, DeltafinError):
        return msg
    if isinstance(e, OSError):
        if e.errno == errno.ENOSPC:
            return (f"disk full while writing {e.filename or 'the output'}; free space and "
                    "rerun the same command to resume")
        if e.filename:
            return f"{e.filename}: {e.strerror or msg}"
        return e.strerror or msg
    return f"{type(e).__name__}: {msg} (rerun with --debug for details)"


# An error line at most this long: a message may quote what a file holds (an
# options record, a reference), and a file of any size must not make a huge line.
ERROR_LINE_MAX = 2000


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line if len(line) <= ERROR_LINE_MAX else f"{line[:ERROR_LINE_MAX]}… (cut short)"


@contextlib.contextmanager
def interrupts_in_finalizers_reach_main():
    """A Ctrl-C that lands while a finalizer runs (tqdm's __del__, as a finished
    progress bar is collected) cannot be raised there: Python prints it as an
    "Exception ignored" traceback and drops it. Within this block it is kept
    instead, and raised as the block ends, so the main code gets its
    KeyboardInterrupt and says "interrupted" in its one line."""
    default, caught = sys.unraisablehook, []

    def hook(unraisable):
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
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
