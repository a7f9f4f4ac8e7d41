"""`deltafin-run MODEL PROMPT`: one prompt, one reply, streamed to stdout (or one
JSON object with --json), the run's counters on stderr."""

import json
import sys

from deltafin_mlx.cli.options import (check_request_flags, defaults_of, load_model,
                                      refuse_without_template)
from deltafin_mlx.cli.reply import ReplyPrinter
from deltafin_mlx.errors import UsageError
from deltafin_mlx.engine.runtime import runtime


def cmd_run(args, model_dir=None) -> int:
    """`model_dir`: the directory already opened (the demo opens it to plan)."""
    if args.prompt is None:
        raise UsageError("no prompt given (a prompt, '-' for stdin, or --chat)")
    check_request_flags(args)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    model, prepared = open_model(args, text, model_dir)
    trace = start_trace(model, args.trace_routing)
    reply = generate_reply(model, prepared, echo=not args.json)
    if trace:
        trace.close()
    if args.json:
        out = {"text": reply.text, "thinking": reply.thinking, "tokens": reply.tokens,
               "finish_reason": reply.finish_reason}
        if prepared.top_logprobs:
            out["top_logprobs"] = reply.top_logprobs or []
        print(json.dumps({**out, "stats": reply.stats.to_dict()}))
    else:
        print()
        if runtime(model).is_primary:  # every rank computes the same counters
            print(f"[deltafin] {reply.stats.line()}", file=sys.stderr)
    runtime(model).close()
    if reply.finish_reason == "interrupted":
        print("deltafin-run: interrupted", file=sys.stderr)
        return 130
    return 0


def open_model(args, text, model_dir=None):
    """(model, the request prepared: generation/engine.py's), from the model
    directory opened once. The tokenizer comes first, because the prompt's length
    and config.json's maximum size the context the model is then loaded for."""
    from deltafin_mlx.engine.load import open_tokenizer
    from deltafin_mlx.format.model_dir import open_model_dir
    from deltafin_mlx.generation.engine import model_limits, prepare, prompt_tokens
    from deltafin_mlx.model.config import max_context
    from deltafin_mlx.plan.memory import round_context

    model_dir = open_model_dir(model_dir or args.model)
    tokenizer = open_tokenizer(model_dir)
    refuse_without_template(tokenizer, args)
    request, defaults = request_of(args, text), defaults_of(args)
    prompt = prompt_tokens(request, tokenizer, defaults.thinking)
    context = args.context or round_context(len(prompt) + args.max_tokens,
                                            max_context(model_dir.config))
    model, _ = load_model(args, model_dir, context=context)
    check_request_flags(args, model)
    return model, prepare(request, tokenizer, model_limits(model), defaults, prompt=prompt)


def request_of(args, text):
    """`text` as the user's message (after --system's) for the model's chat
    template, or as it is with --raw."""
    from deltafin_mlx.generation.request import GenerationRequest

    if args.raw:
        return GenerationRequest(prompt=text)
    system = [{"role": "system", "content": args.system}] if args.system else []
    effort = {"thinking_effort": args.thinking_effort} if args.thinking_effort else None
    return GenerationRequest(messages=system + [{"role": "user", "content": text}],
                             chat_template_kwargs=effort)


def generate_reply(model, prepared, echo=True):
    """The engine's Completion of `prepared`; with `echo` the reply is printed as
    it comes, as a chat shows it (ReplyPrinter: thinking apart, markup never)."""
    from deltafin_mlx.generation.engine import complete, stream
    from deltafin_mlx.generation.stream import PrefillProgress, StatsMeter

    printer = ReplyPrinter(sys.stdout.isatty(), echo=echo)
    meter = StatsMeter(model)
    progress = PrefillProgress(sys.stderr) if sys.stderr.isatty() else None
    prefilled = [0]

    def on_progress(done, total):
        prefilled[0] = done
        if progress is not None:
            progress(done, total)

    try:
        reply = complete(stream(model, prepared, progress=on_progress), printer)
    finally:
        if progress is not None:
            progress.clear()  # the next note starts on a line of its own
    if not reply.tokens:  # stopped in the prefill: what it did
        reply.stats = meter.now(0, prefilled[0])
    printer.finish()
    return reply


def start_trace(model, path):
    if not path:
        return None
    from deltafin_mlx.engine.trace import RoutingTrace

    return RoutingTrace(model, path)
