"""`deltafin-run`: run, chat, plan, bench, describe and verify a Deltafin model,
run batch jobs, serve it, or try the demo (the commands are listed in COMMANDS)."""

import argparse
import json
import sys

from deltafin_mlx.cli.common import HelpFormatter, add_version, quiet_broken_pipe

USAGE = """deltafin-run MODEL PROMPT [options]
       deltafin-run MODEL --chat [options]
       deltafin-run plan MODEL|CONFIG.json|HUB_ID [options]
       deltafin-run bench MODEL [options]
       deltafin-run batch MODEL IN.jsonl -o OUT.jsonl [options]
       deltafin-run info MODEL
       deltafin-run verify MODEL
       deltafin-run --demo [PROMPT] [options]"""

COMMANDS = """commands:
  MODEL PROMPT      generate from one prompt ('-' reads it from stdin)
  MODEL --chat      an interactive chat
  plan              the memory plan and a projected speed, without loading weights
                    (of a converted model, a source config.json or a hub id)
  bench             a short decode benchmark
  batch             answer every prompt of a JSONL file, decoded together (resumable)
  info              what a converted model is: architecture, experts, quantization,
                    sizes, source, when it was converted
  verify            check every file and every expert record's checksum
  --demo            build a small synthetic K3-layout model and run it streaming

'deltafin-run COMMAND --help' shows a command's options. MODEL is a directory
written by deltafin-convert (convert a Hugging Face checkpoint with it first)."""


class CliError(Exception):
    """Shown to the user as one line, exit code 1."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit code 2)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)  # every option shows its default
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_or_auto(value):
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {value!r}")
    return n


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
    p.add_argument("--read-mode", choices=("direct", "mmap"), default="direct",
                   help="how experts are read: O_DIRECT (F_NOCACHE on macOS), or mmap")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def add_sampling_options(p, min_p: bool = False):
    """Sampling, stops and prompt format: the same for a run, a chat and a batch."""
    p.add_argument("--temp", type=temperature, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=top_p, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--top-k", type=count, default=0, help="sample from the k likeliest (0: all)")
    if min_p:
        p.add_argument("--min-p", type=float, default=0.0, help="min-p sampling threshold")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: not fixed)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop before this text; repeat the option for several (default: none)")
    p.add_argument("--no-think", action="store_true", help="thinking off (K3 prompt format)")
    p.add_argument("--raw", action="store_true", help="no chat template: prompts as they are")


def run_parser():
    p = Parser(prog="deltafin-run", usage=USAGE, epilog=COMMANDS,
               description="Run a Deltafin model: MoE experts stream from disk, the output is\n"
               "identical to running it fully in memory. Try 'deltafin-run --demo' first.")
    p.add_argument("model", nargs="?", help="a directory written by deltafin-convert")
    p.add_argument("prompt", nargs="?", help="the prompt ('-' reads it from stdin)")
    p.add_argument("-n", "--max-tokens", type=count, default=None,
                   help="tokens to generate (default: 256; 64 with --demo)")
    add_sampling_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--chat", action="store_true", help="interactive chat")
    p.add_argument("--session", metavar="FILE", default=None,
                   help="chat: save the conversation and the model's cache to FILE after "
                   "each turn, restore it at start (.safetensors is added if missing) (default: none)")
    p.add_argument("--system", metavar="TEXT", default=None, help="chat: a system message (default: none)")
    p.add_argument("--thinking-effort", choices=("low", "high", "max"), default=None,
                   help="K3's thinking effort (default: the model's, max)")
    p.add_argument("--context", type=positive, default=None, metavar="N",
                   help="tokens of KV cache/state to reserve (default: prompt + max tokens, "
                   "rounded up; 4096 in chat)")
    p.add_argument("--demo", action="store_true",
                   help="build a small synthetic K3-layout model and run it streaming")
    p.add_argument("--demo-dir", default=None,
                   help="where the demo model lives (default: ~/.cache/deltafin/demo)")
    p.add_argument("--trace-routing", metavar="FILE", default=None,
                   help="write each token's routed experts as JSONL, for bench/simulate_cache.py "
                   "(default: no trace)")
    add_load_options(p)
    add_version(p)
    return p


def plan_parser():
    p = Parser(prog="deltafin-run plan", description="Show the memory plan for a model, "
               "without loading its weights.")
    p.add_argument("model", help="a Deltafin model directory, a source directory or "
                   "config.json, or a Hugging Face hub id (only its config.json is fetched)")
    p.add_argument("--budget", default=None,
                   help="memory budget, e.g. 8GB (default: from available memory)")
    p.add_argument("--context", type=int, default=4096,
                   help="tokens of context to hold KV/state for (at most the model's maximum)")
    p.add_argument("--sequences", type=positive_or_auto, default=1, metavar="N|auto",
                   help="sequences decoded together (a batch job); auto: the most that fit "
                   "(default: 1)")
    for flag, default, what in (("--bits", 4, "trunk quantization bits"),
                                ("--group-size", 64, "trunk quantization group size"),
                                ("--expert-bits", 4, "bits for bf16/fp16 experts"),
                                ("--expert-group-size", 64, "group size for bf16/fp16 experts")):
        p.add_argument(flag, type=int, default=None,
                       help=f"{what}, as deltafin-convert would use them; only for planning a "
                       f"source (default: {default})")
    p.add_argument("--disk-gbps", type=float, default=None,
                   help="disk read bandwidth in GB/s (default: measured once, then cached)")
    p.add_argument("--compute-gwps", type=float, default=None,
                   help="quantized matvec rate, G weights/s (default: measured once, then cached)")
    p.add_argument("--remeasure", action="store_true",
                   help="measure the disk and compute rates again instead of using cached ones")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="activation dtype to plan for (default: float32 on CPU; the model's "
                   "dtype on GPU — plan an Apple GPU with bfloat16)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--ranks", type=positive, default=1,
                   help="plan one rank of N running the model tensor parallel (mlx.launch)")
    return p


def bench_parser():
    p = Parser(prog="deltafin-run bench", description="A short decode benchmark.")
    p.add_argument("model", help="a directory written by deltafin-convert")
    p.add_argument("-n", "--max-tokens", type=count, default=32, help="tokens decoded per run")
    p.add_argument("--prompt-tokens", type=positive, default=16, help="prompt length of each run")
    p.add_argument("--repeats", type=positive, default=3, help="runs (the median is reported)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_load_options(p)
    return p


def batch_parser():
    p = Parser(prog="deltafin-run batch", description="Answer every prompt of a JSONL file "
               "(decoded together; rerun the same command to resume). Lines: "
               '{"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]}, optional '
               '"max_tokens", "temp", "top_p", "top_k", "min_p", "seed", "stop".')
    p.add_argument("model", help="a directory written by deltafin-convert")
    p.add_argument("input", help="JSONL requests")
    p.add_argument("-o", "--output", required=True, help="JSONL results (appended)")
    p.add_argument("--batch-size", type=positive_or_auto, default="auto", metavar="N|auto",
                   help="sequences decoded together (default: what the budget allows, at most 32 "
                   "and at most the requests left)")
    p.add_argument("--context", type=positive, default=4096,
                   help="longest prompt + max_tokens of a request (planned per sequence)")
    p.add_argument("-n", "--max-tokens", type=count, default=256,
                   help="tokens to generate per request")
    add_sampling_options(p, min_p=True)
    p.add_argument("--logprobs", action="store_true", help="each token's log-probability")
    p.add_argument("--no-progress", action="store_true", help="no progress line on a terminal")
    add_load_options(p)
    return p


def cmd_batch(argv):
    from deltafin_mlx.batch import read_job, run_job, summary_line

    args = batch_parser().parse_args(argv)
    opts = batch_options(args)
    # "auto" reserves state for no more sequences than there are requests left.
    _, todo = read_job(args.input, args.output)
    model, tokenizer = load_model(args, context=args.context, sequences=args.batch_size,
                                  max_sequences=max(1, len(todo)))
    opts.batch_size = model._deltafin.plan.sequences
    summary = run_job(model, tokenizer, args.input, args.output, opts,
                      show_progress=False if args.no_progress else None)
    print(f"[deltafin] {summary_line(summary)}", file=sys.stderr)
    model._deltafin.close()
    return 0


def batch_options(args):
    from deltafin_mlx.batch import BatchOptions

    return BatchOptions(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p,
                        top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                        raw=args.raw, thinking=not args.no_think, context=args.context,
                        logprobs=args.logprobs)


def load_model(args, **extra):
    from deltafin_mlx.engine.load import load

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
    from deltafin_mlx.generate import PrefillProgress, StatsMeter, stream_generate

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
    from deltafin_mlx.generate import chat_prompt

    if args.raw:
        return tokenizer.encode(text)
    messages = (history or []) + [{"role": "user", "content": text}]
    return chat_prompt(tokenizer, messages, thinking=not args.no_think)


def cmd_run(args):
    if args.prompt is None:
        raise CliError("no prompt given (a prompt, '-' for stdin, or --chat)")
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    from deltafin_mlx.engine.load import model_config, open_tokenizer
    from deltafin_mlx.plan.memory import max_context, round_context

    tokenizer = open_tokenizer(args.model)
    prompt = make_prompt(tokenizer, text, args)
    context = args.context or round_context(len(prompt) + args.max_tokens,
                                            max_context(model_config(args.model)))
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
    from deltafin_mlx.chat import run_chat

    model, tokenizer = load_model(args)
    try:
        return run_chat(model, tokenizer, args)
    finally:
        model._deltafin.close()


def cmd_bench(argv):
    import statistics

    import mlx.core as mx

    from deltafin_mlx.generate import StatsMeter

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
    from deltafin_mlx.cli.plan import format_plan, plan_from_path

    args = plan_parser().parse_args(argv)
    report = plan_from_path(args)
    print(json.dumps(report, indent=1) if args.json else format_plan(report))
    return 0


def cmd_demo(args):
    from deltafin_mlx.cli.demo import run_demo

    return run_demo(args)


def cmd_info(argv):
    from deltafin_mlx.cli.info import run_info

    return run_info(argv)


def cmd_verify(argv):
    from deltafin_mlx.format.verify import run_verify

    return run_verify(argv)


def refuse_ignored_options(args):
    """An option that would do nothing in the mode asked for is refused, not ignored
    (and -n gets the default of the mode)."""
    if args.demo and args.model is not None:
        if args.prompt is not None:
            raise CliError("--demo runs its own model: give it only a prompt "
                           "(deltafin-run --demo \"PROMPT\")")
        args.model, args.prompt = None, args.model  # `--demo PROMPT`: the one positional
    if args.demo_dir and not args.demo:
        raise CliError("--demo-dir only applies with --demo")
    if args.chat:
        if args.prompt is not None:
            raise CliError("--chat reads each turn from the terminal: drop the prompt argument")
        for flag, given, why in (
                ("--json", args.json, "a chat streams its replies as text"),
                ("--trace-routing", args.trace_routing, "trace a one-shot run instead"),
                ("--raw", args.raw, "a chat needs the model's chat template")):
            if given:
                raise CliError(f"{flag} does not work with --chat ({why})")
    if args.raw and args.no_think:
        raise CliError("--no-think changes the chat template, which --raw leaves out")
    if args.max_tokens is None:
        args.max_tokens = 64 if args.demo else 256


def start_trace(model, path):
    if not path:
        return None
    from deltafin_mlx.engine.trace import RoutingTrace

    return RoutingTrace(model, path)


@quiet_broken_pipe
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        if argv and argv[0] == "plan":
            return cmd_plan(argv[1:])
        from deltafin_mlx.model.shard import quiet_other_ranks

        quiet_other_ranks()  # under mlx.launch: one output, from rank 0
        if argv and argv[0] == "bench":
            return cmd_bench(argv[1:])
        if argv and argv[0] == "batch":
            return cmd_batch(argv[1:])
        if argv and argv[0] == "info":
            return cmd_info(argv[1:])
        if argv and argv[0] == "verify":
            return cmd_verify(argv[1:])
        if argv and argv[0] == "serve":
            from deltafin_mlx.cli.serve import cmd_serve

            return cmd_serve(argv[1:])
        # intermixed: `MODEL --stop X PROMPT` fills both positionals
        args = run_parser().parse_intermixed_args(argv)
        refuse_ignored_options(args)
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
    except BrokenPipeError:
        raise  # stdout closed early (`| head`): quiet_broken_pipe ends quietly
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # every failure is one line unless --debug (tiktoken's
        if debug:                 # Rust panics are BaseExceptions, not Exceptions)
            raise
        print(f"deltafin-run: error: {one_line(e)}", file=sys.stderr)
        return 1


def one_line(e: BaseException) -> str:
    from deltafin_mlx.batch import BatchError
    from deltafin_mlx.chat import SessionError
    from deltafin_mlx.generate import ContextError
    from deltafin_mlx.engine.load import TokenIdError
    from deltafin_mlx.format.manifest import ModelError
    from deltafin_mlx.plan.memory import BudgetError
    from deltafin_mlx.engine.reader import ReadError

    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, (CliError, ModelError, BudgetError, ReadError, BatchError, SessionError,
                      ContextError, TokenIdError)):
        return msg
    if isinstance(e, OSError) and e.filename:
        return f"{e.filename}: {e.strerror}"
    return f"{type(e).__name__}: {msg} (rerun with --debug for details)"


if __name__ == "__main__":
    sys.exit(main())
