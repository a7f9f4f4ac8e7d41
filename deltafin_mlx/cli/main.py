"""`deltafin-run`: run, chat, plan, bench, describe and verify a Deltafin model,
run batch jobs, serve it, or try the demo (the commands are listed in COMMANDS).

This module only dispatches: a subcommand goes to its module's `cmd_*` (SUBCOMMANDS,
imported only when it runs); anything else is the default path, `MODEL PROMPT`,
`MODEL --chat` or `--demo` (MODES). Every failure is one line on stderr (cli/common.py's `guarded`) unless --debug is given.
"""

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
import threading  # noqa: E402

from deltafin_mlx.cli.common import add_version, guarded, quiet_broken_pipe  # noqa: E402
from deltafin_mlx.cli.options import (Parser, add_load_options, add_max_tokens,  # noqa: E402
                                      add_sampling_options, positive,
                                      request_field)
from deltafin_mlx.errors import UsageError  # noqa: E402

if _sigint is not None:  # imported: Ctrl-C is KeyboardInterrupt again, for guarded
    signal.signal(signal.SIGINT, _sigint)

USAGE = """deltafin-run MODEL PROMPT [options]
       deltafin-run MODEL --chat [options]
       deltafin-run plan MODEL|CONFIG.json|HUB_ID [options]
       deltafin-run bench MODEL [options]
       deltafin-run batch MODEL IN.jsonl -o OUT.jsonl [options]
       deltafin-run score MODEL IN.jsonl -o OUT.jsonl [options]
       deltafin-run perplexity MODEL FILE [options]
       deltafin-run serve MODEL [options]
       deltafin-run info MODEL
       deltafin-run verify MODEL
       deltafin-run list [DIR]
       deltafin-run rm MODEL|--demo [--yes]
       deltafin-run --demo [PROMPT] [options]"""

COMMANDS = """commands:
  MODEL PROMPT      generate from one prompt ('-' reads it from stdin)
  MODEL --chat      an interactive chat
  plan              the memory plan and a projected speed, without loading weights
                    (of a converted model, a source config.json or a hub id)
  bench             a short decode benchmark
  batch             answer every prompt of a JSONL file, decoded together (resumable)
  score             teacher-forced log-probs (and top-K) of every text of a JSONL file,
                    many texts per sweep over the experts (resumable)
  perplexity        perplexity of a text file in windows (llama-perplexity's), and the
                    KL divergence from a reference run (--kl-divergence-base/--kl-divergence)
  serve             an OpenAI-compatible HTTP server (mlx_lm.server's), every request
                    checked before it reaches the model
  info              what a converted model is: architecture, experts, quantization,
                    sizes, source, when it was converted
  verify            check every file and every expert record's checksum
  list              the converted models under a directory: size, architecture, floor
  rm                delete a converted model (nothing else), or the demo's cache (--demo)
  --demo            build a small synthetic K3-layout model and run it streaming; with
                    a command (plan, bench, batch, info, verify, serve) it is the MODEL

'deltafin-run COMMAND --help' shows a command's options. MODEL is a directory
written by deltafin-convert (convert a Hugging Face checkpoint with it first)."""

# Each takes the arguments after its name. A command's module is imported only when
# it runs (as mlx-lm's cli.py does): `--help`, `--version`, `list` and `rm` load
# neither MLX's models nor mlx-lm nor transformers.
SUBCOMMANDS = {
    "plan": "deltafin_mlx.cli.plan:cmd_plan",
    "bench": "deltafin_mlx.cli.bench:cmd_bench",
    "batch": "deltafin_mlx.cli.batch:cmd_batch",
    "score": "deltafin_mlx.cli.score:cmd_score",
    "perplexity": "deltafin_mlx.cli.perplexity:cmd_perplexity",
    "serve": "deltafin_mlx.cli.serve:cmd_serve",
    "info": "deltafin_mlx.cli.info:cmd_info",
    "verify": "deltafin_mlx.cli.verify:cmd_verify",
    "list": "deltafin_mlx.cli.list_models:cmd_list",
    "rm": "deltafin_mlx.cli.remove:cmd_rm",
}
# The default path's modes; each takes the parsed arguments (and the opened model
# directory, for the demo's).
MODES = {
    "run": "deltafin_mlx.cli.run:cmd_run",
    "chat": "deltafin_mlx.cli.chat:cmd_chat",
    "demo": "deltafin_mlx.cli.demo:demo_model",
    "demo_argv": "deltafin_mlx.cli.demo:demo_argv",
}
# Load no model, so never run under mlx.launch: their output is not a rank's.
NOT_DISTRIBUTED = {"plan", "list", "rm"}
# Take --demo themselves (rm --demo removes the demo's cache).
OWN_DEMO = {"rm"}


def run_parser():
    p = Parser(prog="deltafin-run", usage=USAGE, epilog=COMMANDS,
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
    p.add_argument("--demo", action="store_true",
                   help="build a small synthetic K3-layout model and run it streaming")
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
        model_dir = command(MODES["demo"])(args)
    elif args.model is None:
        raise UsageError("no model given (try 'deltafin-run --demo', or see --help)")
    return command(MODES["chat" if args.chat else "run"])(args, model_dir)


def command(target: str):
    """The function "module:function" names, its module imported now."""
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


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
    name = argv[0] if argv else None
    asks_help = any(a in ("-h", "--help", "--version") for a in argv)
    if name not in NOT_DISTRIBUTED and not asks_help:
        from deltafin_mlx.model.shard import quiet_other_ranks

        quiet_other_ranks()  # under mlx.launch: one output, from rank 0
    if name in SUBCOMMANDS:
        rest = argv[1:]
        if "--demo" in rest and name not in OWN_DEMO:  # `deltafin-run plan --demo`: the demo model is MODEL
            rest = command(MODES["demo_argv"])(name, rest)
        return command(SUBCOMMANDS[name])(rest)
    return run_default(argv)


if __name__ == "__main__":
    sys.exit(main())
