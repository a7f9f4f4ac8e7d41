"""The source checkpoint: a Hugging Face model directory (or hub id), checked up front.

Every shard's safetensors header is parsed and checked against the file's size
before any conversion work starts, so a missing, truncated or corrupt shard is
reported in one line instead of failing half-way through.
"""

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Tuple

import mlx.core as mx

from deltafin_mlx.hub import hub_failure, looks_like_hub_id, quiet_hub
from deltafin_mlx.manifest import MANIFEST_NAME


class ConvertError(Exception):
    """A conversion that cannot proceed; the message is shown to the user as is."""


# safetensors dtype name -> (bytes per element, mlx dtype name)
SAFETENSORS_DTYPES = {
    "BF16": (2, "bfloat16"),
    "F16": (2, "float16"),
    "F32": (4, "float32"),
    "F64": (8, "float64"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "U16": (2, "uint16"),
    "I16": (2, "int16"),
    "U32": (4, "uint32"),
    "I32": (4, "int32"),
    "I64": (8, "int64"),
    "BOOL": (1, "bool"),
    "F8_E4M3": (1, "float8_e4m3"),
}

TOKENIZER_FILES = (
    "tiktoken.model",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
)


@dataclass
class TensorInfo:
    shard: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: Tuple[int, ...]


@dataclass
class Source:
    path: Path
    id: str
    config: dict
    tensors: Dict[str, TensorInfo]
    total_bytes: int
    fingerprint: str
    _open: Dict[str, dict] = field(default_factory=dict)

    def load(self, name: str) -> mx.array:
        """One tensor as a lazy MLX array (read from disk when evaluated)."""
        shard = self.tensors[name].shard
        if shard not in self._open:
            # Only one shard's lazy handles are kept: layers live in one shard each.
            self._open.clear()
            try:
                self._open[shard] = mx.load(str(self.path / shard))
            except Exception as e:
                raise ConvertError(f"{self.path / shard}: cannot read ({e})") from None
        return self._open[shard][name]

    def nbytes(self, name: str) -> int:
        t = self.tensors[name]
        n = SAFETENSORS_DTYPES[t.dtype][0]
        for s in t.shape:
            n *= s
        return n


def read_safetensors_header(path: Path) -> Dict[str, TensorInfo]:
    """Parse and check one shard's header against the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConvertError(f"{path}: truncated safetensors file ({size} bytes)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > min(size - 8, 1 << 28):
                raise ConvertError(f"{path}: corrupt safetensors header (length {hlen})")
            raw = f.read(hlen)
    except OSError as e:
        raise ConvertError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: corrupt safetensors header ({e})") from None
    data_start = 8 + hlen
    out = {}
    end_max = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = entry["dtype"]
            shape = tuple(int(s) for s in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ConvertError(f"{path}: corrupt safetensors header entry {name!r}") from None
        if dtype not in SAFETENSORS_DTYPES:
            raise ConvertError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        nbytes = SAFETENSORS_DTYPES[dtype][0]
        for s in shape:
            if s < 0:
                raise ConvertError(f"{path}: tensor {name} has a negative dimension")
            nbytes *= s
        if start < 0 or end - start != nbytes:
            raise ConvertError(
                f"{path}: tensor {name} spans {end - start} bytes, its shape needs {nbytes}"
            )
        end_max = max(end_max, end)
        out[name] = TensorInfo(path.name, dtype, shape)
    if data_start + end_max > size:
        raise ConvertError(
            f"{path}: truncated safetensors file ({size} bytes, "
            f"its header needs {data_start + end_max})"
        )
    return out


def resolve_source(src: str) -> Path:
    """A local directory, or a hub repo id downloaded with huggingface-hub."""
    p = Path(src).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConvertError(f"{src}: not a directory")
        return p
    if not looks_like_hub_id(src):
        raise ConvertError(f"{src}: no such directory")
    try:
        from huggingface_hub import snapshot_download

        with quiet_hub():
            return Path(
                snapshot_download(
                    src,
                    allow_patterns=["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"],
                )
            )
    except Exception as e:  # the hub raises many types; hub_failure says which
        raise ConvertError(hub_failure(src, e, "it")) from None


def open_source(src: str) -> Source:
    path = resolve_source(src)
    if (path / MANIFEST_NAME).exists():
        raise ConvertError(
            f"{src}: already a Deltafin model (converted); run it: deltafin-run {src} \"PROMPT\""
            f" (or see it: deltafin-run info {src})"
        )
    config_path = path / "config.json"
    if not config_path.exists():
        raise ConvertError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        config_bytes = config_path.read_bytes()
        config = json.loads(config_bytes)
    except (OSError, ValueError) as e:
        raise ConvertError(f"{config_path}: unreadable ({e})") from None

    index_path = path / "model.safetensors.index.json"
    h = hashlib.sha256(config_bytes)
    if index_path.exists():
        try:
            index_bytes = index_path.read_bytes()
            weight_map = json.loads(index_bytes)["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConvertError(f"{index_path}: unreadable index ({e})") from None
        h.update(index_bytes)
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
        if not shards:
            raise ConvertError(f"{path}: no safetensors weights and no index")
        weight_map = None

    tensors: Dict[str, TensorInfo] = {}
    total = 0
    for shard in shards:
        shard_path = path / shard
        if not shard_path.exists():
            raise ConvertError(f"{shard_path}: missing (named in the index)")
        header = read_safetensors_header(shard_path)
        h.update(f"{shard}:{shard_path.stat().st_size}".encode())
        for name, info in header.items():
            if weight_map is not None and weight_map.get(name) != shard:
                continue
            tensors[name] = info
            n = SAFETENSORS_DTYPES[info.dtype][0]
            for s in info.shape:
                n *= s
            total += n
    if weight_map is not None:
        missing = [n for n in weight_map if n not in tensors]
        if missing:
            raise ConvertError(
                f"{path / weight_map[missing[0]]}: does not hold tensor {missing[0]} "
                f"(the index says it does; {len(missing)} tensors missing in all)"
            )
    return Source(
        path=path,
        id=src if not Path(src).expanduser().exists() else str(path.resolve()),
        config=config,
        tensors=tensors,
        total_bytes=total,
        fingerprint=h.hexdigest(),
    )


def tokenizer_files(path: Path):
    names = [n for n in TOKENIZER_FILES if (path / n).is_file()]
    # The release's own tokenizer code (e.g. K3's tokenization_kimi.py, encoding_k3.py)
    # is carried along for users of other tools; Deltafin itself never runs it.
    names += sorted(
        p.name
        for p in path.glob("*.py")
        if p.name.startswith(("tokenization_", "encoding_"))
    )
    return names


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
