"""What the CPU computes natively: bf16 and fp16 matrix math, from its feature flags and oneDNN's ceiling.

On x86, bf16 matrix math is native with AVX512-BF16 or AMX-BF16, fp16 with AMX-FP16; without
them (most AVX2 machines: AMD Zen 2/3, older Intel) torch emulates both and a bf16 matmul runs
about 100x slower than fp32. AVX512-FP16 alone speeds up fp16 matmuls but not torch's fp16
convolutions (a small CNN measured 0.01x of fp32 on a Sapphire Rapids-class Xeon), so it does
not count. On aarch64 the ``bf16`` and ``fphp``/``asimdhp``
features play the same part. torch runs bf16 and fp16 matmuls and convolutions through oneDNN, which
uses only what its own ceiling allows (``ONEDNN_MAX_CPU_ISA``, or ``DNNL_MAX_CPU_ISA``): below
AVX512_CORE_BF16 neither flag counts (a bf16 matmul then runs 30-500x slower than fp32), below
AVX512_CORE_AMX the AMX ones do not; with oneDNN off (``torch.backends.mkldnn.enabled = False``)
nothing is native on x86. torch's own dispatch capability (``ATEN_CPU_CAPABILITY``) does not reach
oneDNN's kernels and does not count.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

__all__ = ["cpu_features", "cpu_native_dtypes", "cpu_summary", "missing_cpu_features", "onednn_blocker",
           "onednn_isa_cap"]

#: Any one of these makes the dtype native, per architecture.
_NATIVE = {
    "x86": {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("amx_fp16",)},
    "arm": {torch.bfloat16: ("bf16",), torch.float16: ("asimdhp",)},
}


#: oneDNN's ISA ceilings (``dnnl_cpu_isa_t``: each a bit mask holding the ones below it), by the names
#: ``ONEDNN_MAX_CPU_ISA`` takes.
_ONEDNN_ISA = {
    "SSE41": 0x1, "AVX": 0x3, "AVX2": 0x7, "AVX2_VNNI": 0xF, "AVX2_VNNI_2": 0x1F, "AVX512_CORE": 0x27,
    "AVX512_CORE_VNNI": 0x67, "AVX512_CORE_BF16": 0xE7, "AVX512_CORE_FP16": 0x1EF, "AVX10_1_512": 0x1EF,
    "AVX512_CORE_AMX": 0xFEF, "AVX10_1_512_AMX": 0xFEF, "AVX512_CORE_AMX_FP16": 0x1FEF, "AVX10_1_512_AMX_FP16": 0x1FEF,
}
#: The ceiling each native x86 flag needs oneDNN to allow.
_ONEDNN_NEEDS = {"avx512_bf16": 0xE7, "amx_bf16": 0xFEF, "amx_fp16": 0x1FEF}


def onednn_isa_cap() -> str | None:
    """The ISA ceiling set for oneDNN in this process's environment (upper case), or None: none set, or
    a name that sets none (``ALL``, ``DEFAULT``, one oneDNN does not know)."""
    import os

    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # oneDNN reads them in this order
        value = os.environ.get(var, "").strip().upper()
        if value:
            return value if value in _ONEDNN_ISA else None
    return None


def _onednn_on() -> bool:
    backend = torch.backends.mkldnn
    return bool(backend.is_available() and backend.enabled)


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
    cap = onednn_isa_cap()
    if _arch() == "x86" and cap is not None:  # oneDNN's kernels for these flags not in use
        flags -= {f for f, need in _ONEDNN_NEEDS.items() if _ONEDNN_ISA[cap] & need != need}
    return frozenset(flags)


def cpu_native_dtypes(features: frozenset[str] | None = None) -> tuple[torch.dtype, ...]:
    """The reduced-precision dtypes (of bf16, fp16) this CPU multiplies natively."""
    have = cpu_features() if features is None else features
    if _arch() == "x86" and not _onednn_on():
        return ()  # ATen's own bf16/fp16 matmul kernels emulate
    return tuple(d for d, names in _NATIVE[_arch()].items() if any(n in have for n in names))


def onednn_blocker(dtype: torch.dtype) -> str | None:
    """Why ``dtype`` is emulated on an x86 CPU that has a flag for it (oneDNN off, or capped below the
    flag), with the way out; None where that is not why."""
    names = _NATIVE["x86"].get(dtype, ())
    if _arch() != "x86" or not names or not any(n in _proc_cpuinfo_flags() for n in names):
        return None
    if not _onednn_on():
        return ("torch's oneDNN is off here (torch.backends.mkldnn.enabled is False, or torch built without it); "
                "leave it on for native bf16/fp16 matmuls")
    cap = onednn_isa_cap()
    if cap is not None and not any(n in cpu_features() for n in names):
        return (f"oneDNN is capped at {cap} (ONEDNN_MAX_CPU_ISA/DNNL_MAX_CPU_ISA), below this CPU's "
                f"{' or '.join(n.upper() for n in names if n in _proc_cpuinfo_flags())}: unset it")
    return None


def missing_cpu_features(dtype: torch.dtype) -> tuple[str, ...]:
    """The feature flags any one of which would make ``dtype`` native here."""
    return _NATIVE[_arch()].get(dtype, ())


def cpu_summary() -> str:
    """One line naming the CPU and what torch dispatches to, e.g. ``x86_64, AVX2 kernels``."""
    line = f"{platform.machine() or 'unknown'}, {torch.backends.cpu.get_cpu_capability()} kernels"
    if _arch() != "x86":
        return line
    if not _onednn_on():
        return f"{line}, oneDNN off"
    cap = onednn_isa_cap()
    return line if cap is None else f"{line}, oneDNN up to {cap}"
