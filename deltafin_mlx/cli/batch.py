"""`deltafin-run batch MODEL IN.jsonl -o OUT.jsonl`: every prompt of a JSONL file,
decoded together; rerunning the same command resumes (deltafin_mlx/batch.py)."""

import sys

from deltafin_mlx.cli.options import (Parser, add_load_options, add_sampling_options, count,
                                      load_model, positive, positive_or_auto)

from deltafin_mlx.engine.runtime import runtime


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
    p.add_argument("--top-logprobs", type=count, default=0, metavar="K",
                   help="the K likeliest tokens at each generated position, as [id, logprob] "
                   "pairs best first")
    p.add_argument("--no-progress", action="store_true", help="no progress line on a terminal")
    add_load_options(p)
    return p


def cmd_batch(argv) -> int:
    from deltafin_mlx.batch import read_job, run_job, summary_line

    args = batch_parser().parse_args(argv)
    opts = batch_options(args)
    # "auto" reserves state for no more sequences than there are requests left.
    _, todo = read_job(args.input, args.output)
    model, tokenizer = load_model(args, context=args.context, sequences=args.batch_size,
                                  max_sequences=max(1, len(todo)))
    opts.batch_size = runtime(model).plan.sequences
    summary = run_job(model, tokenizer, args.input, args.output, opts,
                      show_progress=False if args.no_progress else None)
    print(f"[deltafin] {summary_line(summary)}", file=sys.stderr)
    runtime(model).close()
    return 0


def batch_options(args):
    from deltafin_mlx.batch import BatchOptions

    return BatchOptions(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p,
                        top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop,
                        raw=args.raw, thinking=not args.no_think, context=args.context,
                        logprobs=args.logprobs, top_logprobs=args.top_logprobs)
