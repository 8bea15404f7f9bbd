"""A float32 module's buffers in a low-precision model (second review of the write-back): the float32
copies written back move no version counter, leave inference tensors alone, keep aliased buffers as
plain torch leaves them; fp8 layers carry only the user's public attributes."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from amp_backends import precision_policy

from fp8_marks import needs_torchao


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Scale(nn.Module):
    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("s", buffer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


class Shared(nn.Module):
    """One bf16 buffer read by a module left in autocast (which saves it for backward) and by one a
    policy runs in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.lin = Scale(torch.linspace(0.5, 1.5, 8)), nn.LayerNorm(8), nn.Linear(8, 8)
        self.b = Scale(self.a.s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.b(self.norm(self.a(x))))


def test_a_buffer_saved_for_another_ops_backward_stays_valid() -> None:
    """The write-back used to move the shared buffer's version counter: the unselected module's
    backward then raised. The gradients equal those of the same model with the float32 modules run
    on float32 copies by hand; the buffer's version does not move."""
    torch.manual_seed(0)
    model = Shared().bfloat16()
    model.b.s = model.a.s
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    reference = copy.deepcopy(model)
    precision_policy(model, fp32=["b", "norm"])
    version = model.a.s._version
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
    y.float().sum().backward()
    assert model.a.s._version == version
    xr = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = reference.a(xr)
        with torch.autocast("cpu", enabled=False):
            h = nn.functional.layer_norm(h.float(), (8,), reference.norm.weight.float(), reference.norm.bias.float())
            h = h * reference.b.s.float()
        out = reference.lin(h)
    out.float().sum().backward()
    assert torch.equal(x.grad, xr.grad)


def test_buffers_made_under_inference_mode_are_left_alone_in_eval() -> None:
    """A model built under inference_mode (its buffers inference tensors), run later in eval under
    no_grad: the output is the plain model's with the BatchNorm in float32 by hand (nothing written)."""
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)).bfloat16().eval()
    precision_policy(model, fp32=["1"])
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(x)
        h = model[0](x)
        with torch.autocast("cpu", enabled=False):
            bn = model[1]
            h = nn.functional.batch_norm(h.float(), bn.running_mean.float(), bn.running_var.float(),
                                         bn.weight.float(), bn.bias.float(), False, 0.0, bn.eps)
        expected = model[2](h)
    assert torch.equal(y, expected)


class Ring(nn.Module):
    """A ring buffer and a view of its head, both buffers; the forward advances the ring."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("hist", torch.zeros(8))
        self.register_buffer("head", self.hist[:4])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.hist.add_(1)
        return x * 2


@pytest.mark.parametrize("copied", [False, True], ids=["view", "deepcopy-shared-storage"])
def test_buffers_sharing_memory_keep_what_the_forward_wrote(copied: bool) -> None:
    """Buffers that alias (a view; a deep copy shares their storage without the view) each get a float32
    copy: the one the forward changed is written back, not a stale one over it, as plain torch leaves
    them (all ones)."""
    model = nn.Sequential(Ring(), nn.Linear(4, 4)).bfloat16()
    model[0].head = model[0].hist[:4]
    if copied:
        model = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    precision_policy(model, fp32=["0"])
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    for net in (plain, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            net(x)
    assert model[0].hist.tolist() == plain[0].hist.tolist() == [1.0] * 8
    assert model[0].head.tolist() == plain[0].head.tolist() == [1.0] * 4


@needs_torchao
def test_fp8_layers_carry_the_users_public_attributes_only() -> None:
    """A Linear's public attribute goes to its fp8 layer and back; a library's private one (Accelerate's
    hook bound to the old Linear) does not; check_model's float32 stand-in carries no fp8 recipe."""
    from amp_backends.precision.fp8 import engine

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32))
    scale, hook = object(), object()
    model[1].scale, model[1]._hf_hook = scale, hook
    policy = precision_policy(model, fp32=(), fp8=["1"], emulate=True)
    assert model[1].scale is scale and "_hf_hook" not in vars(model[1])
    with engine.as_linear(model):
        assert type(model[1]) is nn.Linear and model[1].scale is scale
        assert not hasattr(model[1], "fp8_recipe")
    policy.remove()
    assert type(model[1]) is nn.Linear and model[1].scale is scale and model[1]._hf_hook is hook
