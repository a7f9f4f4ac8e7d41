"""`deltafin-run list [DIR]`: the converted models under a directory, each with
its size on disk, architecture, quantization and floor budget, in aligned columns
(like `ollama list`)."""

import json

from deltafin_mlx.cli.options import Parser, positive


def list_parser():
    p = Parser(prog="deltafin-run list", description="List the converted models under a "
               "directory: size on disk, architecture, the smallest budget each runs in.")
    p.add_argument("dir", nargs="?", default=None,
                   help="where to look (4 levels down); without it, here and the demo's model")
    p.add_argument("--context", type=positive, default=4096, help="the context the floor is for")
    p.add_argument("--json", action="store_true", help="one JSON object per model, a line each")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def cmd_list(argv) -> int:
    from deltafin_mlx.errors import DeltafinError
    from deltafin_mlx.units import human_bytes

    args = list_parser().parse_args(argv)
    rows = []
    for path in model_dirs(args.dir):
        try:
            row = model_row(path, args.context)
        except DeltafinError as e:  # one damaged model does not hide the others
            row = {"model": str(path), "error": str(e)}
        if args.json:
            print(json.dumps(row))
        rows.append(row)
    if args.json:
        return 0
    if not rows:
        print(f"no converted models under {args.dir or '.'}")
        return 0
    table = [("MODEL", "SIZE", "ARCHITECTURE", "QUANTIZATION", f"FLOOR ({args.context} tokens)")]
    for row in rows:
        if "error" in row:
            table.append((row["model"], "-", "unusable: " + row["error"]))
        else:
            table.append((row["model"], human_bytes(row["bytes"]),
                          row["architecture"],
                          row["quantization"], human_bytes(row["floor_bytes"])))
    widths = [max(len(r[i]) for r in table if i < len(r) - 1) for i in range(4)]
    for r in table:  # aligned columns; an unusable model's reason runs to the end
        print("  ".join([c.ljust(w) for c, w in zip(r[:-1], widths)] + [r[-1]]).rstrip())
    return 0


def model_dirs(where):
    """The model directories under `where`; with no `where`, those under the
    working directory and the demo's model (`deltafin-run --demo` keeps it in the
    cache, where no one would look)."""
    from deltafin_mlx.format.catalog import demo_root, find_model_dirs
    from deltafin_mlx.format.manifest import MANIFEST_NAME

    found = list(find_model_dirs(where or "."))
    demo = demo_root() / "model"
    if where is None and (demo / MANIFEST_NAME).is_file() and \
            demo.resolve() not in {p.resolve() for p in found}:
        found.append(demo)
    return found


def model_row(path, context: int) -> dict:
    """What `list` shows of the model in `path`. Its floor is planned from the
    manifest, which needs MLX and mlx-lm's model code: imported here, so that a
    directory holding no model (and `list --help`) loads neither."""
    from deltafin_mlx.format.catalog import dir_bytes
    from deltafin_mlx.format.links import check_linked_sources
    from deltafin_mlx.format.model_dir import open_model_dir
    from deltafin_mlx.model.quantization import quantization_by_part, quantization_summary
    from deltafin_mlx.plan.floor import floor_bytes
    from deltafin_mlx.format.dtypes import compute_dtype

    model_dir = open_model_dir(path)
    m = model_dir.manifest
    if m.linked:  # experts read from a source that may have gone since (rm --demo)
        check_linked_sources(m.linked)
    act = compute_dtype("auto", m.dtype)
    return {"model": str(path), "bytes": dir_bytes(path), "architecture": m.model_type,
            "quantization": quantization_summary(quantization_by_part(model_dir.config, m)),
            "floor_bytes": floor_bytes(model_dir, act, context)}
