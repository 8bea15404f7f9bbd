"""fp8 training for chosen ``nn.Linear`` layers, with torchao's float8 training as the engine.

A precision policy's ``fp8=`` selects the layers; this module says which of them can run in fp8 and
why not, converts them (``torchao.float8``'s ``Float8Linear``, through :meth:`Backend.fp8_linear`,
which a vendor plugin may fill with its own fp8 layer) and restores them. The parameters stay the
same objects (with ``fp8_all_gather`` each weight object itself becomes torchao's all-gather wrapper,
and a plain parameter again at ``remove()``), so an optimizer built before or after keeps training
them, and ``state_dict`` keys never change: a checkpoint moves between fp8 and bf16 runs.

Precedence, per module: float32 (a policy's ``fp32=``) beats fp8, which beats the autocast dtype.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ...backend import FP8_RECIPES, Backend
from ...errors import AmpBackendsError, first_line
from .mx import MX_HARDWARE, MX_RECIPES, MxConfig

__all__ = ["ALL_RECIPES", "FP8_HARDWARE", "NEEDS_TORCHAO", "RECIPES", "Fp8UnavailableError", "eligibility", "engine",
           "mx_kernels_reason", "mx_layer_class", "mx_unavailable_reason", "too_old_reason", "unavailable_reason"]

#: torchao's float8 training recipes (see :data:`amp_backends.backend.FP8_RECIPES`).
RECIPES = FP8_RECIPES
#: Every recipe ``fp8_recipe=`` takes: torchao's float8 recipes and the MX ones (:mod:`.mx`).
ALL_RECIPES = FP8_RECIPES + MX_RECIPES
#: The hardware whose matmuls take fp8 through torch._scaled_mm in torchao's recipes, as the backends
#: declare it (docs/fp8.md: the sources, and which of them ran on the hardware).
FP8_HARDWARE = ("NVIDIA GPUs of compute capability 8.9 and newer (Ada: L4, L40S, RTX 40xx; Hopper: H100, H200; "
                "Blackwell), AMD Instinct MI300 (gfx942) and, with ROCm 6.5+, MI350 (gfx950) and Radeon RX 9000 "
                "(gfx1200, gfx1201), Intel GPUs with torch 2.10+, Ascend 950 (torch_npu with op-plugin 26.1.0+), "
                "Moore Threads GPUs of compute capability 3.1+ (torch_musa) and Intel Gaudi 3 (tensorwise)")
#: fp8 matmuls need both dimensions of the weight to be multiples of this.
FP8_ALIGN = 16
#: Where torchao's measured break-even lies (H100, torchao's performance tables): below it a layer's
#: casts cost more than its fp8 matmul gains. (out_features N, in_features K) -> too small.
_TOO_SMALL = {
    "tensorwise": (lambda n, k: k <= 4096 and n <= 1024, "K <= 4096 and N <= 1024"),
    "rowwise": (lambda n, k: n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048),
                "N <= 2048, K <= 1024, or N <= 4096 and K <= 2048"),
}
#: Recipes torchao has measured no break-even for (its filter raises "Unsupported recipe"), given the
#: thresholds of the recipe they derive from, said to be borrowed.
_BORROWED = {"rowwise_with_gw_hp": "rowwise"}
TESTED = "torch 2.13 with torchao 0.18, torch 2.11 with torchao 0.17"
#: The oldest torchao each feature was tested with, and needs: the float8 recipes (``torchao.float8``'s
#: ``Float8Linear``) and the MX layer (``torchao.prototype.moe_training.mxfp8_linear``, new in 0.18). Below
#: it the feature is refused, naming the release to install; everything else keeps working.
NEEDS_TORCHAO = {"fp8": "0.17", "mxfp8": "0.18"}


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string ("0.17.0+cu130" -> (0, 17, 0), "0.18.0rc1" -> (0, 18, 0))."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        numbers.append(int(digits))
        if digits != part:
            break
    return tuple(numbers)


def too_old_reason(feature: str, version: str | None) -> str | None:
    """Why torchao ``version`` is too old for ``feature`` (a key of :data:`NEEDS_TORCHAO`), naming the
    release to install; None where it is new enough, not installed, or of an unknown version."""
    needed = NEEDS_TORCHAO[feature]
    if version is None or not _release(version) or _release(version) >= _release(needed):
        return None
    what = "MXFP8 training" if feature == "mxfp8" else "fp8 training"
    return (f"{what} needs torchao {needed} or newer, the oldest it was tested with; the installed torchao is "
            f"{version}: pip install 'torchao>={needed}' (tested: {TESTED})")


class Fp8UnavailableError(AmpBackendsError, RuntimeError):
    """fp8 cannot run here: no engine (torchao), or a device without fp8 matmuls."""


_ENGINE: dict[str, Any] = {}


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao logs a warning per compiled extension it cannot load on this machine (sm90, mxfp8
    kernels on a CPU machine); the Python float8 path needs none of them. Python 3.12 compiling torchao's
    source where no bytecode is cached warns about invalid escapes in it (torchao 0.17's quant_api.py):
    nothing the user can act on, so not shown either."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=SyntaxWarning)
            ours = list(warnings.filters)
            try:
                yield
            finally:  # filters the import added (torchao's __init__ adds one) outlive the block
                added: list[Any] = [f for f in warnings.filters if f not in ours]
        for action, message, category, module, lineno in reversed(added):
            warnings.filterwarnings(action, getattr(message, "pattern", message or ""), category,
                                    getattr(module, "pattern", module or ""), lineno)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def engine() -> Any:
    """``torchao.float8``, imported once; Fp8UnavailableError saying what to install where it
    is missing or does not work with this torch."""
    if "module" in _ENGINE:
        return _ENGINE["module"]
    if "error" in _ENGINE:
        raise Fp8UnavailableError(_ENGINE["error"])
    old = too_old_reason("fp8", torchao_version())
    if old is not None:
        _ENGINE["error"] = old
        raise Fp8UnavailableError(old)
    try:
        with _quiet_import():
            import torchao.float8 as float8
    except ImportError as exc:
        _ENGINE["error"] = (
            "fp8 training needs torchao, which is not installed: pip install 'amp-backends[fp8]' (or torchao "
            f"built for torch {torch.__version__.split('+')[0]}; tested: {TESTED})" if torchao_version() is None else
            _mismatch(exc))
        raise Fp8UnavailableError(_ENGINE["error"]) from None
    except Exception as exc:  # noqa: BLE001 - a torchao built for another torch fails in many ways
        _ENGINE["error"] = _mismatch(exc)
        raise Fp8UnavailableError(_ENGINE["error"]) from None
    _ENGINE["module"] = float8
    return float8


def torchao_version() -> str | None:
    """The installed torchao's version (found without importing it; "?" where its metadata is
    missing), or None where it is not installed."""
    import importlib.util
    from importlib import metadata

    try:
        if importlib.util.find_spec("torchao") is None:
            return None
    except (ImportError, ValueError):  # None in sys.modules, or a broken half-import
        return None
    try:
        return metadata.version("torchao")
    except metadata.PackageNotFoundError:
        return "?"


def _mismatch(exc: BaseException) -> str:
    version = torchao_version()
    ao = f"torchao {version}" if version not in (None, "?") else "the installed torchao"
    return (f"fp8 training is unavailable: {ao} does not work with torch {torch.__version__} "
            f"({type(exc).__name__}: {first_line(exc)[:160]}); install the torchao release made for this torch "
            f"(tested: {TESTED}), or upgrade torch")


def unavailable_reason() -> str | None:
    """Why fp8 cannot run in this environment (no usable torchao), or None."""
    try:
        engine()
    except Fp8UnavailableError as exc:
        return str(exc)
    return None


def check_recipe(recipe: Any) -> str:
    if not isinstance(recipe, str) or recipe not in ALL_RECIPES:
        raise ValueError(f"precision_policy(fp8_recipe=...) takes one of {', '.join(map(repr, ALL_RECIPES))}, "
                         f"got {recipe!r}")
    return recipe


def device_reason(be: Backend) -> str:
    """Why ``be``'s device runs none of torchao's fp8 recipes: the backend's own words where its plugin
    gives them (``fp8_unavailable_reason()``: what the device lacks, or what it has that the recipes
    cannot use), else that it has no fp8 matmul."""
    return be.fp8_unavailable_reason() or "has no fp8 matmul"


def check_device(be: Backend, recipe: str, emulate: bool) -> None:
    """Refuse fp8 where the backend's device has no fp8 matmul the recipes can use (unless emulated),
    saying why in the backend's words, or not this recipe."""
    if emulate:
        return
    where = be.describe() or f"the {be.device_type!r} device"
    if recipe in MX_RECIPES:
        if "mxfp8" not in be.mx_formats():
            raise Fp8UnavailableError(
                f"backend {be.name!r} ({where}) {be.mx_unavailable_reason() or 'has no MXFP8 matmul'}: MXFP8 training "
                f"runs on {MX_HARDWARE}. emulate=True runs MXFP8's numerics with high-precision matmuls, for tests "
                "only (slower than bf16)")
        return
    if not be.fp8_dtypes() or not be.fp8_recipes():
        raise Fp8UnavailableError(
            f"backend {be.name!r} ({where}) {device_reason(be)}: fp8 training runs on {FP8_HARDWARE}. "
            "emulate=True runs fp8's numerics with high-precision matmuls, for tests only (slower than bf16)")
    if recipe not in be.fp8_recipes():
        raise Fp8UnavailableError(
            f"backend {be.name!r} ({where}) runs the fp8 recipes {', '.join(map(repr, be.fp8_recipes()))}, not "
            f"{recipe!r}: choose one of those")


def check_all_gather(recipe: str, all_gather: bool) -> None:
    """fp8 all-gather (FSDP2) exists for the tensorwise recipe only (torchao's restriction)."""
    if all_gather and recipe != "tensorwise":
        raise ValueError(f"precision_policy: fp8_all_gather=True needs fp8_recipe='tensorwise' (torchao all-gathers "
                         f"tensorwise-scaled weights only), got {recipe!r}: use tensorwise, or fp8_all_gather=False")


def config(recipe: str, emulate: bool, all_gather: bool = False) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe``, emulated or not, with FSDP2's fp8 all-gather
    (``enable_fsdp_float8_all_gather``) or not."""
    import dataclasses

    if recipe in MX_RECIPES:
        return MxConfig(recipe, emulate)
    made = engine().Float8LinearConfig.from_recipe_name(recipe)
    if emulate or all_gather:
        made = dataclasses.replace(made, emulate=emulate, enable_fsdp_float8_all_gather=all_gather)
    return made


def plain_weight(tensor: Any) -> Any:
    """The tensor inside torchao's fp8 all-gather wrapper (``WeightWithDynamicFloat8CastTensor``, the
    weight of a layer converted with ``fp8_all_gather=True``); anything else as it is."""
    inner = getattr(tensor, "_tensor", None)
    if inner is None or "module" not in _ENGINE:
        return tensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return inner if isinstance(tensor, WeightWithDynamicFloat8CastTensor) else tensor


def eligibility(module: nn.Module, converters: Any = None) -> str | None:
    """Why ``module`` cannot run in fp8 (None: it can). ``converters``: the policy's ``fp8_convert``
    (Linear classes it says how to convert: they may do more than a Linear)."""
    from ..fp32_forward import Fp32Forward
    from .eligible import structure

    if not isinstance(module, nn.Linear):
        return f"not an nn.Linear ({type(module).__name__}): fp8 training converts Linear layers"
    if is_fp8(module):
        return "already in fp8"
    wrapper = module.__dict__.get("forward")
    if isinstance(wrapper, Fp32Forward) and wrapper.holders:
        return "float32 by a precision policy (float32 beats fp8)"
    if wrapper is not None:
        return "its forward is replaced on the instance (a hook or wrapper), which converting it would drop"
    why = structure(module, converters)
    if why is not None:
        return why
    n, k = module.weight.shape
    if n % FP8_ALIGN or k % FP8_ALIGN:
        return f"in_features={k}, out_features={n}: fp8 matmuls need both to be multiples of {FP8_ALIGN}"
    return None


def too_small(module: nn.Linear, recipe: str) -> str | None:
    """Why the recipe leaves ``module`` in the autocast dtype for speed (torchao's measured thresholds)."""
    n, k = module.weight.shape
    measured = _BORROWED.get(recipe, recipe)
    if measured not in _TOO_SMALL:  # MXFP8: torchao publishes no break-even table
        return None
    rule, said = _TOO_SMALL[measured]
    if not rule(n, k):
        return None
    if measured != recipe:
        return (f"N={n}, K={k}: below torchao's measured break-even for {measured} ({said}; H100 tables), "
                f"borrowed for {recipe}, which torchao has not measured")
    return f"N={n}, K={k}: below torchao's measured break-even for {recipe} ({said}; H100 tables)"


def is_fp8(module: nn.Module) -> bool:
    """Whether ``module`` is an fp8 layer (torchao's, or a vendor's that says so with ``is_fp8 = True``)."""
    if getattr(type(module), "is_fp8", False):
        return True
    float8 = _ENGINE.get("module")
    return float8 is not None and isinstance(module, float8.float8_linear.Float8Linear)


def linear_order(model: nn.Module, example_inputs: Any, names: Sequence[str]) -> list[str]:
    """``names`` (Linear layers) in the order the forward runs them (the model run once, untouched; the
    layers it never calls left out), else (no ``example_inputs``) in registration order."""
    if example_inputs is None:
        return list(names)
    from ...tracing.isolation import call_args, untouched

    wanted = {id(model.get_submodule(n)): n for n in names}
    ran: list[str] = []
    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a: ran.append(wanted[id(m)]) if wanted[id(m)] not in ran else None) for n in names]
    args, kwargs = call_args(example_inputs)
    device = next((t.device.type for t in model.parameters()), "cpu")
    try:
        with untouched(model, device), torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return ran


def places(model: nn.Module, module: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every (parent, attribute) holding ``module`` (a shared module has several)."""
    return [(parent, child_name) for parent in model.modules() for child_name, child in parent._modules.items()
            if child is module]


def swap(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent, attr in places(model, old):
        setattr(parent, attr, new)


def describe_layer(module: nn.Module) -> str:
    """"tensorwise", "rowwise, emulated": how an fp8 layer a policy installed trains."""
    recipe = getattr(module, "fp8_recipe", None) or "fp8"
    emulated = bool(getattr(getattr(module, "config", None), "emulate", False))
    return f"{recipe}, emulated" if emulated else recipe


@contextlib.contextmanager
def as_linear(model: nn.Module) -> Iterator[list[str]]:
    """Within the block every fp8 layer of ``model`` is a plain ``nn.Linear`` holding the same
    parameters and the same hooks (a float32 reference run); afterwards the model holds its fp8 layers
    again. An fp8 layer that is more than a Linear (a ``fp8_convert`` class with a forward, parameters or
    submodules of its own, such as a LoRA adapter) stays: a plain Linear would drop what it adds. The
    block gets the names of those left in fp8."""
    from .carry import CARRIED, carry_attributes, carry_hooks

    layers = [m for m in model.modules() if is_fp8(m) and hasattr(m, "weight")]
    swapped, kept = [], []
    names = {id(m): name for name, m in model.named_modules()}
    try:
        for layer in layers:
            forward_from = getattr(type(layer).forward, "__module__", "") or ""
            more = (not (forward_from in (f"{__package__}.linear", f"{__package__}.mx_linear")
                         or forward_from.startswith("torchao."))
                    or next(layer.children(), None) is not None
                    or any(name not in ("weight", "bias") for name, _ in layer.named_parameters()))
            if more:
                kept.append(names.get(id(layer), type(layer).__name__))
                continue
            plain = nn.Linear.__new__(nn.Linear)
            nn.Module.__init__(plain)
            plain.in_features, plain.out_features = layer.weight.shape[1], layer.weight.shape[0]
            plain.weight, plain.bias = layer.weight, getattr(layer, "bias", None)
            carry_hooks(layer, plain)
            carry_attributes(layer, plain, layer.__dict__.get(CARRIED, ()))  # the user's: its parent's forward may read them
            swap(model, layer, plain)
            swapped.append((layer, plain))
        yield kept
    finally:
        for layer, plain in swapped:
            swap(model, plain, layer)


_LAYER: dict[str, Any] = {}


def mx_layer_class() -> type:
    """The MX layer class (:class:`.mx_linear.MxLinear`), imported once; Fp8UnavailableError naming the
    torchao to install where the installed one has no MX training layer."""
    if "cls" in _LAYER:
        return _LAYER["cls"]
    engine()  # a usable torchao first: the same refusal as fp8's
    if "error" in _LAYER:
        raise Fp8UnavailableError(_LAYER["error"])
    old = too_old_reason("mxfp8", torchao_version())
    if old is not None:
        _LAYER["error"] = old
        raise Fp8UnavailableError(old)
    try:
        with _quiet_import():
            from .mx_linear import MxLinear
    except Exception as exc:  # noqa: BLE001 - an older torchao lacks the module, or parts of it
        version = torchao_version() or "?"
        _LAYER["error"] = (f"MXFP8 training needs torchao's MXFP8Linear (torchao.prototype.moe_training.mxfp8_linear, "
                           f"torchao {NEEDS_TORCHAO['mxfp8']}); the installed torchao {version} has none ({type(exc).__name__}: "
                           f"{first_line(exc)[:120]}): pip install 'torchao>={NEEDS_TORCHAO['mxfp8']}' (tested: {TESTED})")
        raise Fp8UnavailableError(_LAYER["error"]) from None
    _LAYER["cls"] = MxLinear
    return MxLinear


def mx_unavailable_reason() -> str | None:
    """Why MXFP8 training cannot run in this environment (no usable torchao, or one without the MX
    layer), or None."""
    try:
        mx_layer_class()
    except Fp8UnavailableError as exc:
        return str(exc)
    return None


def mx_kernels_reason() -> str | None:
    """Why the installed torchao's MX layer cannot run its real (non-emulated) kernels on this machine,
    or None where it can. torchao 0.18's ``MXFP8Linear`` casts along dim 0 with a Triton kernel
    (``mx_formats/kernels.py``: ``_triton_kernels_available``: triton, CUDA capability >= 10.0 and CUDA
    >= 12.8, or ROCm on MI350) and along dim 1 with its CUDA kernel (``_to_mxfp8_then_scaled_mm`` fixes
    ``MXFP8Dim1CastKernelChoice.CUDA``; ``_mxfp8_cuda_kernels_available``: CUDA capability >= 10.0 and
    CUDA >= 12.8, with torchao built for it); without them its first forward raises ``needs triton``
    or ``mxfp8_quantize_cuda needs ...``."""
    reason = mx_unavailable_reason()
    if reason is not None:
        return reason
    with _quiet_import():
        from torchao.prototype.mx_formats import kernels
    missing = []
    if not getattr(kernels, "_triton_kernels_available", False):
        missing.append("its Triton MX cast kernels (triton with CUDA capability 10.0+ and CUDA 12.8+, or ROCm on "
                       "gfx950) are not available")
    if not getattr(kernels, "_mxfp8_cuda_kernels_available", False):
        missing.append("its CUDA MXFP8 cast kernel (mxfp8_quantize_cuda: CUDA capability 10.0+, CUDA 12.8+, torchao "
                       "built for it), which torchao's MXFP8Linear uses for every dim-1 cast, is not available")
    if not missing:
        return None
    version = torchao_version() or "?"
    return f"torchao {version}: " + "; ".join(missing)
