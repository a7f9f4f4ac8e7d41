"""`deltafin-run`: run, chat, plan and bench a Deltafin model, or try the demo.

    deltafin-run MODEL "prompt" [-n N] [--budget B] [--temp T] ... [--json]
    deltafin-run MODEL --chat
    deltafin-run plan MODEL|CONFIG.json [--budget B] [--context N]
    deltafin-run bench MODEL [--budget B] [-n N]
    deltafin-run verify MODEL
    deltafin-run serve MODEL [--budget B] [--context N] [--port P] [mlx_lm.server options]
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


def count(text):
    """A number of tokens: a non-negative integer."""
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {n}")
    return n


def positive(text):
    n = int(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {n}")
    return n


def temperature(text):
    t = float(text)
    if not (t >= 0 and t != float("inf")):  # NaN fails every comparison
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return t


def top_p(text):
    p = float(text)
    if not 0 < p <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], not {text}")
    return p


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
    p.add_argument("-n", "--max-tokens", type=count, default=256)
    p.add_argument("--temp", type=temperature, default=0.0,
                   help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=top_p, default=1.0)
    p.add_argument("--top-k", type=count, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", nargs="+", default=[], metavar="STR", help="stop at any of these")
    p.add_argument("--no-think", action="store_true", help="thinking off (K3 prompt format)")
    p.add_argument("--raw", action="store_true", help="no chat template: the prompt as is")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--chat", action="store_true", help="interactive chat")
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
    p.add_argument("--context", type=positive, default=4096)
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
    p.add_argument("-n", "--max-tokens", type=count, default=32)
    p.add_argument("--prompt-tokens", type=positive, default=16)
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--json", action="store_true")
    add_load_options(p)
    return p


def load_model(args, **extra):
    from .loader import load

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
    from .generate import RunStats, stream_generate

    stop = StopFilter(args.stop)
    stats, tokens, reason = RunStats(), [], None
    for r in stream_generate(model, tokenizer, prompt, args.max_tokens, temp=args.temp,
                             top_p=args.top_p, top_k=args.top_k, seed=args.seed):
        tokens.append(r.token)
        stats, reason = r.deltafin, r.finish_reason
        out = stop.add(r.text)
        if echo and out:
            print(out, end="", flush=True)
        if stop.stopped:
            reason = "stop"
            break
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
    model, tokenizer = load_model(args)
    trace = start_trace(model, args.trace_routing)
    prompt = make_prompt(tokenizer, text, args)
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
    return 0


def cmd_chat(args):
    model, tokenizer = load_model(args)
    history, total = [], []
    print("Deltafin chat: /reset clears the history, /stats shows counters, /quit ends.",
          file=sys.stderr)
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            break
        line = line.strip()
        if not line:
            continue
        if line == "/quit":
            break
        if line == "/reset":
            history = []
            print("[history cleared]", file=sys.stderr)
            continue
        if line == "/stats":
            s = model._deltafin.stats
            print(f"[deltafin] {sum(total)} tokens so far; experts: {s.hits} hits, "
                  f"{s.misses} misses ({s.hit_rate:.0%} hit rate), "
                  f"{model._deltafin.store.bytes_read / 1e6:.1f} MB read", file=sys.stderr)
            continue
        prompt = make_prompt(tokenizer, line, args, history)
        reply, tokens, stats, _ = generate_reply(model, tokenizer, prompt, args)
        print()
        print(f"[deltafin] {stats.line()}", file=sys.stderr)
        total.append(len(tokens))
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": reply}]
    model._deltafin.close()
    return 0


def cmd_bench(argv):
    import statistics

    import mlx.core as mx

    from .generate import StatsMeter

    args = bench_parser().parse_args(argv)
    model, _ = load_model(args, tokenizer=False)
    from mlx_lm.models.cache import make_prompt_cache

    runs = []
    for i in range(args.repeats):
        cache = make_prompt_cache(model)
        prompt = mx.array([[(7 * j + i) % 200 + 1 for j in range(args.prompt_tokens)]])
        logits = model(prompt, cache=cache)
        y = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(y)
        meter = StatsMeter(model)
        for _ in range(args.max_tokens):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            mx.eval(y)
        runs.append(meter.now(args.max_tokens))
    tps = [r.tokens_per_second for r in runs]
    result = {
        "model": args.model,
        "budget_bytes": model._deltafin.plan.budget,
        "cache_fraction": model._deltafin.plan.cache_fraction,
        "tokens_per_second_median": statistics.median(tps),
        "tokens_per_second_range": [min(tps), max(tps)],
        "runs": [r.to_dict() for r in runs],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"decode, {args.max_tokens} tokens x {args.repeats}: median "
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
        if argv and argv[0] == "verify":
            from .verify import cmd_verify

            return cmd_verify(argv[1:])
        if argv and argv[0] == "serve":
            from .serve import cmd_serve

            return cmd_serve(argv[1:])
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
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # every failure is one line unless --debug (tiktoken's
        if debug:                 # Rust panics are BaseExceptions, not Exceptions)
            raise
        print(f"deltafin-run: error: {one_line(e)}", file=sys.stderr)
        return 1


def one_line(e: BaseException) -> str:
    from .loader import TokenIdError
    from .manifest import ModelError
    from .planner import BudgetError
    from .reader import ReadError

    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, (CliError, ModelError, BudgetError, ReadError, TokenIdError)):
        return msg
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror}"
    return f"{type(e).__name__}: {msg} (rerun with --debug for details)"


if __name__ == "__main__":
    sys.exit(main())
