"""memory_lean's default levers (``saves``, ``activations``, ``activation_outputs``) under hostile use,
each against plain torch doing the same: an edit autograd refuses is refused, a patched activation or a
function mode is not taken for the known function, a bfloat16 model's norms, keyword calls, ``torch.func``,
and a copy of a lean model. Where the device's autocast runs norms in float32 (CUDA), simulated as the
package's other tests simulate it: ``saves.autocast_runs_in_fp32`` answers True, and the reference is
the upcast op itself."""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import amp_backends
from amp_backends import torch_private
from amp_backends.memory import saves
from amp_backends.memory.lean import LeanError, memory_lean
from saved_bytes import saved_storage_bytes

ACTIVE = torch_private.top_saved_tensors_hooks is not None  # (torch 2.4 tells no hooks in force: nothing substituted)
ONLY = dict(saves=False, activations=False, activation_outputs=True, shared_casts=False)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
        yield


class _Mlp(nn.Module):
    def __init__(self, act: nn.Module | None = None) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(16, 64), act if act is not None else nn.GELU(), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, act: nn.Module | None = None) -> None:
        super().__init__()
        self.mlp = _Mlp(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


def _model(act: nn.Module | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_Block(act), _Block(copy.deepcopy(act)))


X = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(X)
    out.float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _equal_grads(model: nn.Module, plain: nn.Module) -> None:
    for a, b in zip(_grads(model), _grads(plain)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("weights", [None, torch.bfloat16], ids=["float32-weights", "bf16-weights-with-masters"])
def test_a_weight_edited_between_forward_and_backward_is_refused_as_autograd_refuses_it(weights) -> None:  # type: ignore[no-untyped-def]
    """The consumer's weight stepped in place after the forward (an optimizer or an EMA before the
    backward): plain torch raises; with activation_outputs the saves after the tag went through the
    lever's hooks, where autograd checks no versions, and the backward used the edited weight (a
    gradient 2x off). Now the same RuntimeError; the tagged output edited likewise."""
    plain, model = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    memory_lean(model, opt, backend="cpu", weights=weights, **ONLY)
    if weights is not None:
        plain.to(weights)
    mixed = weights is not None  # (float32 weights under autocast: the saved weight is autocast's copy)
    for net in (plain, model):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            out = net(X if mixed else X.float())
        with torch.no_grad():
            net[0].mlp.fc2.weight.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.float().sum().backward()
    for net in (plain, model):  # the activation's output itself, kept and edited
        kept = []
        handle = net[0].mlp.act.register_forward_hook(lambda m, a, o: kept.append(o))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = net(X)
        handle.remove()
        with torch.no_grad():
            kept[0].mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.float().sum().backward()


def test_an_activation_class_whose_forward_was_replaced_is_not_taken_for_its_function(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``nn.GELU.forward`` replaced on the class (a fake-quantizing patch, by ``functools.wraps`` or not):
    activation_outputs recomputed ``F.gelu`` in backward where the forward computed the patch (gradients
    14 off); now left alone, bitwise plain autocast's."""
    original = nn.GELU.forward

    @functools.wraps(original)
    def clamped(self, input):  # type: ignore[no-untyped-def]
        return original(self, input).clamp(max=0.5)

    def renamed(self, input):  # type: ignore[no-untyped-def]
        return original(self, input).clamp(max=0.5)

    for patch in (clamped, renamed):
        monkeypatch.setattr(nn.GELU, "forward", patch)
        plain, model = _model(), _model()
        memory_lean(model, None, backend="cpu", **ONLY)
        _equal_grads(model, plain)


def test_a_function_mode_on_during_the_forward_leaves_the_outputs_saved() -> None:
    """A ``TorchFunctionMode`` that rounds ``F.gelu``'s output (fake quantization), on during the forward:
    the recomputation in backward ran outside it (gradients 1.76 off); now the output is saved as plain
    autocast saves it. The default device's mode (``torch.set_default_device``) does not count."""

    class Rounded(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            return out.mul(4).round().div(4) if func is F.gelu else out

    plain, model = _model(), _model()
    memory_lean(model, None, backend="cpu", **ONLY)
    with Rounded():
        _equal_grads(model, plain)
    def forward(net: nn.Module, mode: str | None) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16), (torch.device(mode) if mode else contextlib.nullcontext()):
            net(X)

    saved = {name: saved_storage_bytes(functools.partial(forward, net, mode)) for name, net, mode in (
        ("plain", plain, None), ("lever", model, None), ("lever, default device", model, "cpu"))}
    assert saved["lever, default device"] == saved["lever"]
    assert saved["lever"] < saved["plain"] or not ACTIVE, saved  # (the lever works under the default device's mode)


def test_activations_leaves_a_written_out_gelu_whose_class_forward_was_replaced(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Transformers' ``NewGELUActivation.forward`` replaced on the class (QuickGELU): ``activations=True``
    ran ``F.gelu`` instead (-0.0454 where the patch gives -0.0643 at -2); now left as it is."""
    activations = pytest.importorskip("transformers.activations")

    def quick(self, input):  # type: ignore[no-untyped-def]
        return input * torch.sigmoid(1.702 * input)

    monkeypatch.setattr(activations.NewGELUActivation, "forward", quick)
    plain, model = _model(activations.NewGELUActivation()), _model(activations.NewGELUActivation())
    memory_lean(model, None, backend="cpu", saves=False, activation_outputs=False, shared_casts=False)
    assert "forward" not in vars(model[0].mlp.act)
    x = torch.linspace(-3, 3, 7)
    assert torch.equal(model[0].mlp.act(x), plain[0].mlp.act(x))


def _simulated_fp32(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(saves, "autocast_runs_in_fp32", lambda *args: True)


@pytest.mark.parametrize("kind", ["layer_norm", "group_norm"])
def test_a_bfloat16_models_norms_run_as_autocast_runs_them(kind, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A model made bfloat16 (``model.bfloat16()``, Transformers' ``dtype=torch.bfloat16``) under autocast
    where the device runs norms in float32 (simulated): the lever computed ``fn(x.float(), bf16 weight)``
    and raised (mixed dtypes); now every floating argument is upcast, as autocast casts them: output and
    gradients bitwise the upcast op's."""
    _simulated_fp32(monkeypatch)
    torch.manual_seed(0)
    module = (nn.LayerNorm(8) if kind == "layer_norm" else nn.GroupNorm(2, 8)).bfloat16()
    reference = copy.deepcopy(module)
    saves.low_precision_saves(module)
    x0 = torch.randn(4, 8, generator=torch.Generator().manual_seed(3)).bfloat16()
    results = []
    for net, lever in ((module, True), (reference, False)):
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=lever):
            if lever:
                out = net(x)
            elif kind == "layer_norm":
                out = F.layer_norm(x.float(), (8,), net.weight.float(), net.bias.float(), net.eps)
            else:
                out = F.group_norm(x.float(), 2, net.weight.float(), net.bias.float(), net.eps)
        out.square().sum().backward()
        results.append((out, x.grad, net.weight.grad, net.bias.grad))
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_modules_called_with_keywords_and_softmax_without_a_dim_run_as_their_own(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``ln(input=x)`` and a fused GELU's ``act(input=x)`` raised TypeError (the wrappers took one
    positional argument); ``nn.LogSoftmax()`` without ``dim`` passed ``dim=None`` to ``log_softmax``. Each
    now runs as the module's own forward."""
    _simulated_fp32(monkeypatch)
    activations = pytest.importorskip("transformers.activations")
    torch.manual_seed(0)
    model = nn.ModuleDict({"ln": nn.LayerNorm(8), "act": activations.NewGELUActivation(), "lsm": nn.LogSoftmax()})
    plain = copy.deepcopy(model)
    memory_lean(model, None, backend="cpu")
    assert "forward" in vars(model["ln"]) and "forward" in vars(model["act"])
    x = torch.randn(2, 8)
    assert torch.equal(model["ln"](input=x), plain["ln"](input=x))
    assert torch.equal(model["act"](input=x), F.gelu(x, approximate="tanh"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch's implicit-dim warning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model["lsm"](x.bfloat16()), plain["lsm"](x.bfloat16()))


def test_torch_func_through_the_low_precision_saves_is_plain_autocasts(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``torch.func.grad`` and ``jvp`` of a loss through a LayerNorm (float32 norms simulated): the
    lever's autograd Function has no functorch rules, and raised; inside the transforms the norm runs
    as autocast runs it: gradients bitwise those of the model without the lever."""
    from torch.func import functional_call, grad, jvp

    _simulated_fp32(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    plain = copy.deepcopy(model)
    saves.low_precision_saves(model)
    x = torch.randn(4, 8)

    def loss(net: nn.Module, params: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return functional_call(net, params, (x,)).float().sum()

    ours = grad(functools.partial(loss, model))(dict(model.named_parameters()))
    theirs = grad(functools.partial(loss, plain))(dict(plain.named_parameters()))
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    tangent = (torch.ones(8),)
    for net in (model, plain):
        params = dict(net.named_parameters())
        out = jvp(lambda b: loss(net, {**params, "0.bias": b}), (params["0.bias"].detach(),), tangent)  # noqa: B023
        if net is model:
            first = out
    assert torch.equal(first[0], out[0]) and torch.equal(first[1], out[1])


def test_memory_lean_on_a_copy_of_a_lean_model_is_refused_naming_what_it_carries() -> None:
    """A deep copy of a lean model (an EMA, a snapshot) carries its levers: memory_lean on the copy took
    it, its remove() left them (GELUs fused, norms wrapped, hooks twice: logits 2e-3 off plain's). Now
    refused, naming the module and the way out, the copy left as it was."""
    model = _model()
    lean = memory_lean(model, None, backend="cpu")
    snapshot = copy.deepcopy(model)
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in snapshot.modules())
    with pytest.raises(LeanError, match=r"memory levers on already \(.*\).*copy the model before memory_lean"):
        memory_lean(snapshot, None, backend="cpu")
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in snapshot.modules()) == hooks
    lean.remove()
    again = copy.deepcopy(model)
    memory_lean(again, None, backend="cpu").remove()  # a copy taken after remove() is plain


def test_the_handle_counts_only_the_activations_whose_outputs_it_recomputes() -> None:
    """GPT-2's written-out GELU is known only once ``activations`` runs it fused: with that lever off the
    handle said "2 activations' outputs recomputed" where none was; now it says nothing of them."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    for fused in (False, True):
        torch.manual_seed(0)
        lean = memory_lean(transformers.GPT2LMHeadModel(config), None, backend="cpu", activations=fused)
        assert ("2 activations' outputs recomputed" in repr(lean)) == (fused and ACTIVE), repr(lean)
        assert "0 activations' outputs" not in repr(lean)
