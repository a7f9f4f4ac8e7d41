"""`deltafin-run perplexity MODEL FILE`: the perplexity of a text file in windows,
as llama-perplexity and mlx_lm.perplexity measure it, and the KL divergence from a
reference run (deltafin_mlx/jobs/perplexity.py)."""

import json
import os
import sys

from deltafin_mlx.cli.options import Parser, add_load_options, load_model, positive
from deltafin_mlx.engine.runtime import runtime


def perplexity_parser():
    p = Parser(prog="deltafin-run perplexity", description="The perplexity of a text file, "
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
                   "mean/median/p99 KL and top-1 agreement")
    p.add_argument("--kl-top-k", type=positive, default=None, metavar="K",
                   help="with --kl-divergence-base: the K likeliest tokens kept per position "
                   "(default: 32)")
    p.add_argument("--pass-tokens", type=positive, default=None, metavar="N",
                   help="at most N tokens per pass (default: what the memory plan allows)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress line on a terminal")
    add_load_options(p)
    return p


def cmd_perplexity(argv) -> int:
    from deltafin_mlx.errors import UsageError
    from deltafin_mlx.jobs.perplexity import (PerplexityOptions, Windows,
                                              check_reference_output, perplexity,
                                              read_reference, read_text, reference_windows,
                                              summary_lines)

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
                             kl_reference=args.kl_divergence, top_k=args.kl_top_k or 32)
    windows.check()
    model, tokenizer = load_model(args, context=windows.context)  # not a run's 4096
    try:
        summary = perplexity(model, tokenizer, text, opts,
                             show_progress=sys.stderr.isatty() and not args.no_progress)
    finally:
        runtime(model).close()
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "passes"}))
    for line in summary_lines(summary):
        print(f"[deltafin] {line}", file=sys.stderr)
    return 0
