"""The source checkpoint: a Hugging Face model directory (or hub id), checked up front.

Every shard's safetensors header is parsed and checked against the file's size
before any conversion work starts, so a missing, truncated or corrupt shard is
reported in one line instead of failing half-way through.
"""

import hashlib
import json
import os
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

import mlx.core as mx

from deltafin_mlx.format.hub import cache_root, download_snapshot, looks_like_hub_id, sha256_file
from deltafin_mlx.format.manifest import MANIFEST_NAME
from deltafin_mlx.errors import ConvertError
from deltafin_mlx.format.safetensors import parse_header, read_header
from deltafin_mlx.model.config import check_config, most_source_tensors


TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "generation_config.json", "chat_template.jinja",
                   "chat_template.json", "vocab.json", "merges.txt")


@dataclass
class TensorInfo:
    shard: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: Tuple[int, ...]
    offset: int  # where its bytes start in the shard file
    nbytes: int


@dataclass
class Source:
    path: Path  # where the files are named (a hub cache snapshot folder, or SRC)
    id: str
    config: dict
    tensors: Dict[str, TensorInfo]
    total_bytes: int
    fingerprint: str
    # The real folder every file must resolve inside: SRC, or for a hub snapshot
    # the repository's cache folder (its files are symlinks into its blobs/).
    root: Optional[Path] = None
    # shard -> the sha256 its hub cache blob is named by (the LFS oid): what a
    # shard downloaded by huggingface-hub (which does not check it) must hash to.
    blob_sha256: Dict[str, str] = field(default_factory=dict)
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

    def check_blob(self, shard: str):
        """A hub cache shard hashes to the sha256 its blob is named by (else
        ConvertError: a corrupt download, to be deleted and fetched again)."""
        want = self.blob_sha256.get(shard)
        if want is None:
            return
        real = regular_file_inside(self.path, shard, "shard", self.root)
        if sha256_file(real) != want:
            raise ConvertError(f"{self.path / shard}: its bytes do not match the hub's sha256 "
                               f"{want[:12]}... (a corrupt download: delete {real} and rerun)")

    def forget(self, shard: str):
        """Drop the lazy handles of a shard about to be deleted (bounded scratch)."""
        self._open.pop(shard, None)

    def content_fingerprint(self, names) -> str:
        """sha256 over each tensor's name, dtype, shape and a CRC-32 of its bytes
        as they are in the shard now: what a resumed conversion compares, so a
        source tensor rewritten in place (same name, same size) is noticed."""
        h = hashlib.sha256()
        buf = bytearray(16 << 20)
        for name in sorted(names):
            t = self.tensors[name]
            crc = 0
            try:
                with open(self.path / t.shard, "rb") as f:
                    f.seek(t.offset)
                    left = t.nbytes
                    while left:
                        n = f.readinto(memoryview(buf)[: min(left, len(buf))])
                        if not n:
                            raise ConvertError(f"{self.path / t.shard}: truncated (it shrank "
                                               "during the conversion)")
                        crc = zlib.crc32(memoryview(buf)[:n], crc)
                        left -= n
            except OSError as e:
                raise ConvertError(f"{self.path / t.shard}: cannot read ({e.strerror})") from None
            h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0{crc:08x}\n".encode())
        return h.hexdigest()

    def nbytes(self, name: str) -> int:
        return self.tensors[name].nbytes


MAX_JSON_BYTES = 64 << 20  # config.json, the index


def regular_file_inside(path: Path, rel: str, what: str, root: Optional[Path] = None) -> Path:
    """`path/rel` if it resolves (after symlinks) inside `root` (default `path`)
    and is a regular file; a FIFO would block the read, a device never end it."""
    from deltafin_mlx.format.integrity import resolve_inside

    try:
        return resolve_inside(path, rel, ConvertError, "the source directory", root)[0]
    except ConvertError as e:
        raise ConvertError(f"{e} ({what})") from None


def read_json(path: Path, what: str, limit: int = MAX_JSON_BYTES):
    try:
        if path.stat().st_size > limit:
            raise ConvertError(f"{path}: {path.stat().st_size} bytes, too large for {what}")
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
        return raw, json.loads(raw)
    except ConvertError:
        raise
    except OSError as e:
        raise ConvertError(f"{path}: cannot read {what} ({e.strerror})") from None
    except (ValueError, RecursionError) as e:
        raise ConvertError(f"{path}: unreadable {what} ({type(e).__name__}: "
                           f"{str(e)[:200]})") from None


def read_safetensors_header(path: Path) -> Dict[str, TensorInfo]:
    """One local shard's tensors, its header checked (format/safetensors.py)."""
    return _tensor_infos(path, read_header(path, ConvertError))


def parse_safetensors_header(path, raw: bytes, size: int) -> Dict[str, TensorInfo]:
    """A shard's header JSON (`raw`, after its 8-byte length) checked against the
    shard's `size`; `path` names it (a local file, or a hub file read by range)."""
    return _tensor_infos(path, parse_header(path, raw, size, ConvertError))


def _tensor_infos(path, entries) -> Dict[str, TensorInfo]:
    name = Path(path).name
    return {k: TensorInfo(name, e.dtype, e.shape, e.offset, e.nbytes) for k, e in entries.items()}


def resolve_source(src: str, revision: Optional[str] = None,
                   progress: bool = True) -> Tuple[Path, Path]:
    """A local directory, or a hub repo id downloaded with huggingface-hub: the
    folder its files are named in, and the real root they must resolve inside."""
    p = Path(src).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ConvertError(f"{src}: not a directory")
        if revision is not None:
            raise ConvertError(f"--revision {revision}: {src} is a local directory, not a hub id")
        return p, Path(os.path.realpath(p))
    if not looks_like_hub_id(src):
        raise ConvertError(f"{src}: no such directory")
    snapshot = download_snapshot(src, revision, progress=progress)
    return snapshot, cache_root(snapshot)


def open_source(src: str, revision: Optional[str] = None, progress: bool = True) -> Source:
    path, root = resolve_source(src, revision, progress)
    return read_source(src, path, root)


def read_source(src: str, path: Path, root: Path, remote=None) -> Source:
    """The source whose files are named in `path` and resolve inside `root`; with
    `remote` (convert/scratch.py), shards still on the hub, known by their headers."""
    if (path / MANIFEST_NAME).exists():
        raise ConvertError(
            f"{src}: already a Deltafin model (converted); run it: deltafin-run {src} \"PROMPT\""
            f" (or see it: deltafin-run info {src})"
        )
    config_path = path / "config.json"
    if not os.path.lexists(config_path):
        raise ConvertError(f"{path}: no config.json (not a Hugging Face model directory)")
    regular_file_inside(path, "config.json", "config.json", root)
    config_bytes, config = read_json(config_path, "config.json")
    check_config(config, config_path, ConvertError)

    index_path = path / "model.safetensors.index.json"
    h = hashlib.sha256(config_bytes)
    if os.path.lexists(index_path):
        regular_file_inside(path, index_path.name, "the index", root)
        index_bytes, index = read_json(index_path, "the index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items()):
            raise ConvertError(f"{index_path}: unreadable index (weight_map must be an object "
                               "of tensor names to shard file names)")
        h.update(index_bytes)
        shards = sorted(set(weight_map.values()))
    elif remote is not None:
        shards = sorted(remote.shards)
        weight_map = None
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
        if not shards:
            raise ConvertError(f"{path}: no safetensors weights and no index")
        weight_map = None

    tensors: Dict[str, TensorInfo] = {}
    defined_in: Dict[str, str] = {}
    total = 0
    most = most_source_tensors(config)
    for shard in shards:
        if remote is not None:
            header, size = remote.header(shard)
        else:
            if not os.path.lexists(path / shard):
                raise ConvertError(f"{path / shard}: missing (named in the index)")
            shard_path = regular_file_inside(path, shard, "shard", root)
            header = read_safetensors_header(shard_path)
            size = shard_path.stat().st_size
        if len(defined_in) + len(header) > most:  # each costs memory: refused before held
            raise ConvertError(f"{path / shard}: the safetensors headers list more than "
                               f"{most:,} tensors, more than a model of its config.json holds")
        for name in header:
            header[name].shard = shard
        h.update(f"{shard}:{size}".encode())
        for name, info in header.items():
            if name in defined_in:
                raise ConvertError(f"tensor {name} is defined in two shards, "
                                   f"{path / defined_in[name]} and {path / shard}")
            defined_in[name] = shard
            if weight_map is not None and weight_map.get(name) != shard:
                continue
            tensors[name] = info
            total += info.nbytes
    if weight_map is not None:
        missing = [n for n in weight_map if n not in tensors]
        if missing:
            raise ConvertError(
                f"{path / weight_map[missing[0]]}: does not hold tensor {missing[0]} "
                f"(the index says it does; {len(missing)} tensors missing in all)"
            )
    return Source(path=path,
                  id=src if not Path(src).expanduser().exists() else str(path.resolve()),
                  config=config,
                  tensors=tensors,
                  total_bytes=total,
                  fingerprint=h.hexdigest(),
                  root=root,
                  blob_sha256=_blob_names(path, root, shards) if remote is None else {})


def _blob_names(path: Path, root: Path, shards) -> Dict[str, str]:
    """For a hub cache snapshot: each shard's blob name where it is a sha256."""
    out = {}
    for shard in shards:
        real = Path(os.path.realpath(path / shard))
        if (real.parent.name == "blobs" and len(real.name) == 64
                and all(c in "0123456789abcdef" for c in real.name)
                and real.parent.parent == Path(os.path.realpath(root))):
            out[shard] = real.name
    return out


def tokenizer_files(path: Path, root: Optional[Path] = None):
    """The source's tokenizer files, each checked (inside, a regular file). Code a
    release carries (tokenization_*.py and the like) is never among them: nothing
    that comes with a model runs, and none of it is copied into the output."""
    names = [n for n in TOKENIZER_FILES if os.path.lexists(path / n)]
    for n in names:
        regular_file_inside(path, n, "tokenizer file", root)
    return names


def without_code(obj):
    """A config's JSON with every "auto_map" (transformers' pointer to code the
    model carries, which it runs with trust_remote_code) taken out, at any depth:
    K3's config names it inside text_config too."""
    if isinstance(obj, dict):
        return {k: without_code(v) for k, v in obj.items() if k != "auto_map"}
    if isinstance(obj, list):
        return [without_code(v) for v in obj]
    return obj


def copy_tokenizer_file(src: Path, dst: Path):
    """One tokenizer file copied, a JSON one without its code references."""
    if src.suffix != ".json":
        shutil.copyfile(src, dst)
        return
    try:
        data = json.loads(src.read_bytes())
    except (ValueError, RecursionError):
        raise ConvertError(f"{src.name}: not valid JSON") from None
    dst.write_text(json.dumps(without_code(data), indent=2, ensure_ascii=False))


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
