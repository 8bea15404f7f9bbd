"""CUDA backend (NVIDIA, and AMD through ROCm builds of torch): fp16 by default, bf16 where supported, NCCL.

On ROCm builds of torch the device type is ``cuda`` too (``torch.version.hip`` is set): ``info``
names the ROCm release and the GPU architecture (``gcnArchName``), bf16 is judged native by AMD
architecture, and RCCL serves the "nccl" process-group backend. A Triton kernel is adopted on
ROCm only after the same self-check as on NVIDIA (the registry runs it for every device).
"""

from __future__ import annotations

import os

import torch

from amp_backends import Backend, ComputedMapping, hookimpl
from amp_backends.devices import collectives as collective_libraries
from amp_backends.devices import autocast_lists
from amp_backends.devices.fused import HONOURS


def fused_kernels() -> dict[str, tuple[str, str]]:
    """torch's CUDA kernels (``FusedAdamKernel.cu``, ``FusedSgdKernel.cu``; Adagrad:
    ``fused_adagrad_utils.cuh`` ``FusedAdagradMathFunctor``): the functors return when found_inf
    is 1 and divide each gradient by grad_scale; ROCm builds compile the same sources (hipified).
    torch 2.13 enables ``Adagrad(fused=True)`` on CUDA (``torch/optim/adagrad.py`` calls
    ``_device_dtype_check_for_fused(p)`` without ``cuda_unsupported``); an earlier torch refuses it
    itself, so there Adagrad is left to the probe. Read from torch's source, not run on a GPU here."""
    declared = {kind: (HONOURS, "torch's CUDA fused kernels skip when found_inf is 1 and divide by grad_scale "
                                "(aten/src/ATen/native/cuda/FusedAdamKernel.cu, FusedSgdKernel.cu)")
                for kind in ("adam", "adamw", "sgd")}
    if torch_release() >= (2, 13):
        declared["adagrad"] = (HONOURS, "torch's CUDA _fused_adagrad_ returns when found_inf is 1 and divides by "
                                        "grad_scale (aten/src/ATen/native/cuda/fused_adagrad_utils.cuh)")
    return declared


class CUDABackend(Backend):
    """Mixed precision on CUDA devices through ``torch.autocast("cuda")``."""

    name = "cuda"
    device_type = "cuda"
    default_dtype = torch.float16
    dist_backend = "nccl"
    collectives = collective_libraries.NCCL  # NCCL's (RCCL's on ROCm): ProcessGroupNCCL.cpp getNcclDataType/getNcclReduceOp
    priority = 100
    #: torch's CUDA unscale op (aten/src/ATen/native/cuda/AmpKernels.cu) dispatches on float,
    #: double and half only: bf16 gradients go through a float32 copy unless the kernel (Triton)
    #: handles them itself.
    unscale_dtypes = (torch.float32, torch.float16, torch.float64)
    #: torch's CUDA lists (aten/src/ATen/autocast_mode.cpp), which ban binary_cross_entropy: a policy runs
    #: nn.BCELoss in float32
    autocast_lists = autocast_lists.CUDA
    #: What the fused optimizer kernels do with found_inf and grad_scale (:func:`fused_kernels`: it depends on
    #: the torch release, so it is computed when read)
    fused_found_inf = ComputedMapping(fused_kernels)

    def unavailable_reason(self) -> str | None:
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return (
                f"torch was built without CUDA or ROCm (torch {torch.__version__}); "
                "install a CUDA build of torch for NVIDIA GPUs, or a ROCm build for AMD GPUs"
            )
        try:
            count = torch.cuda.device_count()
        except Exception as exc:  # noqa: BLE001 - a broken driver is a reason, not a crash
            return f"the CUDA runtime failed to start: {type(exc).__name__}: {exc}"
        if count == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hint = f" (CUDA_VISIBLE_DEVICES={visible!r} hides the others)" if visible is not None else ""
            return f"no CUDA device visible: the driver reports 0 devices{hint}"
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False although devices are counted; check the driver"
        return None

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        if not self.is_available():
            return (torch.float16,)
        # what torch's autocast accepts (emulated bf16 too: a V100 or T4 runs it, slowly, and
        # native_dtypes says so, which warns)
        bf16 = torch.cuda.is_bf16_supported()
        return (torch.float16, torch.bfloat16) if bf16 else (torch.float16,)

    def native_dtypes(self) -> tuple[torch.dtype, ...]:
        supported = self.supported_dtypes()
        if torch.bfloat16 not in supported:
            return supported
        if rocm_version() is not None:  # AMD: by architecture, not by NVIDIA compute capability
            return supported if amd_bf16_native(gcn_arch()) else (torch.float16,)
        major, _ = torch.cuda.get_device_capability()
        return supported if major >= 8 else (torch.float16,)  # bf16 tensor cores from Ampere (8.0)

    def emulation_reason(self, dtype: torch.dtype) -> str:
        if rocm_version() is not None:
            return (f"{torch.cuda.get_device_name()} ({gcn_arch() or 'unknown architecture'}) has no bf16 matrix "
                    "cores (gfx908 / MI100 and newer CDNA, and RDNA 3/4, have)")
        major, minor = torch.cuda.get_device_capability()
        return f"{torch.cuda.get_device_name()} (compute capability {major}.{minor}) has no bf16 tensor cores (8.0+)"

    def fp8_dtypes(self) -> tuple[torch.dtype, ...]:
        """fp8 matmuls (``torch._scaled_mm``): NVIDIA from compute capability 8.9 (Ada, Hopper,
        Blackwell) in the OCP formats; AMD by architecture and the ROCm release torch is built with
        (:func:`rocm_fp8_dtypes`). Read from torch's source (``_scaled_mm_allowed_device``), not run
        on a GPU here."""
        if not self.is_available() or not hasattr(torch, "float8_e4m3fn"):
            return ()
        if rocm_version() is not None:
            return rocm_fp8_dtypes(gcn_arch(), rocm_version())
        return (torch.float8_e4m3fn, torch.float8_e5m2) if torch.cuda.get_device_capability() >= (8, 9) else ()

    def fp8_recipes(self) -> tuple[str, ...]:
        """All three on NVIDIA (torch's rowwise kernels exist for sm89, sm9x and sm10x); on ROCm,
        rowwise through hipBLASLt from torch 2.7 (pytorch PR 144432 landed after the 2.6 branch cut;
        2.6 has it only in AMD's fork, ROCm/pytorch PR 1920), tensorwise before."""
        from amp_backends.precision.fp8.engine import RECIPES

        if not self.fp8_dtypes():
            return ()
        if rocm_version() is not None and torch_release() < ROCM_ROWWISE_TORCH:
            return ("tensorwise",)
        return RECIPES

    def fp8_unavailable_reason(self) -> str | None:
        """Why this GPU runs no fp8 matmul through torch (None where it does)."""
        if not self.is_available() or self.fp8_dtypes():
            return None
        if rocm_version() is None:
            major, minor = torch.cuda.get_device_capability()
            return (f"has no fp8 matmul: compute capability {major}.{minor}; torch's _scaled_mm needs 8.9+ "
                    "(_scaled_mm_allowed_device)")
        return "has no fp8 matmul through torch: " + rocm_fp8_refusal(gcn_arch(), rocm_version())

    def mx_formats(self) -> tuple[str, ...]:
        """MXFP8 where the chip's matmuls take it and the installed torchao runs its MX layer's real
        kernels: NVIDIA compute capability 10.x (torch's ``_scaled_mm`` with e8m0 block scales needs
        sm100; torchao 0.18's MX casts need capability 10.0+ and CUDA 12.8+); AMD gfx950 (MI350/MI355)
        only where torchao's MX cast kernels load on ROCm (:func:`amp_backends.precision.fp8.engine.mx_kernels_reason`).
        Read from torch's and torchao's sources, not run on such a GPU here."""
        return ("mxfp8",) if self.is_available() and self.mx_unavailable_reason() is None else ()

    def mx_unavailable_reason(self) -> str | None:
        """Why this GPU, or the installed torch and torchao, cannot train in MXFP8 (None where it can)."""
        if not self.is_available():
            return None
        if rocm_version() is not None:
            arch = gcn_arch() or "unknown architecture"
            if not arch.startswith("gfx950"):
                return (f"has no MXFP8 matmul: {torch.cuda.get_device_name()} is {arch}; AMD's MX matmuls are on "
                        "gfx950 (MI350/MI355)")
        else:
            major, minor = torch.cuda.get_device_capability()
            if major != 10:
                return (f"has no MXFP8 matmul: compute capability {major}.{minor}; torch's _scaled_mm takes e8m0 "
                        "block scales on 10.x (B200, GB200, B300)")
        from amp_backends.precision.fp8.engine import mx_kernels_reason

        why = mx_kernels_reason()
        return None if why is None else f"cannot run torchao's MXFP8 layer: {why}"

    def describe(self) -> str | None:
        """"NVIDIA H100 (CUDA 12.8, compute capability 9.0)" or "AMD Instinct MI300X (ROCm 6.2, gfx942)"."""
        if not self.is_available():
            return None
        name = torch.cuda.get_device_name()
        hip = rocm_version()
        if hip is not None:
            return f"{name} (ROCm {hip}, {gcn_arch() or 'unknown architecture'})"
        major, minor = torch.cuda.get_device_capability()
        return f"{name} (CUDA {torch.version.cuda}, compute capability {major}.{minor})"


#: The first torch release whose ROCm builds have hipBLASLt rowwise fp8 (pytorch PR 144432).
ROCM_ROWWISE_TORCH = (2, 7)
#: AMD architectures whose matmuls take OCP fp8 in torch's ``_scaled_mm``, and the ROCm release torch
#: must be built with: ``_scaled_mm_allowed_device`` (aten/src/ATen/native/cuda/ScaledBlas.cpp)
#: admits gfx1200/gfx1201 from ROCM_VERSION 6.3 and gfx950 from 6.5, and ``_scaled_mm_out_cuda``
#: refuses Float8_e4m3fn/Float8_e5m2 below ROCm 6.5 ("only supported for ROCm 6.5 and above";
#: pytorch PR 193831 says the same of gfx120x), so both are declared from 6.5.
ROCM_OCP_FP8 = {"gfx950": (6, 5), "gfx1200": (6, 5), "gfx1201": (6, 5)}


def torch_release() -> tuple[int, int]:
    """This torch's (major, minor)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _release(version: str | None) -> tuple[int, int]:
    parts = [int(p) for p in (version or "0.0").split(".")[:2] if p.isdigit()]
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def rocm_fp8_dtypes(arch: str | None, rocm: str | None) -> tuple[torch.dtype, ...]:
    """gfx942 (MI300): the fnuz formats (``_scaled_mm_is_fnuz``); gfx950 (MI350) and gfx1200/gfx1201
    (Radeon RX 9000) on ROCm 6.5+: the OCP formats; others none."""
    if arch == "gfx942":
        return (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
    needed = ROCM_OCP_FP8.get(arch or "")
    if needed is not None and _release(rocm) >= needed:
        return (torch.float8_e4m3fn, torch.float8_e5m2)
    return ()


def rocm_fp8_refusal(arch: str | None, rocm: str | None) -> str:
    needed = ROCM_OCP_FP8.get(arch or "")
    if needed is not None:
        return (f"{arch} takes OCP fp8, but this torch is built with ROCm {rocm}, and torch's _scaled_mm takes it "
                f"there from ROCm {needed[0]}.{needed[1]} (_scaled_mm_allowed_device, _scaled_mm_out_cuda): install a "
                f"ROCm {needed[0]}.{needed[1]}+ build of torch")
    return (f"{arch or 'this architecture'} is not among the AMD GPUs torch's _scaled_mm takes (gfx942; gfx950, "
            "gfx1200 and gfx1201 with ROCm 6.5+)")


def rocm_version() -> str | None:
    """The ROCm release of a ROCm build of torch ("6.2"), None on CUDA builds."""
    hip = getattr(torch.version, "hip", None)
    return ".".join(str(hip).split(".")[:2]) if hip else None


def gcn_arch(index: int | None = None) -> str | None:
    """The AMD GPU's architecture ("gfx942"), without target features (":sramecc+:xnack-")."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    arch = getattr(props, "gcnArchName", None)
    return str(arch).split(":")[0] if arch else None


def amd_bf16_native(arch: str | None) -> bool:
    """bf16 matrix math in hardware: CDNA 1 (gfx908, MI100: bf16 MFMA, 92.3 TFLOPS against 23.1 in
    fp32), CDNA 2 (gfx90a, MI200) and newer (gfx94x MI300, gfx95x MI350), and RDNA 3/4 (gfx11xx,
    gfx12xx, WMMA). Not gfx906 (MI50, no matrix cores) nor RDNA 1/2 (gfx10xx)."""
    if not arch or not arch.startswith("gfx"):
        return False
    digits = arch[3:]
    if digits[:2] in ("11", "12"):
        return True
    # CDNA: gfx908, gfx90a, gfx94x, gfx95x; not the GCN 5 APUs gfx909 (Raven 2) and gfx90c (Renoir)
    return digits[:3] in ("908", "90a") or (len(digits) >= 3 and digits[0] == "9" and digits[1] in "45")


@hookimpl
def amp_backends_register_backends(register) -> None:
    register(CUDABackend())
