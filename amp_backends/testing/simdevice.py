"""A simulated accelerator on PyTorch's PrivateUse1 key, in pure Python, for testing.

Every tensor on the simulated device is a plain ``torch.Tensor`` without data of its own;
its storage maps to a CPU tensor holding its values (:func:`raw_of`). A boxed fallback on
the PrivateUse1 key runs each ATen op on those CPU tensors and wraps the results. An
autocast policy registered from Python on the ``AutocastPrivateUse1`` key follows CUDA's
lists: matmul-like ops run in the autocast dtype, losses, reductions and numerically
sensitive ops in float32, the rest unchanged.

Known limit: a wrapper always reports contiguous strides; a view's data (``raw_of``) has
the view's real strides, and ops compute on that, so results are right, but
``.stride()``/``.is_contiguous()`` of a strided view on the device are not.

    from amp_backends.testing.simdevice import install
    install("mlu")                  # once per process: PrivateUse1 can be renamed once
    x = torch.randn(4, 4).to("mlu")

It is a test double for a device nobody here has: it checks that code is device-generic,
not how fast or how exactly a real device computes.
"""

from __future__ import annotations

import types
import warnings
from typing import Any

import torch

from ..torch_private import (accelerator_extension, dispatch_get_all_op_names, dispatch_has_kernel_for_dispatch_key,
                             storage_use_count, tree_leaves, tree_map)
from .simautocast import FP32_OPS, LOWER_PRECISION_OPS, PROMOTE_OPS, register_autocast

__all__ = ["raw_of", "install", "installed_name", "overflow_status", "clear_overflow_status",
           "LOWER_PRECISION_OPS", "FP32_OPS", "PROMOTE_OPS", "absent", "host_fallback", "ignoring_found_inf",
           "refusing", "scale_blind", "scaled_matmul"]

_STATE: dict[str, Any] = {"name": None, "libs": [], "saturation": False, "status": False,
                          "allocated": 0, "peak": 0, "fp32_cube_as": None}

#: The matrix (cube) ops a precision mode may run in a lower dtype than float32 (ATen names).
CUBE_OPS = frozenset(("mm", "addmm", "bmm", "baddbmm", "addbmm", "convolution", "_convolution", "conv1d", "conv2d",
                      "conv3d", "addmv", "mv", "dot"))


def set_fp32_cube_dtype(dtype: torch.dtype | None) -> None:
    """Run float32 matrix ops (:data:`CUBE_OPS`) in ``dtype`` on the device, results cast back to
    float32 (Ascend's ``ACL_PRECISION_MODE=allow_fp32_to_fp16``); None: in float32."""
    _STATE["fp32_cube_as"] = dtype


# storage address of a wrapper -> (CPU tensor with its data, the storage kept alive)
_RAWS: dict[int, tuple[torch.Tensor, Any]] = {}
_SWEEP_EVERY = 512
_since_sweep = 0


def _sweep() -> None:
    """Forget CPU data whose wrapper storage nothing but this registry holds any more."""
    use_count = storage_use_count
    for key in [k for k in _RAWS if use_count(k) <= 1]:
        raw = _RAWS.pop(key)[0]
        _STATE["allocated"] -= raw.numel() * raw.element_size()


def _wrap(raw: torch.Tensor) -> torch.Tensor:
    global _since_sweep
    out = accelerator_extension.create_empty_tensor(list(raw.shape), raw.dtype)
    storage = out.untyped_storage()
    _RAWS[storage._cdata] = (raw, storage)
    _STATE["allocated"] += raw.numel() * raw.element_size()
    _STATE["peak"] = max(_STATE["peak"], _STATE["allocated"])
    _since_sweep += 1
    if _since_sweep >= _SWEEP_EVERY:
        _since_sweep = 0
        _sweep()
    return out


def raw_of(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding the data of ``t``, a tensor on the simulated device.

    Keyed by the wrapper's storage, so autograd's shallow copies (saved tensors,
    ``.data``) find it too; writes to it are writes to the device tensor.
    """
    entry = _RAWS.get(t.untyped_storage()._cdata)
    if entry is None:
        raise RuntimeError(f"tensor on {t.device} has no simulated data: it was not made by the simulated device")
    return entry[0]


def _unwrap(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.device.type == _STATE["name"]:
        return raw_of(x)
    if isinstance(x, torch.device) and x.type == _STATE["name"]:
        return torch.device("cpu")
    if isinstance(x, str) and x.split(":")[0] == _STATE["name"]:
        return "cpu"
    return x


def _targets_device(kwargs: dict[str, Any]) -> bool | None:
    device = kwargs.get("device")
    if device is None:
        return None
    return torch.device(device).type == _STATE["name"]


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``op`` on the CPU tensors behind the wrappers and wrap what comes back."""
    by_raw: dict[int, torch.Tensor] = {}

    def unwrap(x: Any) -> Any:
        raw = _unwrap(x)
        if isinstance(x, torch.Tensor):
            by_raw[id(raw)] = x  # an op that returns an input returns the caller's tensor
        return raw

    to_device = _targets_device(kwargs)
    raw_args, raw_kwargs = tree_map(unwrap, (args, kwargs))
    dense: list[tuple[torch.Tensor, torch.Tensor]] = []
    if op._schema.name.startswith("aten::_fused_"):
        # torch's fused optimizer CPU kernels walk each tensor's memory as contiguous (a device's tensors
        # are, by autograd's layout contract); a wrapper's data may be a strided view: dense copies, written back
        def densify(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not x.is_contiguous():
                dense.append((x, x.contiguous()))
                return dense[-1][1]
            return x

        raw_args, raw_kwargs = tree_map(densify, (raw_args, raw_kwargs))
    low = _STATE["fp32_cube_as"]
    if low is not None and op._schema.name.split("::")[-1] in CUBE_OPS and _all_fp32(raw_args, raw_kwargs):
        result = op(*tree_map(lambda x: _cast(x, low), raw_args), **tree_map(lambda x: _cast(x, low), raw_kwargs))
        result = tree_map(lambda x: _cast(x, torch.float32), result)
    else:
        result = op(*raw_args, **raw_kwargs)
    for strided, copy in dense:
        strided.copy_(copy)
    if _STATE["saturation"] and to_device is not False:
        tree_map(_saturate, result)
    wrap_new = to_device if to_device is not None else True

    def wrap(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) in by_raw:  # an in-place op (or a copy into a CPU tensor) returned its input
                return by_raw[id(x)]
            if not wrap_new:
                return x
            if not x.is_contiguous() and not _aliases(x, raw_args, raw_kwargs):
                x = x.contiguous()  # wrappers are contiguous: make fresh outputs match
            return _wrap(x)
        return x

    return tree_map(wrap, result)


def _all_fp32(*inputs: Any) -> bool:
    floats = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return bool(floats) and all(t.dtype == torch.float32 for t in floats)


def _cast(x: Any, dtype: torch.dtype) -> Any:
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _saturate(x: Any) -> Any:
    """Saturation mode (Ascend chips without inf/NaN mode): an op's inf/NaN results become the
    largest finite values (NaN: 0) and set the device-wide overflow status."""
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() and not bool(torch.isfinite(x).all()):
        _STATE["status"] = True
        big = torch.finfo(x.dtype).max
        x.nan_to_num_(nan=0.0, posinf=big, neginf=-big)
    return x


def _kernel_for(qualified: str) -> Any:
    name, _, overload = qualified.partition(".")
    op = getattr(getattr(torch.ops.aten, name), overload or "default")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _fallback(op, *args, **kwargs)

    return kernel


def _aliases(out: torch.Tensor, *inputs: Any) -> bool:
    """Whether ``out`` shares memory with any tensor among ``inputs`` (a view, not a new result)."""
    if out.numel() == 0:
        return False
    ptr = out.untyped_storage().data_ptr()
    return any(
        isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() == ptr
        for t in tree_leaves(inputs)
    )


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    _unwrap(dst).copy_(_unwrap(src))
    return dst


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    source = _unwrap(src)
    _unwrap(dst).resize_(source.shape).copy_(source)
    return dst


# Explicit kernels of our own, and exact shallow copies: C++ makes those share the
# wrapper's storage, so :func:`raw_of` finds their data, and Parameter() needs a tensor
# with no Python object yet.
_NOT_INTERCEPTED = ("_copy_from", "_copy_from_and_resize", "detach", "alias", "lift_fresh")


def _intercepted_ops() -> list[str]:
    """ATen overloads that need an explicit PrivateUse1 kernel to reach :func:`_fallback`.

    CompositeExplicitAutograd(NonFunctional) kernels outrank a backend fallback: they
    would build views and outputs in C++ (without data behind them) or resize an output
    wrapper behind our back. Views with backend-only kernels (``view``, ``as_strided``)
    are included too. CompositeImplicit ops decompose into these and need nothing.
    """
    names = []
    has = dispatch_has_kernel_for_dispatch_key
    for qualified in dispatch_get_all_op_names():
        if not qualified.startswith("aten::") or has(qualified, "CompositeImplicitAutograd"):
            continue
        name, _, overload = qualified[len("aten::"):].partition(".")
        try:
            op = getattr(getattr(torch.ops.aten, name), overload or "default")
        except AttributeError:
            continue
        returns = op._schema.returns
        is_view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        composite = has(qualified, "CompositeExplicitAutograd") or has(
            qualified, "CompositeExplicitAutogradNonFunctional"
        )
        if (is_view or composite) and name not in _NOT_INTERCEPTED:
            names.append(qualified[len("aten::"):])
    return names


#: ATen's ScalarType names (c10 ``toString``), as the extensions' error texts print them.
_SCALAR_TYPE_NAMES = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16",
                      torch.float64: "Double"}


def _unscale_kernel(dtypes: tuple[torch.dtype, ...] | None, max_elements: int | None, message: str,
                    large_message: str) -> Any:
    """``_amp_foreach_non_finite_check_and_unscale_`` as the extension's kernel takes it: only
    ``dtypes``, at most ``max_elements`` per tensor; in saturation mode the overflow status is
    read and reset instead of the tensors being inspected, and on overflow found_inf is set and
    nothing is unscaled (op-plugin's NPU kernel)."""
    op = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default

    def kernel(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        for g in grads:
            if dtypes is not None and g.dtype not in dtypes:
                raise RuntimeError(message.format(dtype=_SCALAR_TYPE_NAMES.get(g.dtype, str(g.dtype))))
            if max_elements is not None and g.numel() > max_elements:
                raise RuntimeError(large_message.format(numel=g.numel(), limit=max_elements))
        raws = [raw_of(g) for g in grads]
        if _STATE["saturation"]:  # read and reset the status; on overflow the gradients stay scaled
            overflow, _STATE["status"] = _STATE["status"], False
            if overflow:
                raw_of(found_inf).fill_(1.0)
                return None
            for r in raws:
                r.mul_(raw_of(inv_scale))
            return None
        op(raws, raw_of(found_inf), raw_of(inv_scale))
        return None

    return kernel


# -- an extension's own kernels for an op (fused optimizers differ between the real stacks) -------
def _overload(qualified: str) -> Any:
    name, _, overload = qualified.partition(".")
    return getattr(getattr(torch.ops.aten, name), overload or "default")


def ignoring_found_inf(qualified: str) -> Any:
    """A fused optimizer kernel that takes ``grad_scale`` and ``found_inf`` and reads neither: it
    steps on the gradients as they are (op-plugin's ``_fused_adamw_``)."""
    op = _overload(qualified)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        kwargs = {**kwargs, "grad_scale": None, "found_inf": None}
        return _fallback(op, *args, **kwargs)

    return kernel


def scale_blind(qualified: str, before: Any = None) -> Any:
    """A fused optimizer kernel that returns when found_inf is 1 and otherwise steps on the gradients
    as they are, never dividing by ``grad_scale``. ``before(kwargs)``: the extension's own checks,
    after the found_inf return (op-plugin's momentum check)."""
    op = _overload(qualified)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        found_inf = kwargs.get("found_inf")
        if found_inf is not None and float(found_inf.item()) == 1:
            return None
        if before is not None:
            before(kwargs)
        return _fallback(op, *args, **{**kwargs, "grad_scale": None, "found_inf": None})

    return kernel


_FELL_BACK: set[str] = set()


def host_fallback(qualified: str, warning: str, disabled: BaseException | None = None) -> Any:
    """An op the extension has no device kernel for, run by its CPU fallback (torch_npu's
    ``npu_cpu_fallback``, torch_mlu's ``mlu_fallback``): torch's CPU kernel, after the extension's
    warning, once per op (``{op}``: the operator's name). ``disabled``: the fallback is turned off, and
    this is what the extension raises instead."""
    op = _overload(qualified)
    name = f"aten::{qualified}"

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if disabled is not None:
            raise disabled
        if name not in _FELL_BACK:
            _FELL_BACK.add(name)
            warnings.warn(warning.format(op=name), UserWarning, stacklevel=2)
        return _fallback(op, *args, **kwargs)

    return kernel


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype | None) -> torch.Tensor:
    """``torch._scaled_mm``'s arithmetic on the device tensors, in float32 on their CPU data: each
    operand times its scale (one element, or one per row of ``a`` / column of ``b``), multiplied,
    plus the bias, cast to ``out_dtype`` (``a``'s dtype where None). For a simulated extension's
    kernel, after its own checks."""
    ra, rb = raw_of(a).float(), raw_of(b).float()
    sa, sb = raw_of(scale_a).float(), raw_of(scale_b).float()
    sa = sa.reshape(()) if sa.numel() == 1 else sa.reshape(-1, 1)
    sb = sb.reshape(()) if sb.numel() == 1 else sb.reshape(1, -1)
    out = (ra * sa) @ (rb * sb)
    if bias is not None:
        out = out + raw_of(bias).float()
    return _wrap(out.to(out_dtype or a.dtype).contiguous())


def absent(qualified: str) -> Any:
    """No kernel for the op on the device: the dispatcher's error for a backend without one."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"Could not run 'aten::{qualified}' with arguments from the 'PrivateUse1' backend. This could be "
            "because the operator doesn't exist for this backend."
        )

    return kernel


def refusing(message: str) -> Any:
    """A kernel the extension registers only to refuse the op (torch_musa's fused Adam): a RuntimeError."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(message)

    return kernel


class _DeviceModule(types.ModuleType):
    """``torch.<name>``: the device module PyTorch asks for availability and AMP dtypes."""

    def __init__(self, name: str, bf16: bool, count: int) -> None:
        super().__init__(f"torch.{name}")
        self._bf16 = bf16
        self._count = count

    def is_available(self) -> bool:
        return self._count > 0

    def device_count(self) -> int:
        return self._count

    _current = 0

    def current_device(self) -> int:
        return self._current

    def set_device(self, device: Any) -> None:
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if not 0 <= index < self._count:
            raise RuntimeError(f"invalid device ordinal {index}: {self._count} device(s) visible")
        self._current = index

    def memory_allocated(self, device: Any = None) -> int:
        _sweep()
        return int(_STATE["allocated"])

    def max_memory_allocated(self, device: Any = None) -> int:
        return int(_STATE["peak"])

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        _sweep()
        _STATE["peak"] = _STATE["allocated"]

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        """Random ops run on the CPU tensors underneath: torch.manual_seed already seeded them."""

    def synchronize(self, device: Any = None) -> None:
        return None

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        """The extensions list bf16 whatever the chip (torch_mlu's autocast_utils.py)."""
        return [torch.float16, torch.bfloat16]

    def is_bf16_supported(self) -> bool:
        return self._bf16


def install(
    name: str = "sim",
    bf16: bool = True,
    device_count: int = 1,
    *,
    fp32_extra: tuple[str, ...] = (),
    banned: tuple[str, ...] = ("binary_cross_entropy",),
    unscale_dtypes: tuple[torch.dtype, ...] | None = None,
    unscale_max_elements: int | None = None,
    unscale_message: str = "amp_unscale: unsupported gradient dtype {dtype}",
    unscale_large_message: str = "amp_unscale: a tensor of {numel} elements exceeds the kernel's limit of {limit}",
    saturation: bool = False,
    module_class: type | None = None,
    kernels: dict[str, Any] | None = None,
    autocast_lists: dict[str, tuple[str, ...]] | None = None,
) -> types.ModuleType:
    """Register the simulated device as ``name`` (once per process) and return its device module.

    ``fp32_extra``/``banned``: the extension's own autocast lists on top of CUDA's (banned ops
    raise under autocast, as CUDA's ``binary_cross_entropy`` does). ``unscale_*``: the limits of
    the extension's unscale kernel and its error texts (``{dtype}``: the ScalarType name;
    ``{numel}``/``{limit}``: sizes). ``saturation``: inf/NaN results saturate and set a
    device-wide overflow status (Ascend without inf/NaN mode). ``kernels``: the extension's own
    kernels for ATen overloads (``"_fused_adamw_"`` -> :func:`ignoring_found_inf` ...); every other op
    runs torch's CPU kernel. ``autocast_lists``: the extension's own ``"lower"``, ``"fp32"`` and
    ``"promote"`` op lists where they differ from CUDA's."""
    if _STATE["name"] is not None:
        if _STATE["name"] != name:
            raise RuntimeError(
                f"the simulated device is already installed as {_STATE['name']!r}; PrivateUse1 can be "
                "renamed once per process, so run tests for another name in a subprocess"
            )
        return getattr(torch, name)
    from ..torch_private import setup_privateuseone_for_python_backend as _setup_privateuseone_for_python_backend

    module = (module_class or _DeviceModule)(name, bf16, device_count)
    _STATE["saturation"] = saturation
    _setup_privateuseone_for_python_backend(name, backend_module=module)
    _STATE["name"] = name
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_fallback, "PrivateUse1")
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    aten = torch.library.Library("aten", "IMPL")
    aten.impl("_copy_from", _copy_from, "PrivateUse1")
    aten.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
    for name in _intercepted_ops():
        aten.impl(name, _kernel_for(name), "PrivateUse1")
    aten.impl("_amp_foreach_non_finite_check_and_unscale_",
              _unscale_kernel(unscale_dtypes, unscale_max_elements, unscale_message, unscale_large_message),
              "PrivateUse1")
    for qualified, kernel in (kernels or {}).items():
        aten.impl(qualified, kernel, "PrivateUse1")
    register_autocast(aten, fp32_extra, banned, autocast_lists or {})
    _STATE["libs"] = [fallback, aten]
    torch.__future__.set_swap_module_params_on_conversion(True)
    return module


def installed_name() -> str | None:
    """The name the simulated device was installed under in this process, if any."""
    return _STATE["name"]


def overflow_status() -> bool:
    """The simulated device-wide overflow status (saturation mode)."""
    return bool(_STATE["status"])


def clear_overflow_status() -> None:
    _STATE["status"] = False
