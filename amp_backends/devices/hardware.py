"""What the CPU computes natively: bf16 and fp16 matrix math, from torch's capability flags.

On x86, bf16 matrix math is native with AVX512-BF16 or AMX-BF16, fp16 with AMX-FP16; without
them (most AVX2 machines: AMD Zen 2/3, older Intel) torch emulates both and a bf16 matmul runs
about 100x slower than fp32. AVX512-FP16 alone speeds up fp16 matmuls but not torch's fp16
convolutions (a small CNN measured 0.01x of fp32 on a Sapphire Rapids-class Xeon), so it does
not count. On aarch64 the ``bf16`` and ``fphp``/``asimdhp``
features play the same part. torch's dispatch capability (``ATEN_CPU_CAPABILITY``) below
AVX512 means the AVX512 kernels are not used, so those flags then count for nothing.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

__all__ = ["cpu_features", "cpu_native_dtypes", "cpu_summary", "missing_cpu_features"]

#: Any one of these makes the dtype native, per architecture.
_NATIVE = {
    "x86": {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("amx_fp16",)},
    "arm": {torch.bfloat16: ("bf16",), torch.float16: ("asimdhp",)},
}


def _arch() -> str:
    machine = platform.machine().lower()
    return "arm" if machine.startswith(("aarch64", "arm")) else "x86"


def _proc_cpuinfo_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


@functools.lru_cache(maxsize=1)
def cpu_features() -> frozenset[str]:
    """Feature flags of this CPU that torch can use (lower case, e.g. ``avx2``, ``amx_bf16``)."""
    flags: set[str] = set()
    query = getattr(torch.cpu, "get_capabilities", None)  # torch >= 2.12
    if callable(query):
        try:
            flags = {str(k).lower() for k, v in query().items() if v is True}
        except Exception:  # noqa: BLE001 - fall back to the OS's view
            flags = set()
    flags |= _proc_cpuinfo_flags()
    if _arch() == "x86" and torch.backends.cpu.get_cpu_capability() not in ("AVX512",):
        flags -= {f for names in _NATIVE["x86"].values() for f in names}  # AVX512 kernels not in use
    return frozenset(flags)


def cpu_native_dtypes(features: frozenset[str] | None = None) -> tuple[torch.dtype, ...]:
    """The reduced-precision dtypes (of bf16, fp16) this CPU multiplies natively."""
    have = cpu_features() if features is None else features
    return tuple(d for d, names in _NATIVE[_arch()].items() if any(n in have for n in names))


def missing_cpu_features(dtype: torch.dtype) -> tuple[str, ...]:
    """The feature flags any one of which would make ``dtype`` native here."""
    return _NATIVE[_arch()].get(dtype, ())


def cpu_summary() -> str:
    """One line naming the CPU and what torch dispatches to, e.g. ``x86_64, AVX2 kernels``."""
    return f"{platform.machine() or 'unknown'}, {torch.backends.cpu.get_cpu_capability()} kernels"
