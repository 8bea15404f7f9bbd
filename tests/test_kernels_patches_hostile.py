"""Hostile cases of the optimizer-step patch, the patch table, the Triton kernel's inputs, the kernel
self-check and torch's private names, each against torch's own behaviour: an LR scheduler made before or
after ``compile_once`` (and ``memory_lean``) wraps the step as it wraps torch's; patches of one attribute
undone in any order (two threads' isolated runs) put back the original; the Triton kernel refuses what
torch's op refuses and runs a list mixing dtypes at each one's width; the self-check refuses a kernel
that skips non-contiguous gradients; each recorded fallback for a missing private name works."""

from __future__ import annotations

import importlib.util
import math
import os
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before the Triton plugin's kernels are imported

from amp_backends import Kernel, TorchKernel, patches  # noqa: E402
from amp_backends.gradients.groups import FlatGroup, TensorGroup, layout  # noqa: E402
from amp_backends.gradients.selfcheck import kernel_self_check  # noqa: E402
from amp_backends.memory.compile_once import compile_once  # noqa: E402
from amp_backends.torch_private import amp_foreach_non_finite_check_and_unscale_ as torch_unscale_  # noqa: E402
from amp_backends.tracing.isolation import untouched  # noqa: E402

from conftest import run_json  # noqa: E402
from fp8_marks import needs_torchao  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="the triton extra is not installed")


# -- compile_once and LR schedulers -------------------------------------------------------------------


def _scheduled_run(apply: Callable[[torch.optim.Optimizer], Any], scheduler_first: bool,
                   scheduler_step_first: bool) -> tuple[list[torch.Tensor], list[float], list[str]]:
    """Three SGD steps under a LambdaLR, ``apply`` given the optimizer before or after the scheduler is
    made: the parameters, the learning rates and the warnings."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not scheduler_first:
            apply(opt)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
        if scheduler_first:
            apply(opt)
        lrs = []
        for _ in range(3):
            model(torch.ones(1, 3)).pow(2).sum().backward()
            if scheduler_step_first:
                sched.step()
                opt.step()
            else:
                opt.step()
                sched.step()
            lrs.append(opt.param_groups[0]["lr"])
            opt.zero_grad()
    messages = [str(w.message).split(".")[0] for w in caught if issubclass(w.category, UserWarning)]
    return [p.detach().clone() for p in model.parameters()], lrs, messages


@pytest.mark.parametrize("scheduler_first", [False, True], ids=["scheduler_after", "scheduler_before"])
@pytest.mark.parametrize("scheduler_step_first", [False, True], ids=["in_order", "scheduler_stepped_first"])
def test_an_lr_scheduler_wraps_the_compile_once_step_as_torchs(scheduler_first: bool, scheduler_step_first: bool) -> None:
    plain = _scheduled_run(lambda opt: None, scheduler_first, scheduler_step_first)
    once = _scheduled_run(compile_once, scheduler_first, scheduler_step_first)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], once[0]))
    assert plain[1] == once[1]
    assert plain[2] == once[2]  # torch's step-order warning where torch gives it, and only there
    assert bool(plain[2]) == scheduler_step_first


def test_compile_once_is_a_bound_step_undone_with_or_without_a_scheduler_over_it() -> None:
    from amp_backends.memory.compile_once import undo_compile_once

    real = torch.compile
    seen: list[bool] = []

    class Watching(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            seen.append(torch.compile is real)
            return super().step(closure)

    model = nn.Linear(2, 2)
    opt = compile_once(Watching(model.parameters(), lr=0.1))
    assert isinstance(opt.step, types.MethodType) and opt.step.__self__ is opt
    assert patches.find(opt, "step") is not None and compile_once(opt).step is opt.step  # twice: a no-op
    undo_compile_once(opt)
    assert "step" not in vars(opt) and patches.find(opt, "step") is None
    opt.step()
    assert seen == [True]

    compile_once(opt)
    torch.optim.lr_scheduler.StepLR(opt, 1)  # wraps the compile_once step
    opt.step()
    undo_compile_once(opt)  # the scheduler's wrapper stays, calling the plain step
    opt.step()
    assert seen == [True, False, True] and patches.find(opt, "step") is None and torch.compile is real


@needs_torchao
def test_memory_lean_on_torchao_takes_a_scheduler_and_remove_ends_compile_once() -> None:
    import amp_backends
    from torchao.optim import _AdamW

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = _AdamW(model.parameters(), lr=1e-2, bf16_stochastic_round=True)
    lean = amp_backends.memory.memory_lean(model, opt, weights=torch.bfloat16, master=False)
    assert patches.find(opt, "step") is not None
    torch.optim.lr_scheduler.LambdaLR(lean.optimizer, lambda step: 1.0)
    lean.remove()
    assert patches.find(opt, "step") is None

    model = nn.Linear(4, 4)  # no scheduler: the optimizer's own step comes back
    opt = _AdamW(model.parameters(), lr=1e-2, bf16_stochastic_round=True)
    lean = amp_backends.memory.memory_lean(model, opt, weights=torch.bfloat16, master=False)
    assert "step" in vars(opt)
    lean.remove()
    assert "step" not in vars(opt) and patches.find(opt, "step") is None


# -- patches undone in any order ------------------------------------------------------------------------


def test_patches_of_one_attribute_undone_in_any_order_put_back_the_original() -> None:
    for order in ((0, 1), (1, 0), (1, 0, 2), (0, 2, 1), (2, 1, 0), (0, 1, 2)):
        module = types.ModuleType("target")
        module.f = "original"
        applied = [patches.replace(module, "f", f"patch {i}", cause="a test", scope="until remove()")
                   for i in range(max(order) + 1)]
        for i in order:
            applied[i].remove()
        assert module.f == "original", order
        assert not any(p.active for p in applied)

    class Owner:
        attr = "class"

    obj = Owner()
    first = patches.replace(obj, "attr", "first", cause="a test", scope="until remove()")
    second = patches.replace(obj, "attr", "second", cause="a test", scope="until remove()")
    first.remove()
    assert obj.attr == "second"  # the later patch is still in force
    second.remove()
    assert "attr" not in vars(obj) and obj.attr == "class"


def test_two_threads_isolated_runs_overlapping_keep_the_global_backward_hooks() -> None:
    calls: list[str] = []
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: calls.append(type(m).__name__))
    try:
        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def first() -> None:
            try:
                with untouched(nn.Linear(2, 2), "cpu"):
                    a_in.set()
                    b_in.wait(30)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                a_in.set()
                a_out.set()

        def second() -> None:
            try:
                a_in.wait(30)
                with untouched(nn.Linear(2, 2), "cpu"):
                    b_in.set()
                    a_out.wait(30)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                b_in.set()

        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        model = nn.Linear(2, 2)
        model(torch.ones(1, 2, requires_grad=True)).sum().backward()
        assert calls == ["Linear"]  # the hook fires, as it does without any isolated run
        assert not [p for p in patches.active() if "backward" in p.what]
    finally:
        handle.remove()


# -- the Triton kernel's inputs -------------------------------------------------------------------------


def _triton() -> Kernel:
    from amp_backends_plugins.triton import TritonKernel

    kernel = TritonKernel()
    kernel.min_elements = 0  # its own code at every size
    return kernel


@needs_triton
def test_a_group_mixing_dtypes_is_unscaled_at_each_dtypes_width_and_nothing_past_it() -> None:
    def tensors() -> tuple[list[torch.Tensor], torch.Tensor]:
        half = torch.full((16,), 2.0, dtype=torch.float16, device=DEVICE)
        bf16 = torch.full((5,), 6.0, dtype=torch.bfloat16, device=DEVICE)
        bf16[3] = math.inf
        return [torch.full((4,), 3.0, device=DEVICE), half[:4], bf16, torch.full((3,), 1.5, device=DEVICE)], half

    grads, half = tensors()
    found, norm_sq = torch.zeros((), device=DEVICE), torch.zeros((), device=DEVICE)
    _triton().grad_op_(TensorGroup(DEVICE, torch.float32, grads), found, torch.tensor(1 / 3, device=DEVICE), norm_sq)
    reference, ref_half = tensors()
    ref_found = torch.zeros((), device=DEVICE)
    if CUDA:  # CUDA's op has no bf16: its float32 copy, rounded once as torch's CPU op rounds
        wide = reference[2].float()
        torch_unscale_([reference[0], reference[1], wide, reference[3]], ref_found, torch.tensor(1 / 3, device=DEVICE))
        reference[2].copy_(wide)
    else:
        torch_unscale_(reference, ref_found, torch.tensor(1 / 3, device=DEVICE))
    assert found.item() == ref_found.item() == 1.0
    assert torch.equal(half, ref_half)  # the gradient and the 12 elements after it: nothing past it written
    for a, b in zip(grads, reference):
        assert torch.equal(a, b) or (a.isinf() == b.isinf()).all()
    assert torch.equal(grads[2].isinf(), reference[2].isinf())


def _flat(dtype: torch.dtype) -> FlatGroup:
    sizes = (3, 7)
    offsets, total = layout(sizes, torch.empty((), dtype=dtype).element_size())
    buffer = torch.zeros(total, dtype=dtype, device=DEVICE)
    params = []
    for off, n in zip(offsets, sizes):
        p = torch.zeros(n, dtype=dtype, device=DEVICE, requires_grad=True)
        p.grad = buffer[off:off + n]
        p.grad.fill_(4.0)
        params.append(p)
    return FlatGroup(DEVICE, dtype, buffer, tuple(params), tuple(offsets), sizes, tuple(p.shape for p in params))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("wrong", ["inv_scale float64", "found_inf float64", "found_inf float16", "inv_scale 2 elements"])
def test_scale_and_found_inf_torch_refuses_are_refused_with_its_message(dtype: torch.dtype, wrong: str) -> None:
    name, _, what = wrong.partition(" ")
    kwargs = {"inv_scale": torch.tensor(0.5, device=DEVICE), "found_inf": torch.zeros((), device=DEVICE)}
    kwargs[name] = (torch.full((2,), 0.5, device=DEVICE) if what == "2 elements"
                    else kwargs[name].to(getattr(torch, what)))
    # torch's own op on the same input: its message is the reference
    with pytest.raises(RuntimeError) as torchs:
        torch_unscale_([torch.full((5,), 4.0, device=DEVICE)], kwargs["found_inf"], kwargs["inv_scale"])
    expected = str(torchs.value).splitlines()[0]
    assert expected.startswith(name)
    grad = torch.full((5,), 4.0, dtype=dtype, device=DEVICE)
    with pytest.raises(RuntimeError, match=expected.rstrip(".")):
        _triton().grad_op_(TensorGroup(DEVICE, dtype, [grad]), kwargs["found_inf"], kwargs["inv_scale"])
    assert torch.equal(grad, torch.full_like(grad, 4.0))  # refused before anything is written
    group = _flat(dtype)
    with pytest.raises(RuntimeError, match=expected.rstrip(".")):
        _triton().grad_op_(group, kwargs["found_inf"], kwargs["inv_scale"])
    assert torch.equal(group.buffer, _flat(dtype).buffer)


# -- the kernel self-check ------------------------------------------------------------------------------


class _Flattening(Kernel):
    """Works on each gradient flattened: ``reshape`` copies a non-contiguous one, so its unscale is lost."""

    name = "flattening"

    def grad_op_(self, group: Any, found_inf: torch.Tensor, inv_scale: torch.Tensor | None = None,
                 norm_sq: torch.Tensor | None = None) -> None:
        for g in [group.buffer] if isinstance(group, FlatGroup) else group.tensors:
            flat = g.reshape(-1)
            found_inf.masked_fill_(~torch.isfinite(flat).all(), 1.0)
            if inv_scale is not None:
                flat.mul_(inv_scale)
            if norm_sq is not None:
                norm_sq.add_(flat.float().pow(2).sum())


class _Dividing(TorchKernel):
    """Divides by the scale instead of multiplying by its inverse: exact for a power of two only."""

    name = "dividing"

    def grad_op_(self, group: Any, found_inf: torch.Tensor, inv_scale: torch.Tensor | None = None,
                 norm_sq: torch.Tensor | None = None) -> None:
        super().grad_op_(group, found_inf, None, None)  # the check, reading only
        if inv_scale is not None:
            for g in [group.buffer] if isinstance(group, FlatGroup) else group.tensors:
                g.copy_((g.float() / (1 / inv_scale.float())).to(g.dtype))
        if norm_sq is not None:
            super().grad_op_(group, torch.zeros_like(found_inf), None, norm_sq)


def test_the_self_check_refuses_a_kernel_that_loses_non_contiguous_gradients_or_rounds_otherwise() -> None:
    # the flattening kernel, on a channels_last gradient: torch's op unscales it, the kernel does not
    grad = torch.arange(24, dtype=torch.float32).reshape(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    ours, reference = grad.clone(memory_format=torch.channels_last), grad.clone(memory_format=torch.channels_last)
    _Flattening().grad_op_(TensorGroup(grad.device, grad.dtype, [ours]), torch.zeros(()), torch.tensor(0.5))
    torch_unscale_([reference], torch.zeros(()), torch.tensor(0.5))
    assert not torch.equal(ours, reference)
    assert "differ from torch's" in (kernel_self_check(_Flattening(), torch.device("cpu")) or "")
    assert "differ from torch's" in (kernel_self_check(_Dividing(), torch.device("cpu")) or "")
    assert kernel_self_check(TorchKernel(), torch.device("cpu")) is None  # torch's op itself passes


@needs_triton
def test_the_triton_kernel_passes_the_self_check_in_every_layout() -> None:
    kernel = _triton()
    kernel.min_elements = 1 << 22
    assert kernel_self_check(kernel, DEVICE) is None
    assert kernel.min_elements == 1 << 22  # its threshold put back


# -- recorded fallbacks of torch's private names -------------------------------------------------------

_WITHOUT = """
import json, importlib, warnings
import torch
torch.set_num_threads(1)
module, _, name = {path!r}.rpartition(".")
delattr(importlib.import_module(module), name)  # this torch lacks it
import amp_backends
from amp_backends import eager

def train(arena, zero):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if arena:
        amp_backends.flat_grads(opt)
        scaler = amp_backends.GradScaler("cpu", init_scale=8.0)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(2, 4)).float().sum()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        (model if zero == "model" else opt).zero_grad()
    return [p.detach() for p in model.parameters()]

out = {{}}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    reference = train(False, "optimizer")
    for zero in ("optimizer", "model"):
        out[zero] = all(torch.equal(a, b) for a, b in zip(train(True, zero), reference))

seen = []
@eager.eager
def outside(x):
    seen.append(torch.compiler.is_compiling())
    return x + 1

@torch.compile(backend="eager")
def compiled(x):
    return outside(x * 2) * 3

out["eager"] = (compiled(torch.ones(2)).tolist(), seen)
probe = lambda: None
out["untraced_is_fn"] = eager.untraced(probe) is probe
try:
    amp_backends.flat_grads(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), check="refcount")
    out["refcount"] = "accepted"
except ValueError as exc:
    out["refcount"] = str(exc)
print(json.dumps(out))
"""


def _torch_itself_calls(path: str) -> bool:
    """Whether torch's own ``torch._dynamo.disable`` calls the name (torch 2.4 calls ``skip``): deleting it
    then breaks torch itself, so its absence cannot be simulated there."""
    import inspect

    name = path.rsplit(".", 1)[1]
    try:
        import torch._dynamo.decorators as decorators  # noqa: PLC0415 - only to read the source
        return path.startswith("torch._dynamo.decorators") and f"{name}(" in inspect.getsource(decorators.disable)
    except (ImportError, OSError, TypeError, AttributeError):
        return False


@pytest.mark.parametrize("path", ["torch._compile._disable_dynamo", "torch._dynamo.decorators.skip",
                                  "torch._C._storage_Use_Count"])
def test_each_recorded_fallback_of_a_missing_private_name_works(path: str) -> None:
    if _torch_itself_calls(path):
        pytest.skip(f"this torch's own torch._dynamo.disable calls {path}: its absence cannot be simulated here")
    out = run_json(_WITHOUT.format(path=path), env={"PYTHONWARNINGS": "ignore"})
    # the scaler with an arena: the parameters torch's own GradScaler gives, zeroed either way
    assert out["optimizer"] and out["model"]
    assert out["eager"] == [[9.0, 9.0], [False]]  # an eager function runs outside torch.compile
    assert out["untraced_is_fn"]
    if path == "torch._C._storage_Use_Count":  # refused by name, with the way out
        assert "torch._C._storage_Use_Count" in out["refcount"] and "check='identity'" in out["refcount"]
    else:
        assert out["refcount"] == "accepted"

