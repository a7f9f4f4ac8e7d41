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
        from deltafin_mlx.cli.mlx_lm_names import mlx_lm_hint

        hint = mlx_lm_hint(self.prog, message)
        self.exit(2, f"{self.prog}: error: {message}{hint} (see {self.prog} --help)\n")


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


def expert_bits(text: str):
    """--expert-bits (convert, plan): a bit width, or "float" to keep float experts."""
    from deltafin_mlx.model.quantization import EXPERT_BITS, KEEP_FLOAT

    if text != KEEP_FLOAT and int(text if text.isdigit() else -1) not in EXPERT_BITS:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(map(str, EXPERT_BITS))})")
    return text if text == KEEP_FLOAT else int(text)


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
    """-n: one rule for run, chat, bench and batch, a request's max_tokens
    (generation/request.py): at least 1 token (a run that generates nothing has
    nothing to show; mlx-lm's -n -1 "until the context ends" is the default
    context's job here)."""
    p.add_argument("-n", "--max-tokens", type=request_field("max_tokens", int), default=default,
                   metavar="N", help=f"{what}, 1 or more")


def request_field(name, parse=float):
    """An option that sets a request's field `name`, checked by the one request
    rule (generation/request.py), so the flag gets the verdict and the message a
    batch line or a serve body with the same value gets."""
    def check(text):
        from deltafin_mlx.errors import RequestError
        from deltafin_mlx.generation.request import GenerationRequest

        try:
            value = parse(text)
        except ValueError:
            kind = "an integer" if parse is int else "a number"
            raise argparse.ArgumentTypeError(f"{name}: must be {kind}, not {text!r}") from None
        try:
            GenerationRequest.from_flags({name: [value] if name == "stop" else value})
        except RequestError as e:
            raise argparse.ArgumentTypeError(str(e).replace("stop[0]", "stop")) from None
        return value

    check.__name__ = name  # argparse names the type in some messages
    return check


def check_request_flags(args, model=None, limits=None):
    """The sampling options together (--stop's count), and, given the loaded
    `model` (or its `limits`), the bounds that need it (--top-k below the
    vocabulary, the penalty context within the planned one); a UsageError names
    the flag and the field."""
    from deltafin_mlx.errors import RequestError, UsageError
    from deltafin_mlx.generation.request import GenerationRequest

    flags = {"stop": "--stop", "top_k": "--top-k", "repetition_context_size": "--penalty-context"}
    try:
        req = GenerationRequest.from_flags({"stop": args.stop, "top_k": args.top_k})
        if model is not None:
            from deltafin_mlx.generation.engine import model_limits

            limits = model_limits(model)
        if limits is not None:
            req.check_limits(limits)
            GenerationRequest.from_flags({"repetition_context_size": args.penalty_context}, limits)
    except RequestError as e:
        field = str(e).split(":", 1)[0].split("[", 1)[0]
        raise UsageError(f"{flags.get(field, field)}: {e}") from None


def add_activation_dtype(p):
    """LoadOptions' activation_dtype (format/dtypes.py's names): loading commands, plan."""
    from deltafin_mlx.format.dtypes import ACTIVATION_DTYPES

    p.add_argument("--activation-dtype", choices=ACTIVATION_DTYPES, default="auto",
                   help="what the model computes in: model (each weight's saved dtype, as "
                   "mlx-lm: its tokens), auto (float32 on a CPU: faster there) or a float")


def add_load_options(p):
    p.add_argument("--budget", default=None,
                   help="memory budget, e.g. 8GB (default: from available memory)")
    add_activation_dtype(p)
    p.add_argument("--reader-threads", type=int, default=1, help="background read threads")
    p.add_argument("--no-lookahead", action="store_true", help="no speculative expert reads")
    p.add_argument("--verify", action="store_true", help="check expert checksums on read")
    p.add_argument("--read-mode", choices=("direct", "mmap"), default="direct",
                   help="how experts are read: O_DIRECT (F_NOCACHE on macOS), or mmap")
    p.add_argument("--no-warm-start", action="store_true",
                   help="start with an empty expert cache and save none at exit (default: "
                   "read back in the background what the last run of this model held)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def add_sampling_options(p):
    """Sampling, stops and prompt format: the same for a run, a chat and a batch,
    each checked as the request field it sets (generation/request.py), and mapped
    onto mlx-lm's sampler and logits processors by generation/sampling.py."""
    p.add_argument("--temp", type=request_field("temperature"), default=0.0,
                   help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=request_field("top_p"), default=1.0,
                   help="nucleus sampling threshold (0 or 1: off)")
    p.add_argument("--top-k", type=request_field("top_k", int), default=0,
                   help="sample from the k likeliest (0: all)")
    p.add_argument("--min-p", type=request_field("min_p"), default=0.0,
                   help="drop tokens below this share of the likeliest's probability (0: off)")
    p.add_argument("--repetition-penalty", type=request_field("repetition_penalty"),
                   default=None, metavar="X",
                   help="divide the logits of recent tokens by X, mlx-lm's (default: none)")
    p.add_argument("--presence-penalty", type=request_field("presence_penalty"), default=None,
                   metavar="X", help="subtract X from the logits of recent tokens (default: none)")
    p.add_argument("--frequency-penalty", type=request_field("frequency_penalty"),
                   default=None, metavar="X",
                   help="subtract X times each recent token's count from its logit (default: none)")
    p.add_argument("--penalty-context", type=request_field("repetition_context_size", int),
                   default=20, metavar="N", help="the recent tokens the penalties look at")
    p.add_argument("--seed", type=request_field("seed", int), default=None,
                   help="random seed (default: not fixed)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   type=request_field("stop", str),
                   help="stop before this text; repeat the option for several (default: none)")
    p.add_argument("--no-think", action="store_true", help="thinking off (K3 prompt format)")
    p.add_argument("--raw", action="store_true", help="no chat template: prompts as they are")


def defaults_of(args):
    """The engine's Defaults that a run's or a chat's options describe."""
    from deltafin_mlx.generation.engine import Defaults
    from deltafin_mlx.generation.sampling import Sampling

    n = args.penalty_context
    sampling = Sampling(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                        repetition_penalty=args.repetition_penalty,
                        presence_penalty=args.presence_penalty,
                        frequency_penalty=args.frequency_penalty, repetition_context=n,
                        presence_context=n, frequency_context=n)
    return Defaults(max_tokens=args.max_tokens, sampling=sampling, seed=args.seed,
                    stop=tuple(args.stop), thinking=not args.no_think,
                    top_logprobs=getattr(args, "top_logprobs", 0) or 0)


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

    flags = dict(memory_budget=args.budget, activation_dtype=args.activation_dtype,
                 reader_threads=args.reader_threads,
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
