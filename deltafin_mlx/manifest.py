"""The manifest (`deltafin.json`): what a converted model directory holds.

See docs/FORMAT.md. Reading a manifest checks the format version and that every
file it lists exists with its recorded size, so damage is found at load time, not
in the middle of a generation.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

from .bank import FORMAT_VERSION

MANIFEST_NAME = "deltafin.json"
PARTIAL_NAME = "deltafin.partial.json"


class ModelError(ValueError):
    """A model directory that cannot be used; the message says why."""


@dataclass
class Manifest:
    path: Path  # the model directory
    model_type: str
    dtype: str
    num_layers: int
    quantization: dict
    trunk_files: Dict[str, str]
    tensors: Dict[str, dict]
    experts: dict
    tokenizer: dict
    files: Dict[str, int]
    source: dict = field(default_factory=dict)

    @property
    def moe_layers(self):
        return sorted(int(k) for k in self.experts["layers"])

    def bank_path(self, layer: int) -> Path:
        return self.path / self.experts["layers"][str(layer)]["bank"]

    def switch_path(self, layer: int) -> str:
        return self.experts["layers"][str(layer)]["switch_path"]

    @property
    def expert_bytes(self) -> int:
        return self.experts["record_size"]

    def trunk_bytes(self, key: str) -> int:
        return self.files[self.trunk_files[key]]

    def to_dict(self) -> dict:
        return {
            "format": "deltafin",
            "format_version": FORMAT_VERSION,
            "model_type": self.model_type,
            "source": self.source,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "num_layers": self.num_layers,
            "trunk_files": self.trunk_files,
            "tensors": self.tensors,
            "experts": self.experts,
            "tokenizer": self.tokenizer,
            "files": self.files,
        }

    def write(self):
        tmp = self.path / (MANIFEST_NAME + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path / MANIFEST_NAME)


def read_manifest(path, check_files: bool = True) -> Manifest:
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such model directory")
    if not path.is_dir():
        raise ModelError(f"{path}: not a directory")
    mpath = path / MANIFEST_NAME
    if not mpath.exists():
        if (path / PARTIAL_NAME).exists():
            raise ModelError(
                f"{path}: conversion not finished (rerun deltafin-convert to resume it)"
            )
        raise ModelError(f"{path}: not a Deltafin model (no {MANIFEST_NAME})")
    try:
        with open(mpath) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise ModelError(f"{mpath}: unreadable manifest ({e})") from None
    if not isinstance(d, dict) or d.get("format") != "deltafin":
        raise ModelError(f"{mpath}: not a Deltafin manifest")
    version = d.get("format_version")
    if version != FORMAT_VERSION:
        raise ModelError(
            f"{mpath}: format version {version!r} is not supported "
            f"(this Deltafin reads version {FORMAT_VERSION})"
        )
    try:
        m = Manifest(
            path=path,
            model_type=str(d["model_type"]),
            dtype=str(d["dtype"]),
            num_layers=int(d["num_layers"]),
            quantization=dict(d["quantization"]),
            trunk_files={str(k): str(v) for k, v in d["trunk_files"].items()},
            tensors=dict(d["tensors"]),
            experts=dict(d["experts"]),
            tokenizer=dict(d["tokenizer"]),
            files={str(k): int(v) for k, v in d["files"].items()},
            source=dict(d.get("source", {})),
        )
        for key in ("num_experts", "experts_per_token", "record_size"):
            if int(m.experts[key]) <= 0:
                raise ValueError(f"experts.{key} must be positive")
        for layer, entry in m.experts["layers"].items():
            int(layer), str(entry["bank"]), str(entry["switch_path"]), int(entry["header_size"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ModelError(f"{mpath}: corrupt manifest ({type(e).__name__}: {e})") from None
    for rel in m.files:
        if os.path.isabs(rel) or ".." in Path(rel).parts:
            raise ModelError(f"{mpath}: corrupt manifest (file path {rel!r} leaves the model)")
    if check_files:
        check_model_files(m)
    return m


def check_model_files(m: Manifest):
    for rel, size in m.files.items():
        p = m.path / rel
        try:
            actual = p.stat().st_size
        except OSError:
            raise ModelError(f"{p}: missing (the manifest lists it)") from None
        if actual != size:
            raise ModelError(
                f"{p}: {actual} bytes, the manifest says {size} (truncated or modified file)"
            )
