"""A simulated Cambricon torch_mlu, on the simulated PrivateUse1 device (testing only).

What it keeps of the real torch_mlu (branch r2.4_develop; the files named are torch_mlu's):

- ``torch_mlu/__init__.py``: PrivateUse1 renamed "mlu", ``torch.mlu`` the device module;
- ``mlu/autocast_utils.py``: ``get_amp_supported_dtype()`` is [fp16, bf16] on every chip;
- ``mlu/__init__.py``: ``is_bf16_supported()`` is "device major >= 5" (MLU370: 3, MLU590: 5);
  ``_parse_visible_devices``: ``CN_VISIBLE_DEVICES``, else ``MLU_VISIBLE_DEVICES``, else
  ``CUDA_VISIBLE_DEVICES`` (master), a repeated entry giving no devices and a negative or
  non-numeric one ending the list; ``AMP_SIM_MLU_DEVICES`` sets how many the machine has;
- ``csrc/aten/operators/bang/amp_unscale.cpp``: the unscale op takes float32 and float16
  gradients only, at most INT32_MAX elements per tensor, with the op's own error texts;
- ``csrc/aten/autocast_mode.cpp``: torch's (CUDA's) lists, ``binary_cross_entropy`` banned,
  ``norm`` and ``linalg_vector_norm`` in float32;
- ``mlu/amp/autocast_mode.py``, ``mlu/amp/grad_scaler.py``: deprecated wrappers of
  ``torch.autocast("mlu")`` and ``torch.amp.GradScaler("mlu")``;
- ``codegen/mlu_functions.yaml``: ``_fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_`` have MLU kernels
  (the simulation runs torch's, which skip and divide as the BANG kernels do); no ``_fused_adagrad_``
  and no ``_scaled_mm``: ``csrc/aten/MLUFallback.cpp`` runs them on the CPU after its warning
  (``mlu_fallback``, on by default; ``ENABLE_FALLBACK_TO_CPU=0``/``OFF``/``off`` turns it off, and the
  op raises ``mlu_disable_fallback``'s NotImplementedError). On the CPU, fused Adagrad runs torch's
  kernel; ``_scaled_mm`` fails, as torch 2.4 (what torch_mlu r2.4 is built for) has no CPU kernel for it.

``AMP_SIM_MLU_CHIP`` = ``MLU590`` (default: bf16) or ``MLU370`` (fp16 only).
``AMP_SIM_MLU`` = ``broken`` (installed, fails to import: a driver library missing) or
``nodevice`` (imports, no device visible). ``AMP_SIM_MLU_MAX_ELEMENTS`` lowers the unscale
op's size limit so tests can reach it.
"""

from __future__ import annotations

import os
import warnings

import torch

_MODE = os.environ.get("AMP_SIM_MLU", "new")
if _MODE == "broken":
    raise ImportError("libcnnl.so: cannot open shared object file: No such file or directory")

from amp_backends.testing import simdevice  # noqa: E402 - after the module's own setup, as torch_mlu imports

CHIPS = {"MLU370": (3, 0), "MLU590": (5, 0)}
_CHIP = os.environ.get("AMP_SIM_MLU_CHIP", "MLU590")
if _CHIP not in CHIPS:
    raise ImportError(f"AMP_SIM_MLU_CHIP={_CHIP!r}: the simulation knows {', '.join(CHIPS)}")


#: Devices the simulated machine has (``AMP_SIM_MLU_DEVICES``, default 1; 0 with ``nodevice``).
_PHYSICAL = 0 if _MODE == "nodevice" else int(os.environ.get("AMP_SIM_MLU_DEVICES", "1"))


def _parse_visible_devices() -> list[int] | list[str]:
    """torch_mlu ``mlu/__init__.py`` ``_parse_visible_devices``: ``CN_VISIBLE_DEVICES``, else
    ``MLU_VISIBLE_DEVICES``, else ``CUDA_VISIBLE_DEVICES``; a repeated entry gives no devices; an
    entry that is not a non-negative ordinal ends the list; UUIDs (36+ characters with '-') are
    taken up to the first entry without '-'."""
    var = next((os.environ[v] for v in ("CN_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
                if v in os.environ), None)
    if var is None:
        return list(range(64))
    if "-" in var and len(var) >= 36:
        uuids: list[str] = []
        for elem in var.split(","):
            if elem in uuids:
                return []
            if "-" not in elem:
                break
            uuids.append(elem)
        return uuids
    ordinals: list[int] = []
    for elem in var.split(","):
        elem = elem.strip()
        x = int(elem) if elem.isdigit() else -1
        if x in ordinals:
            return []
        if x < 0:
            break
        ordinals.append(x)
    return ordinals


def _visible_count() -> int:
    """``_device_count_cndev``: the visible ordinals, cut at the first one the machine lacks."""
    visible = _parse_visible_devices()
    if visible and isinstance(visible[0], str):
        return 0  # the simulated devices have no UUIDs: none matches
    for i, ordinal in enumerate(visible):
        if ordinal >= _PHYSICAL:
            return i
    return len(visible)


class _MLUModule(simdevice._DeviceModule):
    def get_device_capability(self, device: object = None) -> tuple[int, int]:
        return CHIPS[_CHIP]

    def get_device_name(self, device: object = None) -> str:
        return _CHIP

    def is_bf16_supported(self) -> bool:
        return self.get_device_capability()[0] >= 5


#: csrc/aten/MLUFallback.cpp getFallbackEnabledEnvVar: read once, when torch_mlu loads.
CPU_FALLBACK = os.environ.get("ENABLE_FALLBACK_TO_CPU") not in ("0", "OFF", "off")
_FALLBACK_WARNING = ("The operator '{op}' is not currently supported on the MLU backend and will fall back to run on "
                     "the CPU. This may have performance implications.")


def _disabled(qualified: str) -> NotImplementedError:
    """``mlu_disable_fallback``: an op without an MLU kernel, the CPU fallback off."""
    return NotImplementedError(
        f"The operator 'aten::{qualified}' is not currently implemented for the MLU device. If you want this op to be "
        "added, please contact the engineer of Cambricon. As a temporary fix, you can set the environment variable "
        "`ENABLE_FALLBACK_TO_CPU=1` to use the CPU as a fallback for this op. WARNING: this will be slower than "
        "running natively on MLU.")


def _no_kernel(qualified: str):  # type: ignore[no-untyped-def]
    return simdevice.host_fallback(qualified, _FALLBACK_WARNING, None if CPU_FALLBACK else _disabled(qualified))


def _no_cpu_kernel_either(qualified: str):  # type: ignore[no-untyped-def]
    """An op torch_mlu has no kernel for and torch 2.4 has no CPU kernel for: the fallback warns, then
    the CPU dispatch fails (torch 2.4's dispatcher error)."""
    def kernel(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not CPU_FALLBACK:
            raise _disabled(qualified)
        warnings.warn(_FALLBACK_WARNING.format(op=f"aten::{qualified}"), UserWarning, stacklevel=2)
        raise NotImplementedError(
            f"Could not run 'aten::{qualified.split('.')[0]}' with arguments from the 'CPU' backend. This could be "
            "because the operator doesn't exist for this backend, or was omitted during the selective/custom build "
            "process (if using custom build).")

    return kernel


mlu = simdevice.install(
    "mlu",
    bf16=CHIPS[_CHIP][0] >= 5,
    device_count=_visible_count(),
    fp32_extra=("norm", "linalg_vector_norm"),
    banned=("binary_cross_entropy",),
    unscale_dtypes=(torch.float32, torch.float16),
    unscale_max_elements=int(os.environ.get("AMP_SIM_MLU_MAX_ELEMENTS", 2**31 - 1)),
    unscale_message="Currently amp_unscale only support float32 and float16 dtype, not implemented for {dtype}",
    unscale_large_message="Not implemented large tensor.",
    module_class=_MLUModule,
    kernels={**{q: _no_kernel(q) for q in ("_fused_adagrad_", "_fused_adagrad_.tensor_lr")},
             **{q: _no_cpu_kernel_either(q) for q in ("_scaled_mm", "_scaled_mm.out")}},
)


class _DeprecatedAutocast(torch.amp.autocast_mode.autocast):
    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True) -> None:
        warnings.warn(
            "torch.mlu.amp.autocast(args...) is deprecated. Please use torch.amp.autocast('mlu', args...) instead.",
            FutureWarning,
            stacklevel=2,
        )
        super().__init__("mlu", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


class _DeprecatedGradScaler(torch.amp.GradScaler):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        warnings.warn(
            "torch.mlu.amp.GradScaler(args...) is deprecated. Please use torch.amp.GradScaler('mlu', args...) instead.",
            FutureWarning,
            stacklevel=2,
        )
        super().__init__("mlu", *args, **kwargs)


class _Amp:
    autocast = _DeprecatedAutocast
    GradScaler = _DeprecatedGradScaler


mlu.amp = _Amp()  # type: ignore[attr-defined]
__version__ = "1.24.0-torch2.4.0"
