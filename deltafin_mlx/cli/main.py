"""`deltafin-run`: run, chat, plan, bench, describe and verify a Deltafin model,
run batch jobs, serve it, or try the demo.

This module only dispatches, from one table (COMMANDS: a new command is one entry and its
module): a command's module is imported only when it runs; anything else is the default path,
`MODEL PROMPT`, `MODEL --chat` or `--demo`. Every failure is one line (cli/common.py's `guarded`)."""

import signal
import sys


def _interrupted_while_starting(signum, frame):
    """A Ctrl-C while this module's own imports run, before `guarded` is in place:
    the same one line and status as later, not a traceback through the import
    machinery (a loaded machine can take a second here)."""
    print("\ndeltafin-run: interrupted", file=sys.stderr)
    raise SystemExit(130)


try:
    _sigint = signal.signal(signal.SIGINT, _interrupted_while_starting)
except ValueError:  # imported outside the main thread: its signals are not ours to set
    _sigint = None

import importlib  # noqa: E402
import textwrap  # noqa: E402
import threading  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from deltafin_mlx.cli.common import add_version, guarded, quiet_broken_pipe  # noqa: E402
from deltafin_mlx.cli.options import (Parser, add_load_options, add_max_tokens,  # noqa: E402
                                      add_sampling_options, positive,
                                      request_field)
from deltafin_mlx.errors import UsageError  # noqa: E402

if _sigint is not None:  # imported: Ctrl-C is KeyboardInterrupt again, for guarded
    signal.signal(signal.SIGINT, _sigint)


@dataclass(frozen=True)
class Command:
    """A command of deltafin-run. `run` and `parser` name "module:function" in cli/,
    imported only when it runs; `run` takes the arguments after the name (the default
    path's modes: the parsed arguments and the demo's model directory)."""
    name: str  # the word after deltafin-run; for the default path's two modes, what they take
    run: str
    parser: str  # what the command takes (--budget) is read from it
    args: str  # what usage shows after the name
    help: str
    model: bool = True  # takes a MODEL, which `--demo` stands for (rm: --demo is its own)
    loads_model: bool = True  # False: never run under mlx.launch (its output is not a rank's)


COMMANDS = (
    Command("MODEL PROMPT", "run:cmd_run", "main:run_parser", "[options]",
            "generate from one prompt ('-' reads it from stdin)"),
    Command("MODEL --chat", "chat:cmd_chat", "main:run_parser", "[options]", "an interactive chat"),
    Command("plan", "plan:cmd_plan", "plan:plan_parser", "MODEL|CONFIG.json|HUB_ID [options]",
            "the memory plan and a projected speed, without loading weights (of a converted "
            "model, a source config.json or a hub id)", loads_model=False),
    Command("bench", "bench:cmd_bench", "bench:bench_parser", "MODEL [options]",
            "a short decode benchmark"),
    Command("batch", "batch:cmd_batch", "batch:batch_parser", "MODEL IN.jsonl -o OUT.jsonl [options]",
            "answer every prompt of a JSONL file, decoded together (resumable)"),
    Command("score", "score:cmd_score", "score:score_parser", "MODEL IN.jsonl -o OUT.jsonl [options]",
            "teacher-forced log-probs (and top-K) of every text of a JSONL file, many texts per "
            "sweep over the experts (resumable)"),
    Command("export", "score:cmd_export", "score:export_parser", "SCORES.jsonl -o DATASET.parquet",
            "score's top-K results as a parquet dataset in trainers' layout (ms-swift's "
            "teacher_topk_* columns, input order); needs the distill extra",
            model=False, loads_model=False),
    Command("perplexity", "perplexity:cmd_perplexity", "perplexity:perplexity_parser",
            "MODEL FILE [options]", "perplexity of a text file in windows (llama-perplexity's), "
            "and the KL divergence from a reference run (--kl-divergence-base/--kl-divergence)"),
    Command("serve", "serve:cmd_serve", "serve:parser", "MODEL [options]", "an OpenAI-compatible "
            "HTTP server (mlx_lm.server's), every request checked before it reaches the model"),
    Command("info", "info:cmd_info", "info:info_parser", "MODEL", "what a converted model is: "
            "architecture, experts, quantization, sizes, source, when it was converted"),
    Command("verify", "verify:cmd_verify", "verify:verify_parser", "MODEL",
            "check every file and every expert record's checksum"),
    Command("list", "list_models:cmd_list", "list_models:list_parser", "[DIR]", "the converted "
            "models under a directory: size, architecture, floor", model=False, loads_model=False),
    Command("rm", "remove:cmd_rm", "remove:rm_parser", "MODEL|--demo [--yes]", "delete a converted "
            "model (nothing else), or the demo's cache (--demo)", model=False, loads_model=False),
)


def subcommands() -> dict:
    """The commands typed after deltafin-run, by name (the rest is the default path)."""
    return {c.name: c for c in COMMANDS if " " not in c.name}


def demo_help() -> str:
    return ("build a small synthetic K3-layout model and run it streaming; with a command "
            f"({', '.join(n for n, c in subcommands().items() if c.model)}) it is the MODEL, "
            "with the demo's budget where the command takes --budget")


def usage_and_epilog() -> tuple:
    """`deltafin-run --help`'s usage lines and command list."""
    demo = ("--demo [PROMPT]", demo_help())
    usage = "\n       ".join([f"deltafin-run {c.name} {c.args}" for c in COMMANDS]
                             + [f"deltafin-run {demo[0]} [options]"])
    listed = [textwrap.fill(text, 88, initial_indent=f"  {name:<18}", subsequent_indent=" " * 20,
                            break_on_hyphens=False)
              for name, text in [(c.name, c.help) for c in COMMANDS] + [demo]]
    return usage, "\n".join(["commands:"] + listed) + """

'deltafin-run COMMAND --help' shows a command's options. MODEL is a directory
written by deltafin-convert (convert a Hugging Face checkpoint with it first)."""


def run_parser():
    usage, epilog = usage_and_epilog()
    p = Parser(prog="deltafin-run", usage=usage, epilog=epilog,
               description="Run a Deltafin model: MoE experts stream from disk, the output is\n"
               "identical to running it fully in memory. Try 'deltafin-run --demo' first.")
    p.add_argument("model", nargs="?", help="a directory written by deltafin-convert")
    p.add_argument("prompt", nargs="?", help="the prompt ('-' reads it from stdin)")
    add_max_tokens(p, None, "tokens to generate (default: 256; 64 with --demo)")
    add_sampling_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--top-logprobs", type=request_field("top_logprobs", int), default=0, metavar="K",
                   help="with --json: the K likeliest tokens at each generated position, as "
                   "[id, logprob] pairs best first")
    p.add_argument("--chat", action="store_true", help="interactive chat")
    p.add_argument("--session", metavar="FILE", default=None,
                   help="chat: save the conversation and the model's cache to FILE after "
                   "each turn, restore it at start (.safetensors is added if missing) (default: none)")
    p.add_argument("--system", metavar="TEXT", default=None, help="a system message (default: none)")
    p.add_argument("--thinking-effort", choices=("low", "high", "max"), default=None,
                   help="K3's thinking effort (default: the model's, max)")
    p.add_argument("--context", type=positive, default=None, metavar="N",
                   help="tokens of KV cache/state to reserve (default: prompt + max tokens, "
                   "rounded up; 4096 in chat)")
    p.add_argument("--demo", action="store_true", help=demo_help())
    p.add_argument("--demo-dir", default=None,
                   help="where the demo model lives (default: ~/.cache/deltafin/demo)")
    p.add_argument("--trace-routing", metavar="FILE", default=None,
                   help="write each token's routed experts as JSONL, for python -m bench.studies.simulate_cache "
                   "(default: no trace)")
    add_load_options(p)
    add_version(p)
    return p


def refuse_ignored_options(args):
    """An option that would do nothing in the mode asked for is refused, not ignored
    (and -n gets the default of the mode)."""
    if args.demo and args.model is not None:
        if args.prompt is not None:
            raise UsageError("--demo runs its own model: give it only a prompt "
                             "(deltafin-run --demo \"PROMPT\")")
        args.model, args.prompt = None, args.model  # `--demo PROMPT`: the one positional
    if args.demo_dir and not args.demo:
        raise UsageError("--demo-dir only applies with --demo")
    if args.chat:
        if args.prompt is not None:
            raise UsageError("--chat reads each turn from the terminal: drop the prompt argument")
        for flag, given, why in (
                ("--json", args.json, "a chat streams its replies as text"),
                ("--trace-routing", args.trace_routing, "trace a one-shot run instead"),
                ("--raw", args.raw, "a chat needs the model's chat template")):
            if given:
                raise UsageError(f"{flag} does not work with --chat ({why})")
    else:
        if args.session is not None:
            raise UsageError("--session only applies with --chat (a one-shot run keeps no "
                             "conversation to save)")
        for flag, given in (("--no-think", args.no_think), ("--system", args.system),
                            ("--thinking-effort", args.thinking_effort)):
            if args.raw and given:
                raise UsageError(f"{flag} goes into the chat template, which --raw leaves out")
    if args.no_think and args.thinking_effort:
        raise UsageError("--thinking-effort sets how long the model thinks and --no-think "
                         "turns thinking off: give one of them")
    if args.top_logprobs and not args.json:
        raise UsageError("--top-logprobs needs --json (the distributions go in its object)")
    if args.max_tokens is None:
        args.max_tokens = 64 if args.demo else 256


def run_default(argv) -> int:
    """`MODEL PROMPT`, `MODEL --chat` or `--demo [PROMPT]`."""
    # intermixed: `MODEL --stop X PROMPT` fills both positionals
    args = run_parser().parse_intermixed_args(argv)
    refuse_ignored_options(args)
    model_dir = None
    if args.demo:  # the demo's model, then an ordinary run or chat of it
        model_dir = command("demo:demo_model")(args)
    elif args.model is None:
        raise UsageError("no model given (try 'deltafin-run --demo', or see --help)")
    mode = next(c for c in COMMANDS if c.name == ("MODEL --chat" if args.chat else "MODEL PROMPT"))
    return command(mode.run)(args, model_dir)


def command(target: str):
    """The function "module:function" names (a module of cli/), imported now."""
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(f"deltafin_mlx.cli.{module}"), function)


@quiet_broken_pipe
def main(argv=None):
    own_process = argv is None  # the console script: this process is the command
    try:
        return _main(argv)
    finally:
        if own_process and threading.current_thread() is threading.main_thread():
            # The command is done: a Ctrl-C now would only break the interpreter's
            # exit (reader threads joining) with a signal instead of the status.
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    return guarded("deltafin-run", lambda: dispatch(argv), debug="--debug" in argv)


def dispatch(argv) -> int:
    sub = subcommands().get(argv[0]) if argv else None
    asks_help = any(a in ("-h", "--help", "--version") for a in argv)
    if (sub is None or sub.loads_model) and not asks_help:
        from deltafin_mlx.model.shard import quiet_other_ranks

        quiet_other_ranks()  # under mlx.launch: one output, from rank 0
    if sub is None:
        return run_default(argv)
    rest = argv[1:]
    if "--demo" in rest and sub.model:  # `deltafin-run plan --demo`: the demo's model is MODEL
        rest = command("demo:demo_argv")(rest, command(sub.parser)())
    return command(sub.run)(rest)


if __name__ == "__main__":
    sys.exit(main())
