"""Chat templates in Jinja, K2's and Hugging Face's: transformers renders every
one, in one sandbox (compat.bound_chat_templates).

A chat template comes with the model: it runs sandboxed (no attribute access
to Python internals), and within bounds of time and output size, so a
template that loops or grows without end is one TemplateLimit line in every
entry point, not a hang or an allocation the memory cap kills.
"""

import threading
import time

from jinja2.sandbox import ImmutableSandboxedEnvironment

from deltafin_mlx import compat
from deltafin_mlx.errors import TemplateLimit


# The bounds a template runs within.
JINJA_MAX_TEMPLATE_CHARS = 1 << 20
JINJA_MAX_OUTPUT_CHARS = 16 << 20
JINJA_MAX_SECONDS = 10.0
JINJA_MAX_RANGE = 100_000


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, bounded: every render (Template.render joins its
    pieces through `concat`) runs within JINJA_MAX_SECONDS and JINJA_MAX_OUTPUT_CHARS,
    checked at each piece, call, attribute and item; `range` and `*` are bounded
    before they allocate. Transformers renders Hugging Face templates in it too
    (compat.bound_chat_templates), so every chat template has the same bounds."""

    deadline = threading.local()  # per rendering thread: serve renders in several
    # "a" * 10**10 would allocate before any check could run.
    intercepted_binops = frozenset(["*", "**"])

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.globals["range"] = self.bounded_range

    def from_string(self, source, *args, **kwargs):
        if not isinstance(source, str) or len(source) > JINJA_MAX_TEMPLATE_CHARS:
            raise TemplateLimit("the chat template is not a string of at most "
                                f"{JINJA_MAX_TEMPLATE_CHARS} characters")
        return super().from_string(source, *args, **kwargs)

    def check(self):
        if time.monotonic() > getattr(self.deadline, "at", float("inf")):
            raise TemplateLimit(f"the chat template ran over {JINJA_MAX_SECONDS:.0f} s")

    def concat(self, pieces):
        outermost = getattr(self.deadline, "at", float("inf")) == float("inf")
        if outermost:  # a render (inner concats join a block's or a macro's pieces)
            self.deadline.at = time.monotonic() + JINJA_MAX_SECONDS
        try:
            out, size = [], 0
            for piece in pieces:
                size += len(piece)
                if size > JINJA_MAX_OUTPUT_CHARS:
                    raise TemplateLimit(f"the chat template's output passed "
                                        f"{JINJA_MAX_OUTPUT_CHARS} characters")
                self.check()
                out.append(piece)
            return "".join(out)
        finally:
            if outermost:
                self.deadline.at = float("inf")

    def bounded_range(self, *args):
        r = range(*args)
        if len(r) > JINJA_MAX_RANGE:
            raise TemplateLimit(f"the chat template asked for a range of {len(r)} numbers")
        return r

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's names)
        __self.check()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        self.check()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self.check()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator, left, right):
        self.check()
        if operator == "**" and (not isinstance(right, (int, float)) or abs(right) > 64):
            raise TemplateLimit("the chat template raises to a power over 64")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if (isinstance(seq, (str, list, tuple)) and isinstance(n, int)
                        and len(seq) * n > JINJA_MAX_OUTPUT_CHARS):
                    raise TemplateLimit("the chat template repeats a value past "
                                        f"{JINJA_MAX_OUTPUT_CHARS} items")
        return super().call_binop(context, operator, left, right)


def render_jinja_chat(template, messages, **context):
    """Render a chat template over messages (and context) as one string, as
    transformers renders it (continue_final_message included), bounded."""
    from transformers.utils.chat_template_utils import render_jinja_template

    compat.bound_chat_templates(BoundedSandbox)
    return render_jinja_template([messages], chat_template=template, **context)[0][0]
