"""`deltafin-run`: run, chat, plan and bench a Deltafin model, or try the demo.

    deltafin-run MODEL "prompt" [-n N] [--budget B] [--temp T] ... [--json]
    deltafin-run MODEL --chat
    deltafin-run plan MODEL|CONFIG.json [--budget B] [--context N]
    deltafin-run bench MODEL [--budget B] [-n N]
    deltafin-run --demo
"""

import argparse
import json
import sys

RUN_HELP = __doc__


class CliError(Exception):
    """Shown to the user as one line, exit code 1."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_load_options(p):
    p.add_argument("--budget", default=None,
                   help="memory budget, e.g. 8GB (default: from available memory)")
    p.add_argument("--reader-threads", type=int, default=1, help="background read threads")
    p.add_argument("--no-lookahead", action="store_true", help="no speculative expert reads")
    p.add_argument("--verify", action="store_true", help="check expert checksums on read")
    p.add_argument("--read-mode", choices=("direct", "mmap"), default="direct")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def run_parser():
    p = Parser(prog="deltafin-run", description="Run a Deltafin model (streams MoE experts "
               "from disk; output identical to running it fully in memory).",
               epilog="Subcommands: 'deltafin-run plan ...', 'deltafin-run bench ...'. "
               "Try 'deltafin-run --demo' first.")
    p.add_argument("model", nargs="?", help="a directory written by deltafin-convert")
    p.add_argument("prompt", nargs="?", help="the prompt ('-' reads it from stdin)")
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", nargs="+", default=[], metavar="STR", help="stop at any of these")
    p.add_argument("--no-think", action="store_true", help="thinking off (K3 prompt format)")
    p.add_argument("--raw", action="store_true", help="no chat template: the prompt as is")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--chat", action="store_true", help="interactive chat")
    p.add_argument("--session", metavar="FILE", default=None,
                   help="chat: save the conversation and the model's cache to FILE after "
                   "each turn, restore it at start (.safetensors is added if missing)")
    p.add_argument("--system", metavar="TEXT", default=None, help="chat: a system message")
    p.add_argument("--thinking-effort", choices=("low", "high", "max"), default=None,
                   help="K3's thinking effort (default: the model's, max)")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="tokens of KV cache/state to reserve (default: prompt + max tokens, "
                   "rounded up; 4096 in chat)")
    p.add_argument("--demo", action="store_true",
                   help="build a small synthetic K3-layout model and run it streaming")
    p.add_argument("--demo-dir", default=None, help="where the demo model lives")
    p.add_argument("--trace-routing", metavar="FILE", default=None,
                   help="write each token's routed experts as JSONL (for bench/simulate_cache.py)")
    add_load_options(p)
    return p


def plan_parser():
    p = Parser(prog="deltafin-run plan", description="Show the memory plan for a model, "
               "without loading its weights.")
    p.add_argument("model", help="a Deltafin model directory, or a source config.json")
    p.add_argument("--budget", default=None)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--bits", type=int, default=4, help="trunk bits (for a config.json)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--expert-bits", type=int, default=4)
    p.add_argument("--expert-group-size", type=int, default=64)
    p.add_argument("--disk-gbps", type=float, default=None,
                   help="disk read bandwidth (default: measured)")
    p.add_argument("--compute-gwps", type=float, default=None,
                   help="quantized matvec rate, G weights/s (default: measured)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="activation dtype to plan for (default: float32 on CPU; the model's "
                   "dtype on GPU — plan an Apple GPU with bfloat16)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--debug", action="store_true")
    return p


def bench_parser():
    p = Parser(prog="deltafin-run bench", description="A short decode benchmark.")
    p.add_argument("model")
    p.add_argument("-n", "--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    add_load_options(p)
    return p


def load_model(args, **extra):
    from .loader import load

    if getattr(args, "context", None) is not None:
        extra.setdefault("context", args.context)
    return load(args.model, memory_budget=args.budget, reader_threads=args.reader_threads,
                lookahead=not args.no_lookahead, verify=args.verify, read_mode=args.read_mode,
                progress=sys.stderr.isatty(), **extra)


class StopFilter:
    """Streams text, holding back what could be the start of a stop string."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.shown = 0
        self.stopped = False

    def add(self, segment: str) -> str:
        self.text += segment
        for s in self.stops:
            i = self.text.find(s)
            if i >= 0:
                self.text = self.text[:i]
                self.stopped = True
        hold = 0 if self.stopped else max((len(s) - 1 for s in self.stops), default=0)
        upto = max(self.shown, len(self.text) - hold)
        out = self.text[self.shown : upto]
        self.shown = upto
        return out

    def flush(self) -> str:
        out = self.text[self.shown :]
        self.shown = len(self.text)
        return out


def generate_reply(model, tokenizer, prompt, args, echo=True):
    from .generate import PrefillProgress, StatsMeter, stream_generate

    stop = StopFilter(args.stop)
    meter = StatsMeter(model)
    stats, tokens, reason = meter.now(0, len(prompt)), [], None
    progress = PrefillProgress(sys.stderr) if sys.stderr.isatty() else None
    try:
        for r in stream_generate(model, tokenizer, prompt, args.max_tokens, temp=args.temp,
                                 top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                 prompt_progress_callback=progress):
            tokens.append(r.token)
            stats, reason = r.deltafin, r.finish_reason
            out = stop.add(r.text)
            if echo and out:
                print(out, end="", flush=True)
            if stop.stopped:
                reason = "stop"
                break
    except KeyboardInterrupt:  # the stats so far are still shown
        reason = "interrupted"
        if not tokens:
            stats = meter.now(0, len(prompt))
    out = stop.flush()
    if echo and out:
        print(out, end="", flush=True)
    return stop.text, tokens, stats, reason


def make_prompt(tokenizer, text, args, history=None):
    from .generate import chat_prompt

    if args.raw:
        return tokenizer.encode(text)
    messages = (history or []) + [{"role": "user", "content": text}]
    return chat_prompt(tokenizer, messages, thinking=not args.no_think)


def cmd_run(args):
    if args.prompt is None:
        raise CliError("no prompt given (a prompt, '-' for stdin, or --chat)")
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    from .loader import open_tokenizer
    from pathlib import Path

    from mlx_lm.utils import load_config

    from .planner import max_context, round_context

    tokenizer = open_tokenizer(args.model)
    prompt = make_prompt(tokenizer, text, args)
    context = args.context or round_context(len(prompt) + args.max_tokens,
                                            max_context(load_config(Path(args.model))))
    model, _ = load_model(args, context=context, tokenizer=tokenizer)
    trace = start_trace(model, args.trace_routing)
    reply, tokens, stats, reason = generate_reply(model, tokenizer, prompt, args,
                                                  echo=not args.json)
    if trace:
        trace.close()
    if args.json:
        print(json.dumps({"text": reply, "tokens": tokens, "finish_reason": reason,
                          "stats": stats.to_dict()}))
    else:
        print()
        print(f"[deltafin] {stats.line()}", file=sys.stderr)
    model._deltafin.close()
    if reason == "interrupted":
        print("deltafin-run: interrupted", file=sys.stderr)
        return 130
    return 0


def cmd_chat(args):
    from .chat import run_chat

    model, tokenizer = load_model(args)
    try:
        return run_chat(model, tokenizer, args)
    finally:
        model._deltafin.close()


def cmd_bench(argv):
    import statistics

    import mlx.core as mx

    from .generate import StatsMeter

    args = bench_parser().parse_args(argv)
    model, _ = load_model(args, tokenizer=False)
    from mlx_lm.models.cache import make_prompt_cache

    step = model._deltafin.plan.prefill_step
    runs = []
    for i in range(args.repeats):
        cache = make_prompt_cache(model)
        prompt = mx.array([[(7 * j + i) % 200 + 1 for j in range(args.prompt_tokens)]])
        meter = StatsMeter(model)
        for start in range(0, prompt.shape[1] - 1, step):  # the plan's prefill chunks
            model(prompt[:, start : min(start + step, prompt.shape[1] - 1)], cache=cache)
            mx.eval([c.state for c in cache])
        y = mx.argmax(model(prompt[:, -1:], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
        meter.first_token()
        for _ in range(args.max_tokens):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            mx.eval(y)
        runs.append(meter.now(args.max_tokens + 1, args.prompt_tokens))
    tps = [r.decode_tokens_per_second for r in runs]
    pps = [r.prefill_tokens_per_second for r in runs]
    result = {
        "model": args.model,
        "budget_bytes": model._deltafin.plan.budget,
        "cache_fraction": model._deltafin.plan.cache_fraction,
        "tokens_per_second_median": statistics.median(tps),
        "tokens_per_second_range": [min(tps), max(tps)],
        "prefill_tokens_per_second_median": statistics.median(pps),
        "prefill_tokens_per_second_range": [min(pps), max(pps)],
        "prefill_step": step,
        "runs": [r.to_dict() for r in runs],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"prefill, {args.prompt_tokens} tokens x {args.repeats}: median "
              f"{result['prefill_tokens_per_second_median']:.2f} tok/s "
              f"(range {min(pps):.2f}-{max(pps):.2f}, chunks of {step}); "
              f"decode, {args.max_tokens} tokens: median "
              f"{result['tokens_per_second_median']:.2f} tok/s "
              f"(range {min(tps):.2f}-{max(tps):.2f}); cache {result['cache_fraction']:.0%} "
              f"of experts; last run: {runs[-1].line()}")
    model._deltafin.close()
    return 0


def cmd_plan(argv):
    from .plan import format_plan, plan_from_path

    args = plan_parser().parse_args(argv)
    report = plan_from_path(args)
    print(json.dumps(report, indent=1) if args.json else format_plan(report))
    return 0


def cmd_demo(args):
    from .demo import run_demo

    return run_demo(args)


def start_trace(model, path):
    if not path:
        return None
    from .trace import RoutingTrace

    return RoutingTrace(model, path)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        if argv and argv[0] == "plan":
            return cmd_plan(argv[1:])
        if argv and argv[0] == "bench":
            return cmd_bench(argv[1:])
        args = run_parser().parse_args(argv)
        if args.demo:
            return cmd_demo(args)
        if args.model is None:
            raise CliError("no model given (try 'deltafin-run --demo', or see --help)")
        if args.chat:
            return cmd_chat(args)
        return cmd_run(args)
    except KeyboardInterrupt:
        print("\ndeltafin-run: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # every failure is one line unless --debug
        if debug:
            raise
        print(f"deltafin-run: error: {one_line(e)}", file=sys.stderr)
        return 1


def one_line(e: BaseException) -> str:
    from .chat import SessionError
    from .generate import ContextError
    from .manifest import ModelError
    from .planner import BudgetError
    from .reader import ReadError

    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, (CliError, ModelError, BudgetError, ReadError, SessionError, ContextError)):
        return msg
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror}"
    return f"{type(e).__name__}: {msg} (rerun with --debug for details)"


if __name__ == "__main__":
    sys.exit(main())
