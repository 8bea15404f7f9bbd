"""flat_grads() with parameters whose gradients are not plain contiguous tensors: a channels_last conv
net, a transposed weight, a zero-element parameter. The arena lays each gradient out as torch's
AccumulateGrad does (the parameter's strides where it is dense), stays in use, and the scaler's step on
it is bitwise torch's GradScaler + unscale_ + clip_grad_norm_."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

import amp_backends
from amp_backends.gradients.arena import CHECKS

pytestmark = pytest.mark.filterwarnings("ignore::amp_backends.PerformanceWarning")

#: What would say the arena was not used, or that a gradient was laid out against its parameter.
_BAD_WARNINGS = ("flat_grads", "outside the arena", "gradient layout contract")


@dataclass
class _Run:
    params: list[torch.Tensor]
    norms: list[torch.Tensor]
    #: each parameter's gradient strides and its own, after the last step
    grad_strides: list[tuple[int, ...]]
    param_strides: list[tuple[int, ...]]
    warnings: list[str] = field(default_factory=list)
    #: the arena's problem() after each backward (arena runs only)
    problems: list[str | None] = field(default_factory=list)


def _train(make: Callable[[], torch.nn.Module], batch: Callable[[torch.Generator], torch.Tensor], arena: bool, *,
           steps: int = 3, micro: int = 1, set_to_none: bool = True, check: str = "identity") -> _Run:
    """``steps`` fp16-autocast steps of SGD with momentum, ``micro`` micro-batches each, the gradients
    clipped to 0.05. ``arena``: the package's scaler on flat_grads(); else torch's GradScaler,
    unscale_ and torch.nn.utils.clip_grad_norm_ (the reference)."""
    be = amp_backends.get("cpu")
    model = make()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    flat = amp_backends.flat_grads(opt, check=check) if arena else None
    scaler = be.grad_scaler(torch.float16, init_scale=1024.0) if arena else torch.amp.GradScaler("cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(1)
    norms: list[torch.Tensor] = []
    problems: list[str | None] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.zero_grad(set_to_none=set_to_none)
            for _ in range(micro):
                with be.autocast(torch.float16):
                    loss = model(batch(g)).float().square().mean()
                scaler.scale(loss).backward()
                if flat is not None:
                    problems.append(flat.problem())
            if flat is not None:
                norms.append(scaler.clip_grad_norm_(opt, 0.05).detach().clone())
            else:
                scaler.unscale_(opt)
                norms.append(torch.nn.utils.clip_grad_norm_(params, 0.05).detach().clone())
            scaler.step(opt)
            scaler.update()
    return _Run([p.detach().clone() for p in params], norms, [p.grad.stride() for p in params],
                [p.stride() for p in params], [str(w.message) for w in caught], problems)


def _assert_bitwise(ours: _Run, ref: _Run) -> None:
    assert len(ours.params) == len(ref.params)
    for a, b in zip(ours.params, ref.params):
        assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b)
    assert len(ours.norms) == len(ref.norms)
    for a, b in zip(ours.norms, ref.norms):
        assert torch.equal(a, b), (ours.norms, ref.norms)
    assert ours.grad_strides == ref.grad_strides, "the arena's gradients are laid out as torch's"


def _assert_arena_in_use(run: _Run) -> None:
    assert run.problems and all(p is None for p in run.problems), run.problems
    bad = [w for w in run.warnings if any(b in w for b in _BAD_WARNINGS)]
    assert not bad, bad


def _conv_net() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 8, 3))
    return net.to(memory_format=torch.channels_last)


def _images(g: torch.Generator) -> torch.Tensor:
    return torch.randn(2, 16, 7, 7, generator=g).to(memory_format=torch.channels_last)


def test_a_channels_last_conv_net_is_bitwise_torch_with_the_parameters_strides() -> None:
    """channels_last convs, 3 steps, the package's scaler clipping on the arena: parameters and norms
    bitwise torch's GradScaler + unscale_ + clip_grad_norm_; each weight's .grad has its parameter's
    strides (channels_last); no layout-contract or fallback warning."""
    ref = _train(_conv_net, _images, arena=False)
    ours = _train(_conv_net, _images, arena=True)
    weights = [i for i, s in enumerate(ours.param_strides) if len(s) == 4]
    assert len(weights) == 2
    assert [ours.param_strides[i] for i in weights] == [(144, 1, 48, 16), (288, 1, 96, 32)], "channels_last weights"
    for i in weights:
        assert ours.grad_strides[i] == ours.param_strides[i], "each weight's gradient has its parameter's strides"
    _assert_bitwise(ours, ref)
    _assert_arena_in_use(ours)


class _Transposed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wt = torch.nn.Parameter(torch.randn(6, 4).t())  # (4, 6), strides (1, 4)
        self.lin = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x @ self.wt)


def _rows(g: torch.Generator) -> torch.Tensor:
    return torch.randn(5, 4, generator=g)


@pytest.mark.parametrize("check", CHECKS)
def test_a_transposed_parameter_gets_torchs_gradient_strides(check: str) -> None:
    """A Parameter made of a transposed view: the arena's gradient has torch's strides (the parameter's,
    (1, 4)); parameters and norms bitwise torch's."""
    ref = _train(_Transposed, _rows, arena=False)
    ours = _train(_Transposed, _rows, arena=True, check=check, micro=2, set_to_none=False)
    ref_acc = _train(_Transposed, _rows, arena=False, micro=2, set_to_none=False)
    assert ref.grad_strides[0] == ref.param_strides[0] == (1, 4)
    assert ours.grad_strides[0] == (1, 4)
    _assert_bitwise(ours, ref_acc)
    _assert_bitwise(_train(_Transposed, _rows, arena=True, check=check), ref)
    _assert_arena_in_use(ours)


class _WithEmpty(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(4, 5)
        self.empty = torch.nn.Parameter(torch.empty(0, 4))
        self.last = torch.nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.first(x).relu() + self.empty.sum())


@pytest.mark.parametrize("check", CHECKS)
def test_a_zero_element_parameter_keeps_the_arena_in_use(check: str) -> None:
    """A (0, 4) parameter beside normal ones, zero_grad(set_to_none=False) and 2 micro-batches a step:
    the arena stays in use (problem() None after every backward, no 'outside the arena' warning) and
    the results are bitwise torch's."""
    ref = _train(_WithEmpty, _rows, arena=False, micro=2, set_to_none=False)
    ours = _train(_WithEmpty, _rows, arena=True, micro=2, set_to_none=False, check=check)
    assert len(ours.problems) == 6
    _assert_arena_in_use(ours)
    _assert_bitwise(ours, ref)


class _OddSizeOne(torch.nn.Module):
    """Contiguous parameters whose size-1 dimensions have unusual strides: (1, 4) with strides (1, 1),
    (1, 4, 3) with (3, 3, 1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 1).t())
        self.v = torch.nn.Parameter(torch.randn(4, 1, 3).permute(1, 0, 2))
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x * self.w) + (x.unsqueeze(-1) * self.v).sum(-1)


def test_a_contiguous_parameter_with_odd_size_one_strides_gets_torchs_layout() -> None:
    """torch lays such a parameter's gradient out contiguously ((4, 1), (12, 3, 1)), whatever its size-1
    strides: the arena's slots do the same, bitwise, over accumulation of two micro-batches."""
    model = _OddSizeOne()
    assert model.w.is_contiguous() and model.w.stride() == (1, 1) and model.v.is_contiguous()
    ours = _train(_OddSizeOne, _rows, True, micro=2)
    ref = _train(_OddSizeOne, _rows, False, micro=2)
    assert ours.grad_strides == ref.grad_strides
    _assert_bitwise(ours, ref)
    _assert_arena_in_use(ours)
