"""Chat templates in Jinja, K2's and Hugging Face's: transformers renders every one
in one sandbox (compat.bound_chat_templates), bounded in time and output size, so a
template that loops or grows without end (it comes with the model) is one
TemplateLimit line in every entry point, not a hang or the memory cap."""

import ctypes
import functools
import threading
from contextlib import contextmanager

from jinja2.sandbox import ImmutableSandboxedEnvironment

from deltafin_mlx import compat
from deltafin_mlx.errors import TemplateLimit


# The bounds a template runs within.
JINJA_MAX_TEMPLATE_CHARS = 1 << 20
JINJA_MAX_OUTPUT_CHARS = 16 << 20
JINJA_MAX_SECONDS = 10.0
JINJA_MAX_RANGE = 100_000


class TemplateRanOver(TemplateLimit):
    def __init__(self, *args):
        super().__init__(*args or (f"the chat template ran over {JINJA_MAX_SECONDS:.0f} s",))


@contextmanager
def _deadline(seconds: float):
    """TemplateRanOver in this thread once `seconds` pass, repeated until the block
    ends: a template's loop over a list has no hook a check could run in, and an
    asynchronous exception reaches any Python code (a C call ends first)."""
    thread, lock, stop, fired = threading.get_ident(), threading.Lock(), threading.Event(), []
    set_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc

    def watch():
        wait = seconds
        while not stop.wait(wait):
            with lock:
                if not stop.is_set():
                    fired.append(set_exc(ctypes.c_ulong(thread), ctypes.py_object(TemplateRanOver)))
            wait = 0.1

    threading.Thread(target=watch, daemon=True).start()
    try:
        yield
    finally:
        with lock:
            stop.set()
            if fired:
                set_exc(ctypes.c_ulong(thread), None)  # one not yet raised: raised here
        if fired:
            raise TemplateRanOver()


def _bounded(value, *more):
    """`value`, unless it or one of `more` is a number or a length past what a template
    may output (what a call or filter would allocate, a string grown by doubling)."""
    for v in (value, *more):
        size = v if type(v) is int else len(v) if isinstance(v, (str, list)) else 0
        if size > JINJA_MAX_OUTPUT_CHARS:
            raise TemplateLimit(f"the chat template uses a value of {size} items, past "
                                f"{JINJA_MAX_OUTPUT_CHARS}")
    return value


def _bounded_filter(f):  # functools.wraps keeps jinja's pass_context marks
    return functools.wraps(f)(lambda *a, **k: _bounded(None, *a, *k.values()) or f(*a, **k))


class _BoundedFilters(dict):
    """A sandbox's filters: one set after it is made (transformers' `tojson`) is
    wrapped by _bounded_filter too."""

    def __setitem__(self, name, f):
        super().__setitem__(name, _bounded_filter(f))


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, bounded: every render (Template.render joins its
    pieces through `concat`) ends within JINJA_MAX_SECONDS and JINJA_MAX_OUTPUT_CHARS;
    the numbers and lengths calls, filters, `range`, `*` and `+` take, and the values
    attributes and items give, are bounded before they allocate. Transformers renders
    every template in it (compat.bound_chat_templates): one bound for all."""

    rendering = threading.local()  # per rendering thread: serve renders in several
    intercepted_binops = frozenset(["*", "**", "+"])

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.globals["range"] = self.bounded_range
        self.filters = _BoundedFilters({n: _bounded_filter(f) for n, f in self.filters.items()})

    def from_string(self, source, *args, **kwargs):
        if not isinstance(source, str) or len(source) > JINJA_MAX_TEMPLATE_CHARS:
            raise TemplateLimit("the chat template is not a string of at most "
                                f"{JINJA_MAX_TEMPLATE_CHARS} characters")
        return super().from_string(source, *args, **kwargs)

    def concat(self, pieces):
        if getattr(self.rendering, "on", False):  # a block's or a macro's pieces
            return _bounded("".join(pieces))
        self.rendering.on = True
        try:
            with _deadline(JINJA_MAX_SECONDS):
                out, size = [], 0
                for piece in pieces:
                    size += len(piece)
                    if size > JINJA_MAX_OUTPUT_CHARS:
                        raise TemplateLimit(f"the chat template's output passed "
                                            f"{JINJA_MAX_OUTPUT_CHARS} characters")
                    out.append(piece)
                return "".join(out)
        finally:
            self.rendering.on = False

    def bounded_range(self, *args):
        r = range(*args)
        if len(r) > JINJA_MAX_RANGE:
            raise TemplateLimit(f"the chat template asked for a range of {len(r)} numbers")
        return r

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's names)
        _bounded(None, *args, *kwargs.values())
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        return _bounded(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        return _bounded(super().getitem(obj, argument))

    def call_binop(self, context, operator, left, right):
        if operator == "**" and (not isinstance(right, (int, float)) or abs(right) > 64):
            raise TemplateLimit("the chat template raises to a power over 64")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _bounded(len(seq) * n)
        if operator == "+" and isinstance(left, (str, list)) and isinstance(right, (str, list)):
            _bounded(len(left) + len(right))
        return super().call_binop(context, operator, left, right)


def render_jinja_chat(template, messages, **context):
    """Render a chat template over messages (and context) as one string, as
    transformers renders it (continue_final_message included), bounded."""
    from transformers.utils.chat_template_utils import render_jinja_template

    compat.bound_chat_templates(BoundedSandbox)
    return render_jinja_template([messages], chat_template=template, **context)[0][0]
