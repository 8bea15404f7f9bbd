"""A simulated Cambricon torch_mlu, on the simulated PrivateUse1 device (testing only).

What it keeps of the real torch_mlu (branch r2.4_develop; the files named are torch_mlu's):

- ``torch_mlu/__init__.py``: PrivateUse1 renamed "mlu", ``torch.mlu`` the device module;
- ``mlu/autocast_utils.py``: ``get_amp_supported_dtype()`` is [fp16, bf16] on every chip;
- ``mlu/__init__.py``: ``is_bf16_supported()`` is "device major >= 5" (MLU370: 3, MLU590: 5);
  visible devices from ``CN_VISIBLE_DEVICES``, else ``MLU_VISIBLE_DEVICES``;
- ``csrc/aten/operators/bang/amp_unscale.cpp``: the unscale op takes float32 and float16
  gradients only, at most INT32_MAX elements per tensor;
- ``csrc/aten/autocast_mode.cpp``: torch's (CUDA's) lists, ``binary_cross_entropy`` banned,
  ``norm`` and ``linalg_vector_norm`` in float32;
- ``mlu/amp/autocast_mode.py``, ``mlu/amp/grad_scaler.py``: deprecated wrappers of
  ``torch.autocast("mlu")`` and ``torch.amp.GradScaler("mlu")``.

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

from amp_backends.testing import simdevice  # noqa: E402

CHIPS = {"MLU370": (3, 0), "MLU590": (5, 0)}
_CHIP = os.environ.get("AMP_SIM_MLU_CHIP", "MLU590")
if _CHIP not in CHIPS:
    raise ImportError(f"AMP_SIM_MLU_CHIP={_CHIP!r}: the simulation knows {', '.join(CHIPS)}")


def _visible_count() -> int:
    for var in ("CN_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES"):  # the first one set wins
        value = os.environ.get(var)
        if value is not None:
            return len([v for v in value.split(",") if v.strip() != ""])
    return 0 if _MODE == "nodevice" else 1


class _MLUModule(simdevice._DeviceModule):
    def get_device_capability(self, device: object = None) -> tuple[int, int]:
        return CHIPS[_CHIP]

    def get_device_name(self, device: object = None) -> str:
        return _CHIP

    def is_bf16_supported(self) -> bool:
        return self.get_device_capability()[0] >= 5


mlu = simdevice.install(
    "mlu",
    bf16=CHIPS[_CHIP][0] >= 5,
    device_count=_visible_count(),
    fp32_extra=("norm", "linalg_vector_norm"),
    banned=("binary_cross_entropy",),
    unscale_dtypes=(torch.float32, torch.float16),
    unscale_max_elements=int(os.environ.get("AMP_SIM_MLU_MAX_ELEMENTS", 2**31 - 1)),
    unscale_message="Currently amp_unscale only support float32 and float16 dtype",
    module_class=_MLUModule,
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
