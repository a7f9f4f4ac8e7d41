"""`deltafin-run MODEL PROMPT`: one prompt, one reply, streamed to stdout (or one
JSON object with --json), the run's counters on stderr."""

import json
import sys

from deltafin_mlx.cli.options import load_model, refuse_without_template, sampling_of
from deltafin_mlx.cli.reply import ReplyPrinter
from deltafin_mlx.errors import UsageError
from deltafin_mlx.generation.stops import StopMatcher
from deltafin_mlx.engine.runtime import runtime


def cmd_run(args, model_dir=None) -> int:
    """`model_dir`: the directory already opened (the demo opens it to plan)."""
    if args.prompt is None:
        raise UsageError("no prompt given (a prompt, '-' for stdin, or --chat)")
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    model, tokenizer, prompt = open_model(args, text, model_dir)
    trace = start_trace(model, args.trace_routing)
    top = [] if getattr(args, "top_logprobs", 0) else None
    reply, thinking, tokens, stats, reason = generate_reply(model, tokenizer, prompt, args,
                                                            echo=not args.json, top=top)
    if trace:
        trace.close()
    if args.json:
        out = {"text": reply, "thinking": thinking, "tokens": tokens, "finish_reason": reason}
        if top is not None:
            out["top_logprobs"] = top
        print(json.dumps({**out, "stats": stats.to_dict()}))
    else:
        print()
        if runtime(model).is_primary:  # every rank computes the same counters
            print(f"[deltafin] {stats.line()}", file=sys.stderr)
    runtime(model).close()
    if reason == "interrupted":
        print("deltafin-run: interrupted", file=sys.stderr)
        return 130
    return 0


def open_model(args, text, model_dir=None):
    """(model, tokenizer, prompt tokens), from the model directory opened once. The
    tokenizer comes first, because the prompt's length and config.json's maximum
    size the context the model is then loaded for."""
    from deltafin_mlx.engine.load import open_tokenizer
    from deltafin_mlx.format.model_dir import open_model_dir
    from deltafin_mlx.model.config import max_context
    from deltafin_mlx.plan.memory import round_context

    model_dir = open_model_dir(model_dir or args.model)
    tokenizer = open_tokenizer(model_dir)
    refuse_without_template(tokenizer, args)
    prompt = make_prompt(tokenizer, text, args)
    context = args.context or round_context(len(prompt) + args.max_tokens,
                                            max_context(model_dir.config))
    model, _ = load_model(args, model_dir, context=context)
    return model, tokenizer, prompt


def make_prompt(tokenizer, text, args):
    """The prompt's tokens: `text` as the user's message (after --system's) in the
    model's chat template, or as it is with --raw."""
    from deltafin_mlx.generation.stream import chat_prompt

    if args.raw:
        return tokenizer.encode(text)
    system = [{"role": "system", "content": args.system}] if args.system else []
    return chat_prompt(tokenizer, system + [{"role": "user", "content": text}],
                       thinking=not args.no_think, thinking_effort=args.thinking_effort)


def generate_reply(model, tokenizer, prompt, args, echo=True, top=None):
    """(answer, thinking, tokens, stats, finish reason); with `echo` the reply is
    printed as it comes, as a chat shows it (ReplyPrinter: thinking apart, markup
    never), its answer up to the first stop string; `top`, a list, gets each
    generated position's top `args.top_logprobs` [id, logprob] pairs."""
    from deltafin_mlx.chat.session import Channels
    from deltafin_mlx.generation.stream import PrefillProgress, StatsMeter, stream_generate
    from deltafin_mlx.generation.logprobs import top_logprobs

    stop = StopMatcher(args.stop)
    printer = ReplyPrinter(stop, sys.stdout.isatty(), echo=echo)
    channels = Channels(tokenizer, thinking=not (args.raw or args.no_think))
    meter = StatsMeter(model)
    stats, tokens, reason = meter.now(0, len(prompt)), [], None
    progress = PrefillProgress(sys.stderr) if sys.stderr.isatty() else None
    prefilled = [0]

    def on_progress(done, total):
        prefilled[0] = done
        if progress is not None:
            progress(done, total)

    try:
        for r in stream_generate(model, tokenizer, prompt, args.max_tokens, seed=args.seed,
                                 prompt_progress_callback=on_progress,
                                 **sampling_of(args).generation_kwargs()):
            tokens.append(r.token)
            if top is not None:
                top.append(top_logprobs(r.logprobs, args.top_logprobs))
            stats, reason = r.deltafin, r.finish_reason
            for channel, piece in channels.add(r.token, final=r.finish_reason is not None):
                printer(channel, piece)
            if stop.stopped:
                reason = "stop"
                break
    except KeyboardInterrupt:  # the stats so far are still shown
        reason = "interrupted"
        if not tokens:  # stopped in the prefill: what it did
            stats = meter.now(0, prefilled[0])
    finally:
        if progress is not None:
            progress.clear()  # the next note starts on a line of its own
    printer.finish()
    return stop.text, channels.thinking, tokens, stats, reason


def start_trace(model, path):
    if not path:
        return None
    from deltafin_mlx.engine.trace import RoutingTrace

    return RoutingTrace(model, path)
