"""`deltafin-run batch MODEL IN.jsonl -o OUT.jsonl`: every prompt of a JSONL file,
decoded together; rerunning the same command resumes (deltafin_mlx/jobs/batch.py)."""

import sys

from deltafin_mlx.cli.options import (Parser, add_load_options, add_max_tokens, add_sampling_options,
                                      check_request_flags, load_model, positive,
                                      positive_or_auto, request_field)

from deltafin_mlx.engine.runtime import runtime
from deltafin_mlx.jobs.job_options import activation_record


def batch_parser():
    p = Parser(prog="deltafin-run batch", description="Answer every prompt of a JSONL file "
               "(decoded together; rerun the same command to resume). Lines: "
               '{"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]} with any field '
               "a deltafin-run serve body takes (\"temp\" for \"temperature\"); or OpenAI "
               'Batch API lines ({"custom_id": ..., "url": ..., "body": {...}}), whose body '
               "means what it means at serve's endpoint of that url. Each result has the "
               '"text" and "thinking" that deltafin-run --json writes.')
    p.add_argument("model", help="a directory written by deltafin-convert")
    p.add_argument("input", help="JSONL requests ('-': stdin)")
    p.add_argument("-o", "--output", required=True, help="JSONL results (appended to; '-': stdout, without resume)")
    p.add_argument("--batch-size", type=positive_or_auto, default="auto", metavar="N|auto",
                   help="sequences decoded together (default: what the budget allows, at most 32 "
                   "and at most the requests left)")
    p.add_argument("--context", type=positive, default=4096,
                   help="longest prompt + reply of a request (planned per sequence); a "
                   "request's max_tokens is cut to fit, a prompt that leaves no room refused")
    add_max_tokens(p, 256, "tokens to generate per request")
    add_sampling_options(p)
    p.add_argument("--logprobs", action="store_true", help="each token's log-probability")
    p.add_argument("--top-logprobs", type=request_field("top_logprobs", int), default=0,
                   metavar="K",
                   help="the K likeliest tokens at each generated position, as [id, logprob] "
                   "pairs best first")
    p.add_argument("--no-progress", action="store_true", help="no progress line on a terminal")
    add_load_options(p)
    return p


def recorded_options(args) -> dict:
    """What a batch's results depend on, by flag: recorded beside its output and
    checked on resume (jobs/job_options.py). The budget, batch size and context
    change no request's tokens, only whether it fits."""
    return {"-n": args.max_tokens, "--temp": args.temp, "--top-p": args.top_p,
            "--top-k": args.top_k, "--min-p": args.min_p, "--seed": args.seed,
            "--stop": args.stop, "--raw": args.raw, "--no-think": args.no_think,
            "--logprobs": args.logprobs, "--top-logprobs": args.top_logprobs,
            "--repetition-penalty": args.repetition_penalty,
            "--presence-penalty": args.presence_penalty,
            "--frequency-penalty": args.frequency_penalty,
            "--penalty-context": args.penalty_context,
            **activation_record(args.activation_dtype)}


def cmd_batch(argv) -> int:
    from deltafin_mlx.jobs.batch import open_job, run_job, summary_line
    from deltafin_mlx.jobs.outcome import Outcome

    args = batch_parser().parse_args(argv)
    check_request_flags(args)
    opts = batch_options(args)
    # the output stays locked until the job ends
    job = open_job(args.input, args.output, recorded_options(args))
    outcome = Outcome("batch")
    try:
        if job.note:
            print(f"[batch] {job.note}", file=sys.stderr)
        if job.skipped:
            print(f"[batch] resuming: {job.skipped} of {len(job.requests)} done", file=sys.stderr)
        if not job.todo:  # nothing left: no model to load
            print(f"[batch] nothing to do: {args.output} answers every request", file=sys.stderr)
            return 0
        if sys.stderr.isatty() and not args.no_progress:
            print(f"[batch] loading {args.model} for {len(job.todo)} requests ...",
                  file=sys.stderr, flush=True)
        # "auto" reserves state for no more sequences than there are requests left.
        model, tokenizer = load_model(args, context=args.context, sequences=args.batch_size,
                                      max_sequences=max(1, len(job.todo)))
        check_request_flags(args, model)
        opts.batch_size = runtime(model).plan.sequences
        summary = run_job(model, tokenizer, job, opts,
                          show_progress=False if args.no_progress else None, outcome=outcome)
    except KeyboardInterrupt:
        again = ("rerun the same command to resume" if job.results.resumable
                 else "the results so far are on stdout")
        print(f"\ndeltafin-run: interrupted: {again}", file=sys.stderr)
        return 130
    finally:
        job.close()
    print(f"[deltafin] {summary_line(summary)}", file=sys.stderr)
    runtime(model).close()
    last = outcome.last_line(args.output)
    if last:
        print(f"deltafin-run: batch: {last}", file=sys.stderr)
    return outcome.status


def batch_options(args):
    from deltafin_mlx.jobs.batch import BatchOptions

    return BatchOptions(max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p,
                        top_k=args.top_k, min_p=args.min_p,
                        repetition_penalty=args.repetition_penalty,
                        presence_penalty=args.presence_penalty,
                        frequency_penalty=args.frequency_penalty,
                        penalty_context=args.penalty_context, seed=args.seed, stop=args.stop,
                        raw=args.raw, thinking=not args.no_think, context=args.context,
                        logprobs=args.logprobs, top_logprobs=args.top_logprobs)
