"""Reading linked experts (format version 3) where they lie in the source
checkpoint's safetensors files, into cache slots.

An expert's sections are grouped into contiguous runs from the link table's
offsets (format/links.py `LinkedLayout.runs`; K3's six tensors of one expert are
usually one run): each run is one read, widened to 4096-byte boundaries for
O_DIRECT (the slack is at most a block each side) into an aligned staging buffer,
and its sections are copied from there into the slot arrays. Source files are
opened once per runtime, through the same direct/buffered fallback as banks, and
only after format/links.py has checked each (inside the recorded root, a regular
file with its recorded size, mtime and header hash).
"""

import os
import stat
import zlib
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from deltafin_mlx.errors import ModelError, ReadError
from deltafin_mlx.format.bank import ALIGN, align_up
from deltafin_mlx.format.dtypes import NUMPY
from deltafin_mlx.format.links import LinkedLayout, check_linked_sources, read_links
from deltafin_mlx.engine.reader import BankFile, _pread_full, copy_section, open_bank


@dataclass
class LinkedBank:
    """One MoE layer's experts, read from the source files its table names."""

    path: str  # the link table (for messages)
    layout: LinkedLayout
    files: List[BankFile]  # by the table's file index; shared between layers
    sources: "LinkedSources"
    checked: Optional[np.ndarray] = None  # bool per expert: its CRC has been checked

    def __post_init__(self):
        if self.checked is None:
            self.checked = np.zeros(self.layout.num_experts, dtype=bool)

    @property
    def staging_bytes(self) -> int:
        # Each run is widened to whole blocks: at most a block more at each end.
        return max((sum(r.end - r.start + 2 * ALIGN for r in self.layout.runs(e))
                    for e in range(self.layout.num_experts)), default=ALIGN)

    def read_into(self, expert: int, targets: Dict[str, np.ndarray], staging: np.ndarray,
                  verify: bool):
        got = {}
        used = 0
        for run in self.layout.runs(expert):
            f = self.files[run.file]
            start = run.start // ALIGN * ALIGN
            length = align_up(run.end) - start
            buf = staging[used:used + length]
            _pread_full(f, [memoryview(buf)], start, length, at_least=run.end - start)
            if not f.direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fd, start, length, os.POSIX_FADV_DONTNEED)
            for name, off in run.parts:
                s = self.layout.section_by_name[name]
                at = run.start - start + off
                got[name] = buf[at:at + s.nbytes].view(NUMPY[s.dtype]).reshape(s.shape)
            used += align_up(length)
        if verify:
            crc = 0
            for s in self.layout.sections:
                crc = zlib.crc32(got[s.name].view(np.uint8).reshape(-1), crc)
            if (crc & 0xFFFFFFFF) != int(self.layout.checksums[expert]):
                raise ReadError(f"{self.path}: checksum mismatch in layer {self.layout.layer} "
                                f"expert {expert}: its bytes in the linked source differ from "
                                "the conversion's")
        for name, src in got.items():
            copy_section(targets[name], src)

    def close(self):
        self.sources.close()  # shared by every layer: closed by the first, once


class LinkedSources:
    """The linked source files of a model, checked and opened once."""

    def __init__(self, manifest, read_mode: str = "direct"):
        self.real = check_linked_sources(manifest.linked)
        mode = "buffered" if read_mode == "mmap" else read_mode
        self.files: Dict[str, BankFile] = {}
        try:
            for rel, real in self.real.items():
                self.files[rel] = f = open_bank(real, None, mode)
                st = os.fstat(f.fd)  # the file opened is the one checked, not a swap
                if (not stat.S_ISREG(st.st_mode)
                        or st.st_size != manifest.linked["files"][rel]["size"]):
                    raise ModelError(f"{real}: linked source file changed while it was opened")
        except OSError as e:
            self.close()
            raise ModelError(f"{e.filename}: cannot open linked source ({e.strerror})") from None
        except ModelError:
            self.close()
            raise

    def bank(self, manifest, layer: int) -> LinkedBank:
        layout = read_links(manifest.links_path(layer), manifest.layer_experts(layer), layer,
                            manifest.linked["files"])
        return LinkedBank(str(manifest.links_path(layer)), layout,
                          [self.files[rel] for rel in layout.files], self)

    def close(self):
        for f in self.files.values():
            f.close()
        self.files = {}
