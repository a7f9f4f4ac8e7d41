"""`deltafin-run score MODEL IN.jsonl -o OUT.jsonl`: teacher-forced log-probs of
every text of a JSONL file, many texts per sweep over the experts; rerunning the
same command resumes (deltafin_mlx/jobs/score.py)."""

import json
import os
import sys

from deltafin_mlx.cli.options import Parser, add_load_options, count, load_model, positive
from deltafin_mlx.engine.runtime import runtime


def score_parser():
    p = Parser(prog="deltafin-run score", description="Score every text of a JSONL file "
               "(teacher-forced log-probabilities; rerun the same command to resume). Lines: "
               '{"id": ..., "text": "..."}, {"id": ..., "prompt": "...", "completion": "..."} '
               'or {"id": ..., "messages": [...]} (the assistant turns are scored).')
    p.add_argument("model", help="a directory written by deltafin-convert")
    p.add_argument("input", help="JSONL texts ('-': stdin)")
    p.add_argument("-o", "--output", required=True,
                   help="JSONL results, or with --format safetensors the JSONL index of the "
                   "shards written beside it (appended)")
    p.add_argument("--top-logprobs", type=count, default=0, metavar="K",
                   help="the K most likely next tokens at each scored position")
    p.add_argument("--format", choices=("jsonl", "safetensors"), default="jsonl",
                   help="JSONL lines, or safetensors shards with a JSONL index (docs/FORMAT.md)")
    p.add_argument("--context", type=positive, default=4096, metavar="N",
                   help="tokens of KV cache/state the plan reserves (scoring passes use "
                   "that memory, since they keep no cache)")
    p.add_argument("--pass-tokens", type=positive, default=None, metavar="N",
                   help="at most N tokens per pass (default: what the memory plan allows)")
    p.add_argument("--no-think", action="store_true",
                   help="\"messages\": thinking off (K3 prompt format)")
    p.add_argument("--content-only", action="store_true",
                   help="\"messages\": score only the assistant turns' content tokens, not "
                   "the template's tokens around them")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress line on a terminal")
    add_load_options(p)
    return p


def cmd_score(argv) -> int:
    from deltafin_mlx.jobs.results_file import check_not_input, check_regular
    from deltafin_mlx.jobs.outcome import Outcome
    from deltafin_mlx.jobs.job_options import check_options
    from deltafin_mlx.jobs.score import ScoreOptions, run_job, summary_line

    args = score_parser().parse_args(argv)
    check_regular(args.input, "input")  # before the model loads, not after
    check_regular(args.output, "output", missing_ok=True)
    check_not_input(args.input, args.output)
    opts = ScoreOptions(top_logprobs=args.top_logprobs, thinking=not args.no_think,
                        format=args.format, max_pass_tokens=args.pass_tokens,
                        content_only=args.content_only, activation_dtype=args.activation_dtype)
    if os.path.exists(args.output) and os.path.getsize(args.output) > 0:
        # A resume with other options is refused before the model loads, not after
        # (run_job checks again, under OUT's lock, and records a job's once its lines read).
        check_options(args.output, opts.recorded(), started=True, record=False)
    outcome = Outcome("score")
    model, tokenizer = load_model(args)
    try:
        summary = run_job(model, tokenizer, args.input, args.output, opts,
                          show_progress=False if args.no_progress else None, outcome=outcome)
    finally:
        runtime(model).close()
    if args.json:
        print(json.dumps(summary))
    print(f"[deltafin] {summary_line(summary)}", file=sys.stderr)
    last = outcome.last_line(args.output, hint=" (for a text file: deltafin-run perplexity "
                             "MODEL FILE)")
    if last:
        print(f"deltafin-run: score: {last}", file=sys.stderr)
    return outcome.status


def export_parser():
    p = Parser(prog="deltafin-run export", description="score's JSONL results (scored with "
               "--top-logprobs K) as a parquet dataset in trainers' layout: one row per text in "
               "input order; input_ids, labels (-100 where not scored), teacher_topk_indices, "
               "teacher_topk_logprobs (row t predicts token t+1) and teacher_tail_logprob "
               "(docs/FORMAT.md). Needs pyarrow: pip install 'deltafin[distill]'.")
    p.add_argument("scores", help="the JSONL that deltafin-run score wrote (-o), or - for stdin")
    p.add_argument("-o", "--output", required=True,
                   help="the parquet file (an earlier export there is replaced)")
    return p


def cmd_export(argv) -> int:
    from deltafin_mlx.jobs.results_file import check_not_input, check_regular
    from deltafin_mlx.jobs.score_export import export_parquet
    from deltafin_mlx.units import count as counted

    args = export_parser().parse_args(argv)
    check_regular(args.scores, "input")
    check_regular(args.output, "output", missing_ok=True)
    check_not_input(args.scores, args.output)
    s = export_parquet(args.scores, args.output)
    print(f"[deltafin] {counted(s['texts'], 'text')} (top {s['top_k']} per position) written "
          f"to {args.output}; {counted(s['errors'], 'error line')} left out", file=sys.stderr)
    return 0
