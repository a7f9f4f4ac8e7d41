"""Linked experts (`deltafin-convert --link-experts`): instead of copying each
expert into a bank, record where its sections lie in the source's safetensors files
(format/links.py writes the table), with a CRC-32 of its bytes computed now, and the
source files' fingerprints for the manifest. Only experts carried over byte for byte
can be linked (convert/experts.py `linkable`)."""

import os
import zlib
from typing import Dict, Tuple

import numpy as np

from deltafin_mlx.errors import ConvertError
from deltafin_mlx.format.links import ENTRY, source_fingerprint, write_links

from .source import Source, regular_file_inside


def source_rel(source: Source, shard: str) -> str:
    """A shard's path relative to the source root, after symlinks (a hub cache
    snapshot's shard is `blobs/<sha256>` of the repository's cache folder)."""
    real = regular_file_inside(source.path, shard, "shard", source.root)
    return os.path.relpath(real, os.path.realpath(source.root))


class LinkWriter:
    """One layer's link table, expert by expert."""

    def __init__(self, source: Source, layer: int, num_experts: int, sections):
        self.source, self.layer, self.sections = source, layer, sections
        self.files: list = []
        self._index: Dict[str, int] = {}
        self.entries = np.zeros((num_experts, len(sections)), dtype=ENTRY)
        self.checksums = np.zeros(num_experts, dtype="<u4")

    @staticmethod
    def size(num_experts: int, sections) -> int:
        """An upper bound on a table's size (for the free-space check)."""
        return (1 << 16) + num_experts * (len(sections) * ENTRY.itemsize + 4)

    def add(self, expert: int, record: Dict[str, np.ndarray],
            locations: Dict[str, Tuple[str, int, int]]):
        """`locations`: section -> (shard, offset, length) of its bytes in the source."""
        crc = 0
        for i, s in enumerate(self.sections):
            shard, offset, nbytes = locations[s.name]
            if nbytes != s.nbytes or record[s.name].nbytes != s.nbytes:
                raise ConvertError(f"layer {self.layer} expert {expert}: {s.name} is "
                                   f"{nbytes} bytes in the source, the record needs "
                                   f"{s.nbytes}; it cannot be linked")
            if shard not in self._index:
                self._index[shard] = len(self.files)
                self.files.append(source_rel(self.source, shard))
            self.entries[expert, i] = (self._index[shard], 0, offset)
            crc = zlib.crc32(np.ascontiguousarray(record[s.name]).view(np.uint8), crc)
        self.checksums[expert] = crc & 0xFFFFFFFF

    def write(self, path):
        write_links(path, self.layer, [s.name for s in self.sections], self.files,
                    self.entries, self.checksums)


def linked_manifest_entry(source: Source, done: dict) -> dict:
    """The manifest's `experts.linked`: the source root (real path) and every linked
    file's fingerprint, taken now that all tables are written."""
    rels = sorted({rel for unit in done.values() for rel in unit.get("linked_files", [])})
    root = os.path.realpath(source.root)
    return {"root": root, "files": {rel: source_fingerprint(os.path.join(root, rel))
                                    for rel in rels}}
