"""`deltafin-run rm MODEL` / `rm --demo`: delete a converted model (only a
directory deltafin-convert wrote, nothing else: format/catalog.py), or the demo's
cache, after a confirmation or with --yes."""

import sys
from pathlib import Path

from deltafin_mlx.cli.options import Parser
from deltafin_mlx.errors import UsageError


def rm_parser():
    p = Parser(prog="deltafin-run rm", description="Delete a converted model directory "
               "(refused for anything deltafin-convert did not write), or the demo's cache.")
    p.add_argument("model", nargs="?", help="a directory written by deltafin-convert")
    p.add_argument("--demo", action="store_true",
                   help="remove the demo's model and synthetic checkpoint instead")
    p.add_argument("--demo-dir", default=None,
                   help="where the demo lives (default: ~/.cache/deltafin/demo)")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def confirm(what: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        raise UsageError(f"not removing {what} without confirmation: pass --yes")
    answer = input(f"remove {what}? [y/N] ").strip().lower()
    return answer in ("y", "yes")


def cmd_rm(argv) -> int:
    from deltafin_mlx.format.catalog import (check_removable, demo_root, dir_bytes,
                                             remove_model_dir)
    from deltafin_mlx.format.demo_marker import check_demo_files, remove_demo_files
    from deltafin_mlx.format.manifest import MANIFEST_NAME, is_hf_checkpoint
    from deltafin_mlx.units import human_bytes

    args = rm_parser().parse_args(argv)
    if args.demo == (args.model is not None):
        raise UsageError("give one MODEL directory, or --demo")
    if args.demo_dir and not args.demo:
        raise UsageError("--demo-dir only applies with --demo")
    if args.demo:
        root = demo_root(args.demo_dir)
        if not root.exists():
            print(f"no demo cache at {root}", file=sys.stderr)
            return 0
        check_demo_files(root)  # refuse what the demo did not write before asking
        if not confirm(f"the demo's cache {root} ({human_bytes(dir_bytes(root))})", args.yes):
            print("nothing removed", file=sys.stderr)
            return 1
        print(f"removed {root} ({human_bytes(remove_demo_files(root))} freed)", file=sys.stderr)
        return 0
    if is_hf_checkpoint(Path(args.model)) and \
            not (Path(args.model) / MANIFEST_NAME).exists():
        raise UsageError(f"{args.model}: a Hugging Face checkpoint, not a Deltafin model; rm "
                         "removes only what deltafin-convert wrote (delete a checkpoint "
                         "yourself)")
    check_removable(args.model)  # refuse a non-model (or a path through a link) before asking
    if not confirm(f"the model {args.model} ({human_bytes(dir_bytes(args.model))})", args.yes):
        print("nothing removed", file=sys.stderr)
        return 1
    freed = remove_model_dir(args.model)
    print(f"removed {args.model} ({human_bytes(freed)} freed)", file=sys.stderr)
    return 0
