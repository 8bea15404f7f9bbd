"""GELUs written out in Python run as ``F.gelu``: the same function against float64 (closer than the chain
of ops under autocast, a few ulps from it in float32), one saved tensor instead of four counted by the
ledger on Transformers' GPT-2, fewer ops dispatched, and everything undone by ``remove()``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from amp_backends.memory import fused_activations, memory_lean
from amp_backends.memory.ledger import Ledger

activations = pytest.importorskip("transformers.activations")
transformers = pytest.importorskip("transformers")

WRITTEN_OUT = {
    "gelu_new": lambda: activations.NewGELUActivation(),
    "gelu_fast": lambda: activations.FastGELUActivation(),
    "gelu_accurate": lambda: activations.AccurateGELUActivation(),
    "gelu_python": lambda: activations.GELUActivation(use_gelu_python=True),
}


def _exact(x: torch.Tensor, kind: str) -> torch.Tensor:
    """The function in float64: the tanh approximation, or the erf form for gelu_python."""
    x = x.double()
    if kind == "gelu_python":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _out_and_grad(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_(True)
    out = module(x)
    out.backward(g)
    return out.detach(), x.grad


@pytest.mark.parametrize("kind", sorted(WRITTEN_OUT))
def test_the_same_function_rounded_once(kind: str) -> None:
    """bf16 (what autocast feeds an MLP's activation): the fused op's outputs and input gradients are at
    least as close to the float64 function as the chain's, which rounds at every op; float32: within a
    few ulps of the chain's."""
    torch.manual_seed(0)
    x32 = torch.randn(4096) * 3
    g32 = torch.randn(4096)
    x64 = x32.double().requires_grad_(True)
    _exact(x64, kind).backward(g32.double())
    exact_out, exact_grad = _exact(x32, kind), x64.grad
    module = WRITTEN_OUT[kind]()
    chain = {dt: _out_and_grad(module, x32.to(dt), g32.to(dt)) for dt in (torch.float32, torch.bfloat16)}
    handle = fused_activations(module)
    assert handle.modules == [module]
    fused = {dt: _out_and_grad(module, x32.to(dt), g32.to(dt)) for dt in (torch.float32, torch.bfloat16)}
    handle.remove()
    assert "forward" not in module.__dict__

    def err(t: torch.Tensor, ref: torch.Tensor) -> float:
        return float((t.double() - ref).abs().max())

    for i, ref in enumerate((exact_out, exact_grad)):
        assert err(fused[torch.bfloat16][i], ref) <= err(chain[torch.bfloat16][i], ref), (kind, i)
        assert fused[torch.bfloat16][i].dtype == torch.bfloat16
        torch.testing.assert_close(fused[torch.float32][i], chain[torch.float32][i], rtol=2e-6, atol=2e-6)


def test_other_activations_are_left_as_they_are() -> None:
    model = nn.Sequential(activations.GELUActivation(), activations.QuickGELUActivation(), nn.GELU(),
                          activations.NewGELUActivation())
    handle = fused_activations(model)
    assert handle.modules == [model[3]], "F.gelu already, or another function (x * sigmoid(1.702 x))"
    assert fused_activations(model).modules == [], "twice: nothing more to change"
    handle.remove()
    assert all("forward" not in m.__dict__ for m in model)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).train()


def test_gpt2_saves_one_tensor_where_the_chain_saved_four_and_runs_fewer_ops() -> None:
    """Transformers' GPT-2 (gelu_new) under bf16 autocast: the ledger's activations after the forward
    are lower by exactly three bf16 tensors of the MLP's inner width per layer (tanh's output, 0.5 x and
    1 + tanh, saved by the chain beside its input), and the forward and backward dispatch fewer ops."""
    x = torch.randint(0, 128, (4, 32))
    counted = {}
    for fused in (False, True):
        model = _gpt2()
        handle = fused_activations(model) if fused else None
        assert handle is None or len(handle.modules) == 2
        ledger = Ledger()
        ledger.register([x], params=model.parameters())
        ops = _Ops()
        with ops, ledger:
            with ledger.phase("forward"), torch.autocast("cpu", dtype=torch.bfloat16):
                torch.manual_seed(1)
                loss = model(x, labels=x).loss
            ledger.restart_peak()
            after_forward = ledger.report(params=model.parameters())
            loss.backward()
        counted[fused] = (after_forward.activations_by_dtype.get("bfloat16", 0), ops.count)
    inner, layers, tokens = 4 * 64, 2, 4 * 32
    assert counted[False][0] - counted[True][0] == layers * 3 * tokens * inner * 2, counted
    assert counted[True][1] < counted[False][1] - layers * 10, counted


def test_memory_lean_turns_it_on_and_remove_turns_it_off() -> None:
    import amp_backends

    model = _gpt2()
    mlps = [block.mlp.act for block in model.transformer.h]
    lean = memory_lean(model, torch.optim.AdamW(model.parameters()), backend=amp_backends.get("cpu"),
                       weights=torch.bfloat16)
    assert all("forward" in act.__dict__ for act in mlps) and "2 GELUs fused" in repr(lean)
    lean.remove()
    assert all("forward" not in act.__dict__ for act in mlps)
    off = memory_lean(model, torch.optim.AdamW(model.parameters()), backend=amp_backends.get("cpu"),
                      weights=torch.bfloat16, activations=False)
    assert all("forward" not in act.__dict__ for act in mlps) and "GELU" not in repr(off)
    off.remove()


def test_a_gelu_a_precision_policy_runs_in_float32_is_left_to_it() -> None:
    """A precision policy that runs a written-out GELU in float32 has replaced its forward: the lever
    leaves that module alone (its output stays float32 under bf16 autocast), and fuses the others."""
    import amp_backends

    model = _gpt2()
    policy = amp_backends.precision_policy(model, fp32=["transformer.h.0.mlp.act"])
    handle = fused_activations(model)
    assert handle.modules == [model.transformer.h[1].mlp.act]
    x = torch.randn(2, 8, 256, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.transformer.h[0].mlp.act(x).dtype == torch.float32, "the policy's float32 forward"
        assert model.transformer.h[1].mlp.act(x).dtype == torch.bfloat16
    handle.remove()
    policy.remove()
