"""What every `deltafin-run` command parses alike: the one-line usage error, the
option value checks, the loading and sampling options, and loading the model
those options describe."""

import argparse
import sys

from deltafin_mlx.cli.common import HelpFormatter


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


def add_max_tokens(p, default, what="tokens to generate"):
    """-n: one rule for run, chat, bench and batch: at least 1 token (a run that
    generates nothing has nothing to show; mlx-lm's -n -1 "until the context ends"
    is the default context's job here)."""
    p.add_argument("-n", "--max-tokens", type=positive, default=default, metavar="N",
                   help=f"{what}, 1 or more")


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
    p.add_argument("--no-warm-start", action="store_true",
                   help="start with an empty expert cache and save none at exit (default: "
                   "read back in the background what the last run of this model held)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def probability(text):
    p = float(text)
    if not 0 <= p <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], not {text}")
    return p


def finite(text):
    x = float(text)
    if x != x or x in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number, not {text}")
    return x


def add_sampling_options(p):
    """Sampling, stops and prompt format: the same for a run, a chat and a batch
    (deltafin_mlx/sampling.py maps them onto mlx-lm's sampler and logits processors)."""
    p.add_argument("--temp", type=temperature, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=top_p, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--top-k", type=count, default=0, help="sample from the k likeliest (0: all)")
    p.add_argument("--min-p", type=probability, default=0.0,
                   help="drop tokens below this share of the likeliest's probability (0: off)")
    p.add_argument("--repetition-penalty", type=finite, default=None, metavar="X",
                   help="divide the logits of recent tokens by X, mlx-lm's (default: none)")
    p.add_argument("--presence-penalty", type=finite, default=None, metavar="X",
                   help="subtract X from the logits of recent tokens (default: none)")
    p.add_argument("--frequency-penalty", type=finite, default=None, metavar="X",
                   help="subtract X times each recent token's count from its logit (default: none)")
    p.add_argument("--penalty-context", type=positive, default=20, metavar="N",
                   help="the recent tokens the penalties look at")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: not fixed)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop before this text; repeat the option for several (default: none)")
    p.add_argument("--no-think", action="store_true", help="thinking off (K3 prompt format)")
    p.add_argument("--raw", action="store_true", help="no chat template: prompts as they are")


def sampling_of(args):
    """The Sampling that add_sampling_options' options describe."""
    from deltafin_mlx.generation.sampling import Sampling

    return Sampling(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                    repetition_penalty=args.repetition_penalty,
                    presence_penalty=args.presence_penalty,
                    frequency_penalty=args.frequency_penalty, penalty_context=args.penalty_context)


def refuse_without_template(tokenizer, args):
    """Options that go into a chat template do nothing for a model without one
    (a run and a chat alike)."""
    from deltafin_mlx.errors import UsageError

    if getattr(tokenizer, "has_chat_template", False):
        return
    for flag, given in (("--system", args.system), ("--thinking-effort", args.thinking_effort),
                        ("--no-think", args.no_think)):
        if given:
            raise UsageError(f"{flag} goes into a chat template and this model has none "
                             "(its prompts are passed as they are)")


def load_options(args, **extra):
    """The LoadOptions that add_load_options' options describe (and --context where
    the command has one), with `extra` (LoadOptions fields) over them."""
    from deltafin_mlx.engine.load import LoadOptions

    flags = dict(memory_budget=args.budget, reader_threads=args.reader_threads,
                 lookahead=not args.no_lookahead, verify=args.verify, read_mode=args.read_mode,
                 warm_start=not args.no_warm_start, progress=sys.stderr.isatty())
    if getattr(args, "context", None) is not None:
        flags["context"] = args.context
    return LoadOptions.of(**{**flags, **extra})


def load_model(args, model_dir=None, **extra):
    """The model `args` names (or `model_dir`, already opened), loaded with
    `load_options(args, **extra)`."""
    from deltafin_mlx.engine.load import load

    return load(model_dir or args.model, options=load_options(args, **extra))
