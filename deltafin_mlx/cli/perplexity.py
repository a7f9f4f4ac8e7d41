"""`deltafin-run perplexity MODEL FILE`: the perplexity of a text file in windows,
as llama-perplexity and mlx_lm.perplexity measure it, and the KL divergence from a
reference run (deltafin_mlx/jobs/perplexity.py)."""

import json
import os
import sys

from deltafin_mlx.cli.options import Parser, add_load_options, load_model, positive
from deltafin_mlx.engine.runtime import runtime


class PerplexityParser(Parser):
    """Parser, but --kl-divergence without REF says what REF is."""

    def error(self, message):
        if message.startswith("argument --kl-divergence: expected one argument"):
            message = ("--kl-divergence needs REF, the reference a run of the base model "
                       "wrote with --kl-divergence-base REF")
        super().error(message)


def perplexity_parser():
    p = PerplexityParser(
        prog="deltafin-run perplexity", description="The perplexity of a text file, "
        "in windows of -c tokens scored many per sweep over the experts (llama-"
        "perplexity's windows; --stride as its --ppl-stride, and --stride C as "
        "mlx_lm.perplexity); with --kl-divergence-base / --kl-divergence, the KL "
        "divergence of this model's next-token distributions from a reference run's.")
    p.add_argument("model", help="a directory written by deltafin-convert")
    p.add_argument("file", help="a UTF-8 text file")
    p.add_argument("-c", "--context", type=positive, default=None, metavar="N",
                   help="tokens per window (default: 512; with --kl-divergence, the "
                   "reference's)")
    p.add_argument("--stride", type=positive, default=None, metavar="S",
                   help="a window every S tokens, each scoring its last S (default: windows "
                   "side by side, each scoring its second half)")
    p.add_argument("--chunks", type=positive, default=None, metavar="N",
                   help="score the first N windows only (default: all)")
    p.add_argument("--kl-divergence-base", metavar="REF", default=None,
                   help="write this run's next-token distributions (top K and the tail's "
                   "mass at each scored position) to REF, a safetensors file: a new file or "
                   "an earlier reference")
    p.add_argument("--kl-divergence", metavar="REF", default=None,
                   help="compare this run's distributions with REF's (written by "
                   "--kl-divergence-base, with another conversion of the same model): "
                   "llama-perplexity's KL, Δp, same-top and perplexity-ratio statistics")
    p.add_argument("--kl-top-k", type=positive, default=None, metavar="K",
                   help="with --kl-divergence-base: the K likeliest tokens kept per position "
                   "(default: 32; the vocabulary's size or more: all of it, for the exact KL)")
    p.add_argument("-o", "--output", metavar="OUT", default=None,
                   help="keep each window's scores in OUT (JSONL) as its pass finishes: a "
                   "rerun of the same command (after a Ctrl-C) scores only the windows "
                   "OUT lacks")
    p.add_argument("--pass-tokens", type=positive, default=None, metavar="N",
                   help="at most N tokens per pass (default: what the memory plan allows)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress (on a terminal "
                   "one line redrawn, elsewhere a line per window), each with the running "
                   "perplexity")
    add_load_options(p)
    return p


def cmd_perplexity(argv) -> int:
    from deltafin_mlx.errors import UsageError
    from deltafin_mlx.jobs.job_options import check_options
    from deltafin_mlx.jobs.kl_reference import (check_reference_output, read_reference,
                                                 reference_windows)
    from deltafin_mlx.jobs.perplexity import Interrupted, PerplexityOptions, perplexity, read_text
    from deltafin_mlx.jobs.text_windows import Windows
    from deltafin_mlx.jobs.results_file import STDOUT, check_not_input, check_regular

    args = perplexity_parser().parse_args(argv)
    text = read_text(args.file)  # before the model loads, not after
    if args.kl_divergence_base:
        check_reference_output(args.kl_divergence_base, args.file,
                               args.model if os.path.isdir(args.model) else None)
    windows, chunks = Windows(args.context or 512, args.stride), args.chunks
    if args.kl_top_k is not None and not args.kl_divergence_base:
        raise UsageError("--kl-top-k is what --kl-divergence-base keeps: it goes with it")
    if args.kl_divergence:  # a bad reference is refused before the model loads
        windows, chunks = reference_windows(read_reference(args.kl_divergence),
                                            args.kl_divergence, args.context, args.stride,
                                            args.chunks)
    opts = PerplexityOptions(windows=windows, chunks=chunks,
                             max_pass_tokens=args.pass_tokens,
                             kl_base=args.kl_divergence_base,
                             kl_reference=args.kl_divergence, top_k=args.kl_top_k or 32,
                             output=args.output, activation_dtype=args.activation_dtype)
    windows.check()
    if args.output == STDOUT:
        raise UsageError("-o -: the windows' scores go to a file a rerun resumes from; "
                         "for the summary on stdout, use --json")
    if args.output:
        check_regular(args.output, "output", missing_ok=True)
        for other in (args.file, args.kl_divergence):
            if other:
                check_not_input(other, args.output)
        if args.kl_divergence_base and \
                os.path.realpath(args.kl_divergence_base) == os.path.realpath(args.output):
            raise UsageError("-o and --kl-divergence-base name one file: the windows' scores "
                             "and the reference go to two")
        if os.path.exists(args.output) and os.path.getsize(args.output) > 0:
            # another run's output is refused before the model loads (perplexity
            # checks again under OUT's lock, and records a run's once its lines read)
            check_options(args.output, opts.recorded(text), started=True, record=False)
    model, tokenizer = load_model(args, context=windows.context)  # not a run's 4096
    tty = sys.stderr.isatty()
    try:
        summary = perplexity(model, tokenizer, text, opts, show_progress=not args.no_progress,
                             progress_lines=not tty)
    except Interrupted as e:
        report(e.summary, args.json)
        print("[deltafin] " + (f"{args.output} keeps the windows scored: rerun the same "
                               "command to resume" if args.output else "nothing kept: with "
                               "-o OUT each window's scores are kept and a rerun resumes"),
              file=sys.stderr)
        raise
    finally:
        runtime(model).close()
    report(summary, args.json)
    return 0


def report(summary: dict, as_json: bool):
    """The summary (of every window, or of those scored before a Ctrl-C)."""
    from deltafin_mlx.jobs.kl_statistics import coverage_warning
    from deltafin_mlx.jobs.perplexity import summary_lines

    if as_json:
        print(json.dumps({k: v for k, v in summary.items() if k != "passes"}))
    warning = coverage_warning(summary)
    for line in summary_lines(summary) + ([warning] if warning else []):
        print(f"[deltafin] {line}", file=sys.stderr)
