"""Chat templates in Jinja (K2's), rendered as transformers renders them, but
sandboxed and bounded.

A chat template comes with the model: it runs sandboxed (no attribute access
to Python internals), and within bounds of time and output size, so a
template that loops or grows without end is an error, not a hang.
"""

import json
import threading
import time
from functools import lru_cache

from jinja2.sandbox import ImmutableSandboxedEnvironment
from deltafin_mlx.errors import TemplateLimit


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value,
                      ensure_ascii=ensure_ascii,
                      indent=indent,
                      separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    raise ValueError(message)


# The bounds a template runs within.
JINJA_MAX_TEMPLATE_CHARS = 1 << 20
JINJA_MAX_OUTPUT_CHARS = 16 << 20
JINJA_MAX_SECONDS = 10.0
JINJA_MAX_RANGE = 100_000


def _sandbox_class():
    deadline = threading.local()

    def check():
        if time.monotonic() > getattr(deadline, "at", float("inf")):
            raise TemplateLimit(f"the chat template ran over {JINJA_MAX_SECONDS:.0f} s")

    def bounded_range(*args):
        r = range(*args)
        if len(r) > JINJA_MAX_RANGE:
            raise TemplateLimit(f"the chat template asked for a range of {len(r)} numbers")
        for i in r:
            check()
            yield i

    class Sandbox(ImmutableSandboxedEnvironment):
        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's names)
            check()
            return super().call(__context, __obj, *args, **kwargs)

        def getattr(self, obj, attribute):
            check()
            return super().getattr(obj, attribute)

        # "a" * 10**10 would allocate before any check could run.
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            check()
            if operator == "**" and (not isinstance(right, (int, float)) or abs(right) > 64):
                raise TemplateLimit("the chat template raises to a power over 64")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if (isinstance(seq, (str, list, tuple)) and isinstance(n, int)
                            and len(seq) * n > JINJA_MAX_OUTPUT_CHARS):
                        raise TemplateLimit("the chat template repeats a value past "
                                            f"{JINJA_MAX_OUTPUT_CHARS} items")
            return super().call_binop(context, operator, left, right)

    Sandbox.deadline = deadline
    Sandbox.bounded_range = staticmethod(bounded_range)
    return Sandbox


@lru_cache(maxsize=4)
def _compile_jinja(template):
    if not isinstance(template, str):
        raise TemplateLimit("the chat template is not a string")
    if len(template) > JINJA_MAX_TEMPLATE_CHARS:
        raise TemplateLimit(f"the chat template is {len(template)} characters long")
    sandbox = _sandbox_class()
    env = sandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["range"] = sandbox.bounded_range
    return env, env.from_string(template)


def render_jinja_chat(template, messages, continue_final_message=False, **context):
    """Render a chat template over messages (and context) as one string."""
    env, compiled = _compile_jinja(template)
    env.deadline.at = time.monotonic() + JINJA_MAX_SECONDS
    pieces, size = [], 0
    try:
        for piece in compiled.generate(messages=messages, **context):
            size += len(piece)
            if size > JINJA_MAX_OUTPUT_CHARS:
                raise TemplateLimit(f"the chat template's output passed "
                                    f"{JINJA_MAX_OUTPUT_CHARS} characters")
            if time.monotonic() > env.deadline.at:
                raise TemplateLimit(f"the chat template ran over {JINJA_MAX_SECONDS:.0f} s")
            pieces.append(piece)
    finally:
        env.deadline.at = float("inf")
    text = "".join(pieces)
    if continue_final_message:
        # As transformers does: cut the text after the final message's content.
        final = messages[-1]["content"]
        if not isinstance(final, str):
            final = final[-1]["text"]
        final = final.strip()
        text = text[: text.rindex(final) + len(final)]
    return text
