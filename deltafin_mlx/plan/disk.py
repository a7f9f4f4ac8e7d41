"""The disk each way of getting a model needs, before anything is downloaded.

Three routes from a Hugging Face checkpoint to a model Deltafin runs:
- download, then convert (packed): the snapshot in the hub cache plus the packed
  output (trunk and banks) — at its peak both are on disk;
- download, then link (`--link-experts`, experts carried over byte for byte only):
  the snapshot stays and the output is the trunk plus small link tables;
- convert from the hub within a bounded scratch (`--scratch-limit`): the packed
  output plus the shards live at once (the largest shard where each layer is in a
  shard of its own, as in Kimi K3's release).
The download is the checkpoint's published file sizes where they are known (a hub
listing or a local directory) and otherwise estimated from config.json (the
language model's tensors at the source's dtype and the experts as they are stored).
"""

from dataclasses import asdict, dataclass
from typing import Dict, Optional

from deltafin_mlx.format.links import ENTRY
from deltafin_mlx.format.dtypes import ITEMSIZE

from deltafin_mlx.format.bank import ALIGN
from deltafin_mlx.format.record import input_size, linear_quant

LINK_TABLE_SLACK = ALIGN  # a table's header (a few file names), beside its entries


@dataclass
class DiskRoutes:
    download_bytes: int
    download_from: str  # "published file sizes" or "estimated from config.json"
    largest_shard_bytes: int
    packed_output_bytes: int
    linked_output_bytes: Optional[int]  # None: the experts must be requantized
    download_and_packed_bytes: int
    download_and_linked_bytes: Optional[int]
    scratch_peak_bytes: int  # --scratch-limit: shards live at once (and the small files)
    hub_with_scratch_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def disk_routes(inv, quant: dict, shard_sizes: Optional[Dict[str, int]] = None,
                small_bytes: int = 0, source_itemsize: int = 2) -> DiskRoutes:
    """The routes' disk for the inventory `inv` of a source (plan/footprint.py)
    whose experts are quantized as `quant`; `shard_sizes` are the checkpoint's
    safetensors files when known."""
    trunk = sum(u.disk_bytes for u in inv.units.values())
    layers = len(inv.moe_layers)
    experts = inv.num_experts * layers
    packed = trunk + inv.expert_disk_bytes + layers * ALIGN  # each bank's header
    linkable = bool(quant.get("carried_over"))
    tables = layers * LINK_TABLE_SLACK + experts * (len(inv.sections) * ENTRY.itemsize + 4)
    linked = trunk + tables if linkable else None
    if shard_sizes:
        download = sum(shard_sizes.values()) + small_bytes
        largest = max(shard_sizes.values())
        origin = "published file sizes"
    else:
        if linkable:  # stored as the record's sections, without their padding
            expert_src = sum(s.nbytes for s in inv.sections)
        else:
            expert_src = sum(s.shape[0] * source_itemsize
                             * input_size(linear_quant(quant, s.name.rpartition(".")[0]), s.shape)
                             for s in inv.sections if s.name.endswith(".weight"))
        per_layer = {k: b + (expert_src * inv.num_experts if k.isdigit()
                             and int(k) in inv.moe_layers else 0)
                     for k, b in inv.source_unit_bytes.items()}
        download = sum(per_layer.values()) + small_bytes
        largest = max(per_layer.values(), default=0)
        origin = "estimated from config.json (language model only; one layer per shard)"
    peak = largest + small_bytes
    return DiskRoutes(download, origin, largest, packed, linked, download + packed,
                      None if linked is None else download + linked, peak, packed + peak)


def itemsize_of(dtype_name: Optional[str]) -> int:
    return ITEMSIZE.get(dtype_name or "bfloat16", 2)
