"""The memory plan: from the manifest and a budget, what is resident and how many
expert slots each MoE layer gets.

The budget covers the trunk (held at the activation dtype), the KV cache and
recurrent state at the planned context, the reader's staging buffers and a working
margin for activations; what remains is expert cache, split evenly over the MoE
layers. The floor is the budget at which each layer keeps just the experts one
token needs.
"""

import os
import re
from dataclasses import dataclass

import mlx.core as mx

from .cache import slot_bytes
from .bank import Section
from .manifest import Manifest

WORKING_BYTES = 16 << 20  # activations, router outputs and read bookkeeping of small models
HEADROOM = 0.85  # of available memory, for the default budget

_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 1 << 10, "M": 1e6, "MB": 1e6,
          "MIB": 1 << 20, "G": 1e9, "GB": 1e9, "GIB": 1 << 30, "T": 1e12, "TB": 1e12,
          "TIB": 1 << 40}


class BudgetError(ValueError):
    pass


def parse_size(value) -> int:
    """Bytes from an int or a string like "8GB", "512MiB", "1.5G"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise BudgetError(f"memory budget must be positive (got {value})")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise BudgetError(
            f"bad memory size {value!r} (examples: 8GB, 512MB, 1.5GiB, 1000000000)"
        )
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise BudgetError(f"memory budget must be positive (got {value!r})")
    return n


def available_memory() -> int:
    """Memory this process can use now: MemAvailable, capped by a cgroup limit."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            avail = 8 << 30
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(limit_file) as f:
                raw = f.read().strip()
            if raw == "max":
                continue
            limit = int(raw)
            with open(usage_file) as f:
                usage = int(f.read().strip())
            if limit < 1 << 60:
                avail = min(avail, max(limit - usage, 0))
        except (OSError, ValueError):
            continue
    return avail


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def default_budget() -> int:
    return int(available_memory() * HEADROOM)


_DTYPE_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "uint32": 4, "uint8": 1,
               "int32": 4, "uint16": 2, "int8": 1, "int64": 8}


def tensor_bytes(info: dict, activation_dtype: mx.Dtype) -> int:
    """Memory one trunk tensor takes once loaded (floats at the activation dtype)."""
    n = 1
    for s in info["shape"]:
        n *= s
    dt = info["dtype"]
    if dt in ("bfloat16", "float16", "float32"):
        return n * activation_dtype.size
    return n * _DTYPE_SIZE.get(dt, 4)


def state_bytes(config: dict, context: int, activation_dtype: mx.Dtype) -> int:
    """KV cache and recurrent state for one sequence of `context` tokens."""
    tc = config.get("text_config", config)
    layers = tc.get("num_hidden_layers", 0)
    size = activation_dtype.size
    lin = tc.get("linear_attn_config") or {}
    kda = set(lin.get("kda_layers", []))
    total = 0
    for i in range(layers):
        if (i + 1) in kda:
            heads, hd = lin["num_heads"], lin["head_dim"]
            conv = (lin.get("short_conv_kernel_size", 4) - 1) * 3 * heads * hd * size
            total += heads * hd * hd * 4 + conv
        elif tc.get("kv_lora_rank"):
            total += context * (tc["kv_lora_rank"] + tc.get("qk_rope_head_dim", 0)) * size
        else:
            heads = tc.get("num_key_value_heads") or tc.get("num_attention_heads", 1)
            hd = tc.get("head_dim") or tc["hidden_size"] // tc.get("num_attention_heads", 1)
            total += 2 * context * heads * hd * size
    return total


@dataclass
class MemoryPlan:
    budget: int
    trunk_bytes: int
    state_bytes: int
    working_bytes: int
    slot_bytes: int  # one expert in memory
    moe_layers: int
    experts_per_token: int
    num_experts: int
    slots: int  # expert cache slots, shared by all MoE layers

    @property
    def floor(self) -> int:
        """The smallest budget that runs: one token's experts for one layer."""
        return (self.trunk_bytes + self.state_bytes + self.working_bytes
                + self.experts_per_token * self.slot_bytes)

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def cache_fraction(self) -> float:
        """The share of all experts (of all MoE layers) the cache holds."""
        return self.slots / (self.num_experts * self.moe_layers)


def plan_memory(manifest: Manifest, config: dict, budget, activation_dtype: mx.Dtype,
                context: int = 4096, reader_threads: int = 1, max_slots: int = None) -> MemoryPlan:
    budget = default_budget() if budget is None else parse_size(budget)
    trunk = sum(tensor_bytes(t, activation_dtype) for t in manifest.tensors.values())
    sections = [Section.from_dict(d) for d in manifest.experts["sections"]]
    one = slot_bytes(sections, activation_dtype)
    num_experts = manifest.experts["num_experts"]
    k = manifest.experts["experts_per_token"]
    n_moe = len(manifest.moe_layers)
    working = WORKING_BYTES + (reader_threads + 1) * manifest.experts["record_size"]
    plan = MemoryPlan(budget, trunk, state_bytes(config, context, activation_dtype), working,
                      one, n_moe, k, num_experts, 0)
    spare = budget - (plan.floor - k * one)
    slots = min(num_experts * n_moe, spare // one) if spare > 0 else 0
    if max_slots is not None:
        slots = min(slots, max_slots)
    if slots < k:
        raise BudgetError(
            f"memory budget {budget / 1e9:.3f} GB is below this model's floor of "
            f"{plan.floor / 1e9:.3f} GB ({plan.floor} bytes: trunk {trunk / 1e9:.3f} GB, "
            f"KV/state {plan.state_bytes / 1e9:.3f} GB at {context} tokens, "
            f"one token's {k} experts {k * one / 1e9:.3f} GB)"
        )
    plan.slots = int(slots)
    return plan
