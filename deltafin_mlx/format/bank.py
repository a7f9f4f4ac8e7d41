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

from deltafin_mlx.format.dtypes import NUMPY
from deltafin_mlx.errors import BankError
from deltafin_mlx.units import is_int

MAGIC = b"DFBANK\x00\x01"
FORMAT_VERSION = 1
# Version 2: records split into rank slices (deltafin-convert --ranks N, see
# docs/FORMAT.md). Unsliced models are still written, and read, as version 1.
SLICED_VERSION = 2
FORMAT_VERSIONS = (FORMAT_VERSION, SLICED_VERSION)
ALIGN = 4096

# The dtypes a record section may have.
SECTION_DTYPES = ("uint32", "uint8", "bfloat16", "float16", "float32")


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Section:
    name: str  # e.g. "gate_proj.weight"
    dtype: str  # one of SECTION_DTYPES
    shape: tuple
    offset: int  # within the record, a multiple of ALIGN
    nbytes: int

    def to_dict(self):
        return {"name": self.name,
                "dtype": self.dtype,
                "shape": list(self.shape),
                "offset": self.offset,
                "nbytes": self.nbytes}

    @classmethod
    def from_dict(cls, d):
        return cls(d["name"], d["dtype"], tuple(d["shape"]), d["offset"], d["nbytes"])


SECTION_KEYS = {"name", "dtype", "shape", "offset", "nbytes"}
MAX_EXPERTS = 1 << 20


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
        if not isinstance(name, str) or not isinstance(dtype, str) or dtype not in SECTION_DTYPES:
            raise ValueError(f"section {name!r:.80} has a bad name or dtype {dtype!r:.40}")
        if (not isinstance(shape, list) or not 1 <= len(shape) <= 8
                or not all(is_int(s) and 0 < s < 1 << 40 for s in shape)):
            raise ValueError(f"section {name!r} has a bad shape {shape!r:.80}")
        if not is_int(d["offset"]) or not is_int(d["nbytes"]):
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
        if dtype not in SECTION_DTYPES:
            raise BankError(f"unsupported expert tensor dtype {dtype} for {name}")
        nbytes = int(np.prod(shape)) * np.dtype(NUMPY[dtype]).itemsize
        sections.append(Section(name, dtype, tuple(int(s) for s in shape), offset, nbytes))
        offset = align_up(offset + nbytes)
    return sections


def record_size_of(sections: Sequence[Section]) -> int:
    last = sections[-1]
    return align_up(last.offset + last.nbytes)


def header_size_of(header_json: bytes, num_experts: int, slices: int = 1) -> int:
    tables = num_experts * (1 + (slices if slices > 1 else 0))
    return align_up(align_up(12 + len(header_json), 4) + 4 * tables)


def bank_header_size(layer: int, num_experts: int, sections: Sequence[Section],
                     slices: int = 1) -> int:
    """The header size of the bank BankWriter writes for these arguments."""
    return header_size_of(_header_json(layer, num_experts, sections, slices), num_experts, slices)


def slice_axis(name: str) -> int:
    """The axis of a section that rank slices split: the experts' intermediate
    dimension, i.e. the output rows of gate/up and the input columns of down
    (mlx-lm's "all-to-sharded" / "sharded-to-all")."""
    return 1 if name.startswith("down_proj.") else 0


def split_slices(tensors: Dict[str, np.ndarray], slices: int) -> List[Dict[str, np.ndarray]]:
    """One expert's full tensors cut into `slices` equal rank slices."""
    return [{name: np.split(a, slices, axis=slice_axis(name))[r] for name, a in tensors.items()}
            for r in range(slices)]


def slice_sections(sections: Sequence[Section], slices: int) -> List[Section]:
    """The section layout of one rank slice of records with full `sections`."""
    out = []
    for s in sections:
        shape = list(s.shape)
        ax = slice_axis(s.name)
        if shape[ax] % slices:
            raise BankError(f"{s.name} {s.shape} does not split into {slices} rank slices")
        shape[ax] //= slices
        out.append((s.name, s.dtype, tuple(shape)))
    return make_sections(out)


@dataclass
class BankLayout:
    """What a bank header says, checked against the file it came from."""

    layer: int
    num_experts: int
    record_size: int
    header_size: int
    sections: List[Section]  # of one record or, in a sliced bank, of one slice
    checksums: Optional[np.ndarray]  # uint32 [num_experts], over what record_offset reads
    slices: int = 1  # rank slices per record on disk (1: format version 1)
    slice_checksums: Optional[np.ndarray] = None  # uint32 [num_experts, slices]
    # A rank's view (see `for_rank`): each read covers `record_size` bytes at
    # `base` within a record of `stride` bytes, and `parts`/`part` say which part
    # of what was read the rank keeps.
    stride: Optional[int] = None
    base: int = 0
    parts: int = 1
    part: int = 0

    @property
    def slice_size(self) -> int:
        return record_size_of(self.sections)

    def record_offset(self, expert: int) -> int:
        return self.header_size + expert * (self.stride or self.record_size) + self.base

    @property
    def file_size(self) -> int:
        return self.header_size + self.num_experts * (self.stride or self.record_size)

    @property
    def held_sections(self) -> List[Section]:
        """The sections as this reader holds them in memory (a rank's slice)."""
        count = self.record_size // self.slice_size
        if count == 1 and self.parts == 1:
            return self.sections
        out = []
        for s in self.sections:
            shape = list(s.shape)
            ax = slice_axis(s.name)
            shape[ax] = shape[ax] * count // self.parts
            out.append((s.name, s.dtype, tuple(shape)))
        return make_sections(out)

    def for_rank(self, rank: int, ranks: int) -> "BankLayout":
        """What rank `rank` of `ranks` reads from this bank: one contiguous run of
        slices per record (ranks dividing the slice count), or one slice of which
        it keeps a part (a slice count dividing ranks: whole-record reads for
        version 1 banks). ValueError when neither divides the other."""
        S = self.slices
        if ranks == 1:
            first, count, parts, part = 0, S, 1, 0
        elif S % ranks == 0:
            first, count, parts, part = rank * (S // ranks), S // ranks, 1, 0
        elif ranks % S == 0:
            per = ranks // S
            first, count, parts, part = rank // per, 1, per, rank % per
        else:
            raise ValueError(f"the model was converted with {S} rank slices, which {ranks} "
                             "ranks cannot share (use a rank count dividing it or a multiple)")
        if count == S:
            sums = self.checksums
        elif count == 1 and self.slice_checksums is not None:
            sums = self.slice_checksums[:, first].copy()
        else:
            sums = None  # no checksum covers this run of slices (see FORMAT.md)
        size = self.slice_size
        return BankLayout(self.layer, self.num_experts, count * size, self.header_size,
                          self.sections, sums, S, self.slice_checksums,
                          stride=S * size, base=first * size, parts=parts, part=part)

    def section(self, name: str) -> Section:
        for s in self.sections:
            if s.name == name:
                return s
        raise KeyError(name)

    def split_record(self, record: np.ndarray) -> Dict[str, np.ndarray]:
        """One read's bytes as the tensors this reader holds (numpy; zero-copy
        views for one whole slice, else the rank's part of the slices read)."""
        size = self.slice_size
        count = len(record) // size
        pieces = []
        for c in range(count):
            chunk = record[c * size : (c + 1) * size]
            pieces.append({s.name: chunk[s.offset : s.offset + s.nbytes]
                           .view(NUMPY[s.dtype]).reshape(s.shape) for s in self.sections})
        if count == 1 and self.parts == 1:
            return pieces[0]
        out = {}
        for s in self.sections:
            ax = slice_axis(s.name)
            full = np.concatenate([p[s.name] for p in pieces], axis=ax)
            out[s.name] = np.split(full, self.parts, axis=ax)[self.part]
        return out


def _header_json(layer, num_experts, sections, slices: int = 1) -> bytes:
    meta = {"format_version": FORMAT_VERSION,
            "layer": layer,
            "num_experts": num_experts,
            "record_size": record_size_of(sections) * slices,
            "sections": [s.to_dict() for s in sections],
            "checksum": "crc32"}
    if slices > 1:
        meta.update(format_version=SLICED_VERSION, slices=slices)
    return json.dumps(meta, sort_keys=True).encode()


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
                if not is_int(version) or version not in FORMAT_VERSIONS:
                    raise BankError(f"{path}: bank format version {version!r:.40} is not supported "
                                    f"(this Deltafin reads versions {FORMAT_VERSIONS})")
                slices = meta.get("slices", 1) if version == SLICED_VERSION else 1
                if version == SLICED_VERSION and not (is_int(slices) and 1 < slices <= 1024):
                    raise ValueError(f"slices {slices!r:.40}")
                num_experts = meta["num_experts"]
                record_size = meta["record_size"]
                layer = meta["layer"]
                for key, v in (("num_experts", num_experts), ("record_size", record_size),
                               ("layer", layer)):
                    if not is_int(v) or v < 0:
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
            header_size = header_size_of(raw, num_experts, slices)
            if record_size != record_size_of(sections) * slices:
                raise BankError(f"{path}: corrupt bank header (section layout)")
            f.seek(align_up(12 + jlen, 4))
            n_sums = num_experts * (1 + (slices if slices > 1 else 0))
            sums = np.frombuffer(f.read(4 * n_sums), dtype="<u4")
            if sums.size != n_sums:
                raise BankError(f"{path}: corrupt bank header (checksum table)")
    except OSError as e:
        raise BankError(f"{path}: cannot read bank ({e.strerror})") from None
    slice_sums = sums[num_experts:].reshape(num_experts, slices).copy() if slices > 1 else None
    layout = BankLayout(layer, num_experts, record_size, header_size, sections,
                        sums[:num_experts].copy(), slices, slice_sums)
    if size != layout.file_size:
        raise BankError(f"{path}: bank is {size} bytes, its header says {layout.file_size} "
                        "(truncated or modified file)")
    if expect:
        for key in ("num_experts", "record_size", "header_size", "layer", "slices"):
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
    With `slices` > 1, `sections` are one rank slice's and each record is written
    as that many slices of the expert's tensors (`split_slices`).
    """

    def __init__(self, path, layer: int, num_experts: int, sections: List[Section],
                 slices: int = 1):
        self.path = str(path)
        self.sections = sections
        self.slices = slices
        self.slice_size = record_size_of(sections)
        self.record_size = self.slice_size * slices
        self.num_experts = num_experts
        self._header_json = _header_json(layer, num_experts, sections, slices)
        self.header_size = header_size_of(self._header_json, num_experts, slices)
        self._sums = np.zeros(num_experts, dtype="<u4")
        self._slice_sums = np.zeros((num_experts, slices), dtype="<u4")
        self._next = 0
        self._record = np.zeros(self.record_size, dtype=np.uint8)
        self._f = open(self.path, "wb")
        self._f.truncate(self.header_size)
        self._f.seek(self.header_size)

    def write_record(self, tensors: Dict[str, np.ndarray]):
        """Write the next expert, given its full (unsliced) tensors."""
        rec = self._record
        rec[:] = 0
        parts = split_slices(tensors, self.slices) if self.slices > 1 else [tensors]
        for r, part in enumerate(parts):
            base = r * self.slice_size
            for s in self.sections:
                a = np.ascontiguousarray(part[s.name])
                if a.nbytes != s.nbytes or tuple(a.shape) != s.shape:
                    raise BankError(f"expert {self._next}: {s.name} has shape {a.shape} "
                                    f"({a.nbytes} bytes), expected {s.shape} ({s.nbytes} bytes)")
                rec[base + s.offset : base + s.offset + s.nbytes] = a.reshape(-1).view(np.uint8)
            self._slice_sums[self._next, r] = crc32(rec[base : base + self.slice_size])
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
        if self.slices > 1:
            self._f.write(self._slice_sums.tobytes())
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self):
        self._f.close()
