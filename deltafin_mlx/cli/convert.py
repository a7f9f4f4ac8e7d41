"""`deltafin-convert SRC OUT [options]`."""

import errno
import signal
import sys
import textwrap
import time
from pathlib import Path

from deltafin_mlx.cli.common import (HelpFormatter, add_version, first_line, guarded,
                                     interrupts_in_finalizers_reach_main, quiet_broken_pipe)
from deltafin_mlx.cli.options import Parser, expert_bits
from deltafin_mlx.errors import ConvertError, DeltafinError
from deltafin_mlx.format.manifest import MANIFEST_NAME, PARTIAL_NAME
from deltafin_mlx.model.config import SUPPORTED_TYPES
from deltafin_mlx.model.quantization import BITS, EXPERT_BITS, GROUP_SIZES, describe_experts
from deltafin_mlx.units import human_bytes, parse_size


def build_parser():
    p = Parser(  # a usage error is one line, as deltafin-run's are
        prog="deltafin-convert",
        description="Rewrite a Hugging Face MoE checkpoint into Deltafin's streaming format.\n"
        + textwrap.fill("Supported (config.json's model_type, each tested against mlx-lm's "
                        "tokens): " + ", ".join(SUPPORTED_TYPES) + ".", 80),
        epilog="Rerun the same command to resume an interrupted conversion; rerunning a\n"
        "finished one does nothing. Then: deltafin-run OUT \"PROMPT\".",
        formatter_class=HelpFormatter,
    )
    p.add_argument("src", help="local Hugging Face model directory, or a hub repo id")
    p.add_argument("out", help="output directory")
    p.add_argument("--bits", type=int, default=4, choices=BITS, help="trunk quantization bits")
    p.add_argument("--group-size", type=int, default=64, choices=GROUP_SIZES,
                   help="trunk quantization group size")
    p.add_argument("--no-trunk-quant", action="store_true",
                   help="keep the trunk (non-expert weights) unquantized")
    p.add_argument("--expert-bits", type=expert_bits, default=4,
                   metavar="{" + ",".join(map(str, EXPERT_BITS)) + "}",
                   help="bits for bf16/fp16 experts, or float to keep them in their float "
                        "dtype, byte for byte (K3's MXFP4 experts are kept as they are)")
    p.add_argument("--expert-group-size", type=int, default=64, choices=GROUP_SIZES,
                   help="group size for bf16/fp16 experts")
    p.add_argument("--ranks", type=int, default=1,
                   help="split each expert record into this many rank slices, so that each "
                        "of N ranks (N dividing it) reads only its slice (docs/FORMAT.md)")
    p.add_argument("--link-experts", action="store_true",
                   help="write the trunk only and read each routed expert where it lies in "
                        "SRC's safetensors (experts carried over as they are, e.g. Kimi K3's "
                        "MXFP4; SRC must then stay where it is, unchanged)")
    p.add_argument("--scratch-limit", nargs="?", const="auto", default=None, metavar="SIZE",
                   help="for a hub id: download only the shards the next layers need and "
                        "delete each once converted, so at most SIZE (e.g. 40GB) of shards is "
                        "on disk beside the output; without SIZE (or auto): what is free beyond "
                        "the output (default: off, the whole snapshot is downloaded first)")
    p.add_argument("--revision", default=None,
                   help="for a hub id: the branch, tag or commit to convert (default: main)")
    p.add_argument("--force", action="store_true",
                   help="replace the Deltafin model or unfinished conversion in OUT (a directory "
                        "that holds neither is never written into)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no notes")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    add_version(p)
    return p


@quiet_broken_pipe
def main(argv=None):
    handler = signal.getsignal(signal.SIGINT)
    given = list(sys.argv[1:] if argv is None else argv)
    try:
        return guarded("deltafin-convert", lambda: _main(given), debug="--debug" in given)
    finally:
        if argv is not None:  # called in a process that goes on: Ctrl-C works again
            signal.signal(signal.SIGINT, handler)
        else:  # the command is done: a Ctrl-C now could only break the interpreter's exit
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _main(argv):
    args = build_parser().parse_args(argv)
    # MLX and the model code import here (seconds), under guarded's Ctrl-C rule, and
    # not for --help or --version.
    from deltafin_mlx.convert.convert import ConvertOptions, convert

    out = Path(args.out).expanduser()
    finished_before = (not args.force and (out / MANIFEST_NAME).exists()
                       and not (out / PARTIAL_NAME).exists())
    try:
        limit = (None if args.scratch_limit in (None, "auto") else parse_size(args.scratch_limit))
    except ValueError as e:
        print(f"deltafin-convert: error: --scratch-limit {args.scratch_limit}: {e}",
              file=sys.stderr)
        return 1
    options = ConvertOptions(bits=None if args.no_trunk_quant else args.bits,
                             group_size=args.group_size,
                             expert_bits=args.expert_bits,
                             expert_group_size=args.expert_group_size,
                             ranks=args.ranks,
                             link_experts=args.link_experts,
                             force=args.force,
                             progress=not args.quiet,
                             revision=args.revision,
                             scratch=args.scratch_limit is not None,
                             scratch_limit=limit)
    started = time.time()
    try:
        with interrupts_in_finalizers_reach_main():
            manifest = convert(args.src, args.out, options)
            # done: a late Ctrl-C changes nothing (ignored before the block's end, so
            # none can land in a finalizer outside it)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while reporting
        # A Ctrl-C after the manifest was written came too late to stop anything:
        # the conversion finished, and says so as any finished one does.
        manifest = finished_after_interrupt(args.out, started)
        if manifest is None:
            print("\ndeltafin-convert: interrupted; rerun the same command to resume",
                  file=sys.stderr)
            return 130
    except OSError as e:
        if e.errno == errno.ENOSPC and not e.filename:
            e.filename = args.out  # guarded's line names what filled up
        raise
    except DeltafinError:
        raise
    except Exception as e:  # a source we did not foresee: still one line, naming it
        if args.debug:
            raise
        raise ConvertError(f"{args.src}: cannot convert ({type(e).__name__}: "
                           f"{first_line(e)[:300]}) (rerun with --debug for details)") from e
    if finished_before:  # convert() refuses a finished OUT of another conversion
        print(f"{args.out}: already holds this conversion of {args.src} (same source and "
              "options); nothing to do", file=sys.stderr)
        return 0
    size = sum(manifest.files.values())
    experts = describe_experts(manifest.quantization["experts"],
                               manifest.source.get("experts_from", manifest.dtype)) + (
        " in the first MoE layer, each layer as mlx-lm saved it" if manifest.mixed else "")
    print(f"converted {args.src} -> {args.out} ({human_bytes(size)}, "
          f"{len(manifest.moe_layers)} expert banks); {experts}")
    return 0


def finished_after_interrupt(out, started: float):
    """The manifest, if the interrupted run had already written a valid one (the
    conversion is complete; only removing the partial file may be left)."""
    from deltafin_mlx.format.manifest import read_manifest

    try:
        if (Path(out) / MANIFEST_NAME).stat().st_mtime < started - 1:
            return None  # a model that was there before this run
        manifest = read_manifest(out)
    except Exception:
        return None
    (Path(out) / PARTIAL_NAME).unlink(missing_ok=True)
    return manifest


if __name__ == "__main__":
    sys.exit(main())
