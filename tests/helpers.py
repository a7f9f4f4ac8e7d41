"""Helpers the tests share, imported by name (`from helpers import make_source`):
pytest puts tests/ on the import path (pyproject.toml), and tests/model/dist_worker.py,
which mlx.launch starts outside pytest, gets it through PYTHONPATH. Fixtures live in
conftest.py; what a test or a worker calls directly lives here."""

import errno
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_map_with_path
from mlx_lm.utils import load_model, quantize_model

from deltafin_mlx.testing.synthetic import make_checkpoint

# The installed commands (deltafin-run, deltafin-convert) beside the running python.
BIN = Path(sys.executable).parent

# Affine fixtures use widths that every group size divides, so mlx-lm quantizes
# exactly the modules Deltafin does.
FIXTURE_OVERRIDES = {
    "kimi_k3": {},
    "kimi_k2": {"moe_intermediate_size": 128},
    "qwen3_moe": {"moe_intermediate_size": 128},
    "mixtral": {"moe_intermediate_size": 128},
}


def make_source(path, arch, **overrides):
    return make_checkpoint(path, arch, seed=0, **{**FIXTURE_OVERRIDES[arch], **overrides})


def reference_model(src, trunk_bits=4, group_size=64, expert_bits=4, expert_group_size=64):
    """What `mlx_lm.convert -q` makes of `src`, loaded fully in memory at float32:
    load lazily, cast to the config dtype, quantize with the model's own predicate
    (and the expert settings for switch_mlp), exactly as mlx_lm.convert does."""
    model, config = load_model(Path(src), lazy=True)
    dtype = config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    cast = getattr(model, "cast_predicate", lambda _: True)
    dt = getattr(mx, dtype)
    model.update(
        tree_map_with_path(
            lambda k, v: v.astype(dt) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    own = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if "switch_mlp" in path:
            return {"group_size": expert_group_size, "bits": expert_bits, "mode": "affine"}
        if trunk_bits is None:
            return False
        return own(path, module) if own else True

    model, _ = quantize_model(
        model, config, group_size, trunk_bits or 4, quant_predicate=predicate
    )
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


@contextmanager
def small_filesystem(tmp_path: Path, size: str):
    """A tmpfs of `size` ("4m") of the test's own at tmp_path/fs, for disk-full cases
    (the test is skipped where mounting is not permitted)."""
    import pytest

    mnt = tmp_path / "fs"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(p.stderr or p.stdout).strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(fs: Path) -> Path:
    """Take every free byte of the filesystem `fs`; returns the filler file (delete
    it to free them)."""
    filler = fs / "filler"
    with open(filler, "ab", buffering=0) as f:
        for size in (1 << 20, 1 << 16, 4096, 1):
            block = b"\xee" * size
            while True:
                try:
                    if f.write(block) != size:
                        break
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    return filler
