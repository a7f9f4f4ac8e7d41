"""Every error a user can cause, under one base class.

A `DeltafinError`'s message is one line that names the file, option or request at
fault; the command-line tools print it as it is (`--debug` shows the traceback), and
anything that is not a `DeltafinError` is a bug, printed with its type. Each class also
keeps the builtin base it has always had, so `except ValueError` in callers still holds.
"""


class DeltafinError(Exception):
    """A failure the user can act on; `str(e)` is the one line to show."""


class ModelError(DeltafinError, ValueError):
    """A model directory that cannot be used; the message says why."""


class BankError(DeltafinError, ValueError):
    """A bank file that does not match the format or its manifest."""


class HubError(DeltafinError, ValueError):
    """Fetching from the hub failed; the message says why, in one line."""


class TokenizerError(DeltafinError, ValueError):
    """Tokenizer files that cannot be used; the message names the file and why."""


class TemplateLimit(TokenizerError):
    """A chat template that ran past its bounds (time, output size, ranges)."""


class BudgetError(DeltafinError, ValueError):
    """A memory budget or context the model cannot run in."""


class LoadOptionError(DeltafinError, ValueError):
    """A load option of a value `load` cannot use (engine/load.py LoadOptions)."""


class ContextError(DeltafinError, ValueError):
    """A prompt longer than the context the memory plan was made for."""


class TokenIdError(DeltafinError, ValueError):
    """A token id outside the embedding table."""


class ReadError(DeltafinError, RuntimeError):
    """An expert record could not be read, or did not match its checksum."""


class TrunkReadError(DeltafinError, RuntimeError):
    """A streamed trunk layer or embedding row could not be read."""


class SessionError(DeltafinError, ValueError):
    """A chat session file that cannot be restored."""


class SessionSaveError(SessionError):
    """A chat session that could not be saved (a full disk): the chat goes on."""


class JobError(DeltafinError, ValueError):
    """A batch, score, perplexity or lm-eval job that cannot start or go on: its
    input, its output, its options or a reference that does not fit."""


class RequestError(DeltafinError, ValueError):
    """A request refused, naming the field: a server's HTTP 400, or a batch or score
    line's error line (tokenizer/messages.py checks conversations for all three)."""


class ConvertError(DeltafinError):
    """A conversion that cannot proceed; the message is shown to the user as is."""


class UsageError(DeltafinError):
    """Options that do not go together (a command-line tool's exit code 1)."""
