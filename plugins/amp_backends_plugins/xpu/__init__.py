"""Intel GPU backend (``xpu``, in torch itself since 2.4): fp16 and bf16 autocast, the scaler's
float32 path on GPUs without float64 (Arc), XCCL or oneCCL process groups.

Checked against torch's ``torch/xpu/__init__.py`` (``_is_compiled``, ``is_available``, ``device_count``,
``is_bf16_supported(including_emulation)``, ``get_device_properties(i).has_fp64``),
``torch/amp/autocast_mode.py`` (xpu accepts float16 and bfloat16) and
``torch/distributed/distributed_c10d.py`` (``is_xccl_available``, ``Backend.default_device_backend_map``).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from amp_backends import Backend, ComputedMapping, hookimpl
from amp_backends.devices import collectives as collective_libraries
from amp_backends.devices import autocast_lists
from amp_backends.devices.fused import HONOURS

__all__ = ["XPUBackend"]

#: Variables that choose which Intel GPUs are visible (oneAPI Level Zero, the SYCL runtime).
VISIBLE = ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR")
#: torch-xpu-ops' fused optimizer kernels, by the torch release that pins them (its ``release/X.Y``
#: branches: ``yaml/native/native_functions.yaml`` dispatches them to XPU): Adam, AdamW and SGD from 2.6
#: (``src/ATen/native/xpu/sycl/FusedAdamUtils.h``, ``FusedSgdKernels.cpp``), Adagrad from 2.13
#: (``FusedAdagradKernels.cpp``). Each returns when found_inf is 1 and divides the gradients by grad_scale.
FUSED_SINCE = {"adam": (2, 6), "adamw": (2, 6), "sgd": (2, 6), "adagrad": (2, 13)}
_FUSED_SOURCE = {"adam": "sycl/FusedAdamUtils.h", "adamw": "sycl/FusedAdamUtils.h", "sgd": "sycl/FusedSgdKernels.cpp",
                 "adagrad": "sycl/FusedAdagradKernels.cpp"}
#: The first torch with a native XPU ``_scaled_mm`` (oneDNN, ``aten/src/ATen/native/mkldnn/xpu/ScaledBlas.cpp``
#: ``_scaled_mm_out_xpu``: tensorwise and rowwise scales, e4m3fn and e5m2; pytorch PRs 165978 and 166056).
#: torch 2.5 to 2.9 list ``_scaled_mm`` in torch-xpu-ops' CPU fallback (``XPUFallback.template``).
FP8_TORCH = (2, 10)


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _module() -> Any:
    return getattr(torch, "xpu", None)


def fused_kernels() -> dict[str, tuple[str, str]]:
    """The fused kernels this torch's XPU build has (:data:`FUSED_SINCE`), read from torch-xpu-ops'
    source (not run on an Intel GPU here); on an older torch each kind is probed on the device."""
    release = _torch_release()
    return {kind: (HONOURS, f"torch-xpu-ops' fused kernel (src/ATen/native/xpu/{_FUSED_SOURCE[kind]}, torch "
                            f"{since[0]}.{since[1]}+) skips when found_inf is 1 and divides by grad_scale")
            for kind, since in FUSED_SINCE.items() if release >= since}


class XPUBackend(Backend):
    """Mixed precision on Intel GPUs through ``torch.autocast("xpu")``."""

    name = "xpu"
    device_type = "xpu"
    default_dtype = torch.float16
    priority = 100
    #: torch's XPU lists (aten/src/ATen/autocast_mode.cpp, XPU block): CUDA's macros without the cuDNN
    #: convolutions; binary_cross_entropy banned, so a precision policy runs nn.BCELoss in float32
    autocast_lists = autocast_lists.XPU
    #: What the fused optimizer kernels do with found_inf and grad_scale (:func:`fused_kernels`: it depends on
    #: the torch release, so it is computed when read)
    fused_found_inf = ComputedMapping(fused_kernels)

    def unavailable_reason(self) -> str | None:
        xpu = _module()
        if xpu is None or not callable(getattr(xpu, "is_available", None)):
            return (f"torch {torch.__version__} has no torch.xpu (Intel GPUs need torch 2.4+ built for XPU: "
                    "pip install torch --index-url https://download.pytorch.org/whl/xpu)")
        compiled = getattr(xpu, "_is_compiled", None)
        if callable(compiled) and not compiled():
            return (f"torch {torch.__version__} is not built for XPU: install an XPU build "
                    "(pip install torch --index-url https://download.pytorch.org/whl/xpu)")
        try:
            count = int(xpu.device_count())
            available = bool(xpu.is_available())
        except Exception as exc:  # noqa: BLE001 - a broken driver is a reason, not a crash
            return f"the XPU runtime failed to start: {type(exc).__name__}: {exc}"
        if count == 0 or not available:
            set_vars = [f"{v}={os.environ[v]!r}" for v in VISIBLE if v in os.environ]
            hint = f" ({', '.join(set_vars)} decides which are visible)" if set_vars else ""
            return f"no Intel GPU visible: torch.xpu.device_count() is 0{hint}; check the driver with xpu-smi"
        return None

    def fp8_dtypes(self) -> tuple[torch.dtype, ...]:
        """From torch 2.10 (:data:`FP8_TORCH`): e4m3fn and e5m2 operands, tensorwise or rowwise scales
        (both operands alike, which torchao's recipes give). torch gates no GPU generation; oneDNN runs
        it per GPU. Read from torch's source; not run on an Intel GPU."""
        if not self.is_available() or _torch_release() < FP8_TORCH:
            return ()
        return (torch.float8_e4m3fn, torch.float8_e5m2)

    def fp8_unavailable_reason(self) -> str | None:
        if not self.is_available() or self.fp8_dtypes():
            return None
        return (f"has no fp8 matmul on the GPU in torch {torch.__version__}: torch's native XPU _scaled_mm came in "
                "torch 2.10 (torch 2.5 to 2.9 run it on the CPU through torch-xpu-ops' fallback, XPUFallback.template)"
                ": upgrade torch")

    def _bf16(self, emulation: bool) -> bool:
        query = getattr(_module(), "is_bf16_supported", None)
        if not callable(query):
            return False
        try:
            return bool(query(including_emulation=emulation))
        except TypeError:  # torch before including_emulation
            return bool(query())

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if not self.is_available():
            return (torch.float16,)
        return (torch.float16, torch.bfloat16) if self._bf16(True) else (torch.float16,)

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        supported = self.supported_dtypes()
        return supported if self._bf16(False) else tuple(d for d in supported if d != torch.bfloat16)

    def emulation_reason(self, dtype: torch.dtype) -> str:
        return f"{self.describe()} reports no native bf16 (torch.xpu.is_bf16_supported(including_emulation=False))"

    @property
    def has_fp64(self) -> bool:  # type: ignore[override]  # a class attribute of the contract, a property here
        """Per device: Arc GPUs have no float64 (torch issue 147731); the scaler then computes
        1/scale in float32."""
        if not self.is_available():
            return True
        try:
            props = _module().get_device_properties(_module().current_device())
        except Exception:  # noqa: BLE001 - unknown: float32, which every device has, is the safe answer
            return False
        return bool(getattr(props, "has_fp64", True))

    dist_install_hint = ("use a torch XPU build with XCCL (torch.distributed.is_xccl_available()), or install "
                         "oneCCL's bindings (pip install oneccl_bind_pt, from Intel's index for your torch)")

    collectives = collective_libraries.XCCL  # oneCCL's, through XCCL or the ccl bindings: torch-xpu-ops src/xccl/xccl.h

    @property
    def dist_backend(self) -> str:  # type: ignore[override]  # a class attribute of the contract, a property here
        """XCCL where torch has it (``is_xccl_available()``), else oneCCL's ``ccl`` where its bindings
        are installed; else none (gloo reduces cpu and cuda tensors only, never xpu ones)."""
        import torch.distributed as dist

        xccl = getattr(dist, "is_xccl_available", None)
        if callable(xccl) and xccl():
            return "xccl"
        if importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None:
            return "ccl"
        return ""

    def describe(self) -> str | None:
        if not self.is_available():
            return None
        xpu = _module()
        try:
            name = xpu.get_device_name(xpu.current_device()) or "Intel GPU (no name reported)"
        except Exception as exc:  # noqa: BLE001 - a failing name query costs only the name
            name = f"Intel GPU (name unavailable: {type(exc).__name__})"
        fp64 = "" if self.has_fp64 else ", no float64"
        return f"{name} (torch.xpu, {xpu.device_count()} device(s){fp64})"


@hookimpl
def amp_backends_register_backends(register) -> None:
    register(XPUBackend())
