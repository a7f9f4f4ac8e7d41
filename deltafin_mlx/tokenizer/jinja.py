"""Chat templates in Jinja: K2's rendered here as transformers renders them, and
every template, transformers' too (compat.bound_chat_templates), in one sandbox.

A chat template comes with the model: it runs sandboxed (no attribute access
to Python internals), and within bounds of time and output size, so a
template that loops or grows without end is one TemplateLimit line in every
entry point, not a hang or an allocation the memory cap kills.
"""

import json
import threading
import time
from functools import lru_cache

from jinja2.sandbox import ImmutableSandboxedEnvironment
from deltafin_mlx.errors import TemplateLimit


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _raise_exception(message):
    raise ValueError(message)


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

    def check(self):
        if time.monotonic() > getattr(self.deadline, "at", float("inf")):
            raise TemplateLimit(f"the chat template ran over {JINJA_MAX_SECONDS:.0f} s")

    def concat(self, pieces):
        outermost = getattr(self.deadline, "at", float("inf")) == float("inf")
        if outermost:
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


@lru_cache(maxsize=4)
def _compile_jinja(template):
    if not isinstance(template, str):
        raise TemplateLimit("the chat template is not a string")
    if len(template) > JINJA_MAX_TEMPLATE_CHARS:
        raise TemplateLimit(f"the chat template is {len(template)} characters long")
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def render_jinja_chat(template, messages, continue_final_message=False, **context):
    """Render a chat template over messages (and context) as one string."""
    text = _compile_jinja(template).render(messages=messages, **context)
    if continue_final_message:
        # As transformers does: cut the text after the final message's content.
        final = messages[-1]["content"]
        if not isinstance(final, str):
            final = final[-1]["text"]
        final = final.strip()
        text = text[: text.rindex(final) + len(final)]
    return text
