"""Expert banks: one file per MoE layer, one fixed-size aligned record per expert.

See docs/FORMAT.md. This module is the only code that knows the byte layout; the
converter writes through `BankWriter`, the runtime reads through `BankLayout`.
"""

import json
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

MAGIC = b"DFBANK\x00\x01"
FORMAT_VERSION = 1
ALIGN = 4096

# numpy has no bfloat16: banks move bf16 as raw uint16 bit patterns.
NUMPY_DTYPES = {
    "uint32": np.uint32,
    "uint8": np.uint8,
    "bfloat16": np.uint16,
    "float16": np.float16,
    "float32": np.float32,
}


class BankError(ValueError):
    """A bank file that does not match the format or its manifest."""


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Section:
    name: str  # e.g. "gate_proj.weight"
    dtype: str  # a key of NUMPY_DTYPES
    shape: tuple
    offset: int  # within the record, a multiple of ALIGN
    nbytes: int

    def to_dict(self):
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_dict(cls, d):
        return cls(d["name"], d["dtype"], tuple(d["shape"]), d["offset"], d["nbytes"])


SECTION_KEYS = {"name", "dtype", "shape", "offset", "nbytes"}
MAX_EXPERTS = 1 << 20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def sections_from_dicts(items) -> List[Section]:
    """Sections from their JSON form (a bank header or the manifest), checked for
    types and for the aligned layout `make_sections` gives; ValueError says why."""
    if not isinstance(items, list) or not items:
        raise ValueError("sections must be a non-empty list")
    out = []
    for d in items:
        if not isinstance(d, dict) or set(d) != SECTION_KEYS:
            raise ValueError(f"section {d!r:.80} is not an object with keys {sorted(SECTION_KEYS)}")
        name, dtype, shape = d["name"], d["dtype"], d["shape"]
        if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in NUMPY_DTYPES:
            raise ValueError(f"section {name!r:.80} has a bad name or dtype {dtype!r:.40}")
        if (not isinstance(shape, list) or not 1 <= len(shape) <= 8
                or not all(_is_int(s) and 0 < s < 1 << 40 for s in shape)):
            raise ValueError(f"section {name!r} has a bad shape {shape!r:.80}")
        if not _is_int(d["offset"]) or not _is_int(d["nbytes"]):
            raise ValueError(f"section {name!r} has a non-integer offset or size")
        out.append(Section(name, dtype, tuple(shape), d["offset"], d["nbytes"]))
    if len({s.name for s in out}) != len(out):
        raise ValueError("duplicate section names")
    if out != make_sections([(s.name, s.dtype, s.shape) for s in out]):
        raise ValueError("section offsets or sizes do not match their shapes")
    return out


def make_sections(tensors: Sequence) -> List[Section]:
    """Lay out (name, dtype, shape) triples as aligned sections of one record."""
    sections = []
    offset = 0
    for name, dtype, shape in tensors:
        if dtype not in NUMPY_DTYPES:
            raise BankError(f"unsupported expert tensor dtype {dtype} for {name}")
        nbytes = int(np.prod(shape)) * np.dtype(NUMPY_DTYPES[dtype]).itemsize
        sections.append(Section(name, dtype, tuple(int(s) for s in shape), offset, nbytes))
        offset = align_up(offset + nbytes)
    return sections


def record_size_of(sections: Sequence[Section]) -> int:
    last = sections[-1]
    return align_up(last.offset + last.nbytes)


def header_size_of(header_json: bytes, num_experts: int) -> int:
    return align_up(align_up(12 + len(header_json), 4) + 4 * num_experts)


def bank_header_size(layer: int, num_experts: int, sections: Sequence[Section]) -> int:
    """The header size of the bank BankWriter writes for these arguments."""
    return header_size_of(_header_json(layer, num_experts, sections), num_experts)


@dataclass
class BankLayout:
    """What a bank header says, checked against the file it came from."""

    layer: int
    num_experts: int
    record_size: int
    header_size: int
    sections: List[Section]
    checksums: np.ndarray  # uint32 [num_experts]

    def record_offset(self, expert: int) -> int:
        return self.header_size + expert * self.record_size

    @property
    def file_size(self) -> int:
        return self.header_size + self.num_experts * self.record_size

    def section(self, name: str) -> Section:
        for s in self.sections:
            if s.name == name:
                return s
        raise KeyError(name)

    def split_record(self, record: np.ndarray) -> Dict[str, np.ndarray]:
        """Views of one record's bytes as its tensors (numpy, zero-copy)."""
        out = {}
        for s in self.sections:
            raw = record[s.offset : s.offset + s.nbytes]
            out[s.name] = raw.view(NUMPY_DTYPES[s.dtype]).reshape(s.shape)
        return out


def _header_json(layer, num_experts, sections) -> bytes:
    return json.dumps(
        {
            "format_version": FORMAT_VERSION,
            "layer": layer,
            "num_experts": num_experts,
            "record_size": record_size_of(sections),
            "sections": [s.to_dict() for s in sections],
            "checksum": "crc32",
        },
        sort_keys=True,
    ).encode()


def read_layout(path, expect: Optional[dict] = None) -> BankLayout:
    """Parse and check a bank header; `expect` holds manifest values to match."""
    path = str(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) < 12 or head[:8] != MAGIC:
                raise BankError(f"{path}: not a Deltafin expert bank (bad magic)")
            (jlen,) = struct.unpack("<I", head[8:12])
            if jlen > 1 << 24 or 12 + jlen > size:
                raise BankError(f"{path}: corrupt bank header (length {jlen})")
            raw = f.read(jlen)
            try:
                meta = json.loads(raw)
                if not isinstance(meta, dict):
                    raise ValueError("not a JSON object")
                version = meta["format_version"]
                if version != FORMAT_VERSION:
                    raise BankError(
                        f"{path}: bank format version {version!r:.40} is not supported "
                        f"(this Deltafin reads version {FORMAT_VERSION})"
                    )
                num_experts = meta["num_experts"]
                record_size = meta["record_size"]
                layer = meta["layer"]
                for key, v in (("num_experts", num_experts), ("record_size", record_size),
                               ("layer", layer)):
                    if not _is_int(v) or v < 0:
                        raise ValueError(f"{key} {v!r:.40} is not a non-negative integer")
                if meta.get("checksum") != "crc32":
                    raise ValueError(f"unknown checksum {meta.get('checksum')!r:.40}")
                sections = sections_from_dicts(meta["sections"])
            except BankError:
                raise
            except (ValueError, KeyError, TypeError, RecursionError) as e:
                raise BankError(f"{path}: corrupt bank header ({e})") from None
            if num_experts <= 0 or num_experts > MAX_EXPERTS:
                raise BankError(f"{path}: corrupt bank header (num_experts {num_experts})")
            header_size = header_size_of(raw, num_experts)
            if record_size != record_size_of(sections):
                raise BankError(f"{path}: corrupt bank header (section layout)")
            f.seek(align_up(12 + jlen, 4))
            sums = np.frombuffer(f.read(4 * num_experts), dtype="<u4")
            if sums.size != num_experts:
                raise BankError(f"{path}: corrupt bank header (checksum table)")
    except OSError as e:
        raise BankError(f"{path}: cannot read bank ({e.strerror})") from None
    layout = BankLayout(layer, num_experts, record_size, header_size, sections, sums.copy())
    if size != layout.file_size:
        raise BankError(
            f"{path}: bank is {size} bytes, its header says {layout.file_size} "
            "(truncated or modified file)"
        )
    if expect:
        for key in ("num_experts", "record_size", "header_size", "layer"):
            if key in expect and expect[key] != getattr(layout, key):
                raise BankError(
                    f"{path}: {key} is {getattr(layout, key)}, the manifest says {expect[key]}"
                )
        if "sections" in expect and [s.to_dict() for s in sections] != expect["sections"]:
            raise BankError(f"{path}: section layout differs from the manifest")
    return layout


def crc32(buf) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


class BankWriter:
    """Writes one bank file record by record; call `close()` to finish it.

    The header (with the checksum table) is written last, into space reserved up
    front, so a partly written bank never has a valid checksum table.
    """

    def __init__(self, path, layer: int, num_experts: int, sections: List[Section]):
        self.path = str(path)
        self.sections = sections
        self.record_size = record_size_of(sections)
        self.num_experts = num_experts
        self._header_json = _header_json(layer, num_experts, sections)
        self.header_size = header_size_of(self._header_json, num_experts)
        self._sums = np.zeros(num_experts, dtype="<u4")
        self._next = 0
        self._record = np.zeros(self.record_size, dtype=np.uint8)
        self._f = open(self.path, "wb")
        self._f.truncate(self.header_size)
        self._f.seek(self.header_size)

    def write_record(self, tensors: Dict[str, np.ndarray]):
        rec = self._record
        rec[:] = 0
        for s in self.sections:
            a = np.ascontiguousarray(tensors[s.name])
            if a.nbytes != s.nbytes or tuple(a.shape) != s.shape:
                raise BankError(
                    f"expert {self._next}: {s.name} has shape {a.shape} "
                    f"({a.nbytes} bytes), expected {s.shape} ({s.nbytes} bytes)"
                )
            rec[s.offset : s.offset + s.nbytes] = a.reshape(-1).view(np.uint8)
        self._sums[self._next] = crc32(rec)
        self._f.write(rec.data)
        self._next += 1

    def close(self):
        if self._next != self.num_experts:
            raise BankError(
                f"bank {self.path} closed after {self._next} of {self.num_experts} records"
            )
        self._f.seek(0)
        self._f.write(MAGIC + struct.pack("<I", len(self._header_json)))
        self._f.write(self._header_json)
        self._f.seek(align_up(12 + len(self._header_json), 4))
        self._f.write(self._sums.tobytes())
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self):
        self._f.close()
