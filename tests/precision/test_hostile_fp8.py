"""Hostile input to a precision policy's fp8 conversion: Linear subclasses that do more than a Linear
(LoRA adapters, an output scale, a mask), layers whose weight is computed before each forward (weight
norm, pruning) or does not exist yet (a lazy layer), hooks registered before the conversion, and fp8
all-gather with an optimizer built before the conversion or kept after ``remove()``.

References are independent of the policy: the same modules untouched under torch's autocast,
torchao's fp8 layer used by hand, the same hooks on an unconverted model, and plain fp8 training
through the same steps. On CPU with ``emulate=True``."""

from __future__ import annotations

import copy
import warnings
import weakref

import pytest
import torch
from torch import nn

import amp_backends
from amp_backends import precision_policy
from amp_backends.precision.fp8 import engine as fp8_engine

from fp8_marks import needs_torchao

pytestmark = needs_torchao


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        yield


def _autocast_out(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16):
        return model(x)


# -- Linear subclasses ---------------------------------------------------------------------------
class LoRALinear(nn.Linear):
    """A Linear with a low-rank adapter (as loralib's): own forward, own parameters."""

    def __init__(self, in_features: int, out_features: int, rank: int = 4) -> None:
        super().__init__(in_features, out_features)
        self.lora_A = nn.Parameter(torch.randn(rank, in_features) * 0.1)
        self.lora_B = nn.Parameter(torch.randn(out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (x @ self.lora_A.t()) @ self.lora_B.t()


class ScaledLinear(nn.Linear):
    """An output scale, as a buffer, and a forward using it."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.register_buffer("scale", torch.full((out_features,), 3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class MaskedLinear(nn.Linear):
    """A fixed mask on the weight, the Linear's forward untouched: the state alone would be lost."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.register_buffer("mask", (torch.rand(out_features, in_features) > 0.5).float())


class NormedLinear(nn.Linear):
    """A submodule of its own."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.norm = nn.LayerNorm(out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))


class RenamedLinear(nn.Linear):
    """A subclass that changes nothing a conversion could lose."""

    def extra_repr(self) -> str:
        return "renamed, " + super().extra_repr()


def _with(layer_cls: type) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(layer_cls(32, 64), nn.GELU(), nn.Linear(64, 64))


@pytest.mark.parametrize(("cls", "words"), [
    (LoRALinear, "has its own forward; parameters lora_A, lora_B"),
    (ScaledLinear, "has its own forward; buffers scale"),
    (MaskedLinear, "has buffers mask"),
    (NormedLinear, "has its own forward; submodules norm"),
])
def test_a_linear_subclass_doing_more_than_a_linear_is_left_with_the_reason(cls, words):
    model = _with(cls)
    reference = copy.deepcopy(model)
    layer, keys = model[0], list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    policy = precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True)
    assert list(policy.fp8) == ["2"] and model[0] is layer
    reason = policy.fp8_skipped["0"]
    assert reason.startswith(f"{cls.__name__}, a Linear subclass, {words}") and "would drop" in reason, reason
    assert f"fp8_convert={{{cls.__name__}: fn}}" in reason
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    x = torch.randn(8, 32)
    with torch.autocast("cpu", torch.bfloat16):
        ran = model[0](x)
        expected = reference[0](x)
    assert torch.equal(ran, expected), "the subclass still runs its own forward, as torch runs it"


def test_a_plain_linear_given_extra_state_is_left_too():
    model = _with(nn.Linear)
    model[0].register_buffer("mask", torch.ones(64, 32))
    policy = precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True)
    assert policy.fp8_skipped["0"].startswith("this Linear has buffers mask") and "mask" in model.state_dict().__repr__()


def _by_hand(linear: nn.Linear, x: torch.Tensor, cls: type | None = None) -> tuple[nn.Module, torch.Tensor]:
    """torchao's Float8Linear (or ``cls``) from a copy of ``linear``, run as on CUDA: input in bf16, autocast off."""
    float8 = fp8_engine.engine()
    layer = (cls or float8.float8_linear.Float8Linear).from_float(copy.deepcopy(linear),
                                                                  config=fp8_engine.config("tensorwise", True))
    with torch.autocast("cpu", enabled=False):
        return layer, layer(x.to(torch.bfloat16))


def test_a_subclass_that_changes_nothing_is_converted_as_a_linear():
    model = _with(RenamedLinear)
    x = torch.randn(8, 32)
    _, expected = _by_hand(model[0], x)
    policy = precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True)
    assert sorted(policy.fp8) == ["0", "2"] and policy.fp8_skipped == {}
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(model[0](x), expected)


def _lora_to_fp8():
    from amp_backends.precision.fp8.linear import Fp8Linear

    class Fp8LoRALinear(Fp8Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + (x @ self.lora_A.t()) @ self.lora_B.t()

    def convert(layer: LoRALinear, fp8_linear) -> nn.Module:
        new = fp8_linear(layer, cls=Fp8LoRALinear)
        new.lora_A, new.lora_B = layer.lora_A, layer.lora_B
        return new

    return convert


@pytest.mark.parametrize("all_gather", [False, True], ids=["plain", "all-gather"])
def test_fp8_convert_trains_a_lora_linear_as_torchaos_layer_and_the_adapter_by_hand(all_gather):
    """The opt-in: fp8_convert={LoRALinear: fn}. The base matmul is torchao's fp8 layer, the adapter
    runs under autocast: outputs and every gradient bitwise those computed by hand; the same parameter
    objects and state_dict keys; remove() gives back the LoRALinear with the trained values."""
    model = _with(LoRALinear)
    lora = model[0]
    x = torch.randn(8, 32)
    float8 = fp8_engine.engine()
    by_hand, base = _by_hand(lora, x)
    A, B = (nn.Parameter(p.detach().clone()) for p in (lora.lora_A, lora.lora_B))
    with torch.autocast("cpu", torch.bfloat16):
        adapter = (x @ A.t()) @ B.t()
    expected = base + adapter
    expected.float().square().sum().backward()

    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)   # built before the conversion
    policy = precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True, fp8_all_gather=all_gather,
                              fp8_convert={LoRALinear: _lora_to_fp8()})
    assert policy.fp8["0"] == "Linear (converted by fp8_convert)" and isinstance(model[0], float8.float8_linear.Float8Linear)
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    out = _autocast_out(model[0], x)
    assert torch.equal(out, expected)
    out.float().square().sum().backward()
    for mine, theirs in [(lora.weight, by_hand.weight), (lora.bias, by_hand.bias), (lora.lora_A, A), (lora.lora_B, B)]:
        assert torch.equal(mine.grad, theirs.grad)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt.step()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(not torch.equal(before[k], trained[k]) for k in ("0.weight", "0.lora_A", "0.lora_B"))
    policy.remove()
    assert model[0] is lora and type(lora.weight) is nn.Parameter
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())


def test_fp8_convert_returning_none_leaves_the_layer_with_the_reason():
    model = _with(LoRALinear)
    policy = precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True, fp8_convert={LoRALinear: lambda m, f: None})
    assert type(model[0]) is LoRALinear and policy.fp8_skipped["0"].startswith(
        "fp8_convert's function for LoRALinear left it as it is (returned None)")


def _drops_the_adapter(layer, fp8_linear):
    return fp8_linear(layer)


def _copies_the_adapter(layer, fp8_linear):
    new = fp8_linear(layer)
    new.lora_A, new.lora_B = (nn.Parameter(p.detach().clone()) for p in (layer.lora_A, layer.lora_B))
    return new


@pytest.mark.parametrize(("convert", "error", "words"), [
    ([LoRALinear], TypeError, "takes a dict {LinearClass: fn}"),
    ({nn.GELU: _drops_the_adapter}, TypeError, "is not an nn.Linear class"),
    ({LoRALinear: "fn"}, TypeError, "the value for LoRALinear is a str, not callable"),
    ({LoRALinear: lambda m, f: "not a module"}, TypeError, "returned a str, not an nn.Module"),
    ({LoRALinear: _drops_the_adapter}, TypeError, "state_dict keys differ (missing: lora_A, lora_B; new: none)"),
    ({LoRALinear: _copies_the_adapter}, TypeError, "holding another tensor as 'lora_A'"),
    ({LoRALinear: lambda m, f: f(m, cls=nn.Linear)}, TypeError, "cls=...) takes a subclass of"),
])
def test_a_bad_fp8_convert_is_refused_and_changes_nothing(convert, error, words):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), LoRALinear(32, 64), nn.GELU(), nn.Linear(64, 64))
    layers, keys = list(model), list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    with pytest.raises(error) as info:
        precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True, fp8_all_gather=True, fp8_convert=convert)
    assert words in str(info.value), str(info.value)
    assert list(model) == layers and list(model.state_dict()) == keys, "the layer converted before it is back"
    assert [id(p) for p in model.parameters()] == params and all(type(p) is nn.Parameter for p in model.parameters())


def test_fp8_convert_without_fp8_is_refused():
    with pytest.raises(ValueError, match="fp8_convert applies to the layers fp8= selects"):
        precision_policy(_with(LoRALinear), fp8_convert={LoRALinear: _drops_the_adapter})


# -- layers whose weight is computed, or not there yet ---------------------------------------------
def _weight_norm(layer):
    return nn.utils.parametrizations.weight_norm(layer)


def _legacy_weight_norm(layer):
    return nn.utils.weight_norm(layer)


def _spectral_norm(layer):
    return nn.utils.spectral_norm(layer)


def _pruned(layer):
    torch.manual_seed(1)
    nn.utils.prune.random_unstructured(layer, "weight", amount=0.5)
    return layer


@pytest.mark.parametrize(("make", "words"), [
    (_weight_norm, "its weight is parametrized (torch.nn.utils.parametrize"),
    (_legacy_weight_norm, "torch.nn.utils.weight_norm recomputes its weight from weight_g and weight_v"),
    (_spectral_norm, "torch.nn.utils.spectral_norm recomputes its weight before each forward"),
    (_pruned, "pruned (torch.nn.utils.prune): its weight is weight_orig * weight_mask"),
], ids=["weight_norm", "legacy-weight_norm", "legacy-spectral_norm", "pruned"])
@pytest.mark.parametrize("selector", ["class", "name"])
def test_a_layer_whose_weight_is_computed_is_left_with_the_reason(make, words, selector):
    def build() -> nn.Sequential:  # legacy weight norm and pruning cannot be deep-copied
        torch.manual_seed(0)
        return nn.Sequential(make(nn.Linear(32, 64)), nn.GELU(), nn.Linear(64, 64))

    model, reference = build(), build()
    layer, keys = model[0], list(model.state_dict())
    policy = precision_policy(model, fp32=(), fp8=[nn.Linear] if selector == "class" else ["0", "2"], emulate=True)
    assert list(policy.fp8) == ["2"] and model[0] is layer and list(model.state_dict()) == keys
    assert policy.fp8_skipped["0"].startswith(words) and "first" in policy.fp8_skipped["0"], policy.fp8_skipped
    x = torch.randn(8, 32)
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(model[0](x), reference[0](x)), "still computed by torch's own hook"


def test_an_uninitialised_lazy_linear_is_left_saying_to_run_the_model_first():
    model = nn.Sequential(nn.LazyLinear(64), nn.GELU(), nn.Linear(64, 64))
    policy = precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True)
    assert list(policy.fp8) == ["2"]
    assert policy.fp8_skipped["0"] == ("an uninitialised LazyLinear (its parameters get their shape at the first "
                                       "forward): run the model once before the policy")
    assert _autocast_out(model, torch.randn(4, 32)).shape == (4, 64) and type(model[0]) is nn.Linear
    policy.remove()
    again = precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True)
    assert sorted(again.fp8) == ["0", "2"], "initialised by a forward, it converts"


# -- hooks registered before the conversion --------------------------------------------------------
def _hooked(calls: list[str], seen: dict[str, torch.Tensor]) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    layer = model[0]
    layer.register_forward_pre_hook(lambda m, a: calls.append("forward_pre"))
    layer.register_forward_pre_hook(lambda m, a, k: calls.append("forward_pre_kwargs"), with_kwargs=True)
    layer.register_forward_hook(lambda m, a, o: calls.append("forward"))
    layer.register_full_backward_pre_hook(lambda m, go: calls.append("backward_pre"))

    def backward(module, grad_input, grad_output):
        calls.append("backward")
        seen["grad_input"] = grad_input[0]

    layer.register_full_backward_hook(backward)
    layer.register_state_dict_pre_hook(lambda m, prefix, keep_vars: calls.append("state_dict_pre"))
    layer.register_state_dict_post_hook(lambda m, sd, prefix, meta: calls.append("state_dict_post"))
    layer.register_load_state_dict_pre_hook(lambda *a: calls.append("load_pre"))
    layer.register_load_state_dict_post_hook(lambda m, keys: calls.append("load_post"))
    return model


def _exercise(model: nn.Module, calls: list[str], seen: dict[str, torch.Tensor]) -> torch.Tensor:
    x = torch.randn(8, 32, requires_grad=True)
    _autocast_out(model, x).float().square().sum().backward()
    assert torch.equal(seen.pop("grad_input"), x.grad), "the full backward hook sees the gradient of the input"
    model.load_state_dict(model.state_dict())
    return x.grad


@pytest.mark.parametrize("all_gather", [False, True], ids=["plain", "all-gather"])
def test_hooks_registered_before_the_conversion_are_called_as_on_the_unconverted_layer(all_gather):
    expected: list[str] = []
    seen: dict[str, torch.Tensor] = {}
    _exercise(_hooked(expected, seen), expected, seen)
    assert expected == ["forward_pre", "forward_pre_kwargs", "forward", "backward_pre", "backward", "state_dict_pre",
                        "state_dict_post", "load_pre", "load_post"]
    calls: list[str] = []
    model = _hooked(calls, seen)
    policy = precision_policy(model, fp32=(), fp8=["0"], emulate=True, fp8_all_gather=all_gather)
    assert list(policy.fp8) == ["0"] and type(model[0]).__name__ == "Fp8Linear"
    _exercise(model, calls, seen)
    assert calls == expected
    calls.clear()
    later = []
    model[0].register_full_backward_hook(lambda m, gi, go: later.append("after"))
    policy.remove()
    assert type(model[0]) is nn.Linear
    _exercise(model, calls, seen)
    assert calls == expected and later == ["after"], "after remove(): the same hooks, and one registered meanwhile"


# -- fp8 all-gather: the optimizer built before the conversion, and kept after remove() -------------
def _mlp() -> nn.Sequential:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 48))


def _train(all_gather: bool, optimizer_first: bool, steps: int = 5, remove_at: int = 3):
    model = _mlp()
    ids = [id(p) for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer_first else None
    policy = precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True, fp8_all_gather=all_gather)
    assert [id(p) for p in model.parameters()] == ids, "the same parameter objects"
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-2)
    snapshots = []
    for step in range(steps):
        if step == remove_at:
            policy.remove()
            assert [type(m) for m in model] == [nn.Linear, nn.GELU, nn.Linear, nn.GELU, nn.Linear]
        opt.zero_grad()
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 48, generator=g)
        nn.functional.mse_loss(_autocast_out(model, x).float(), y).backward()
        opt.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    assert [id(p) for p in model.parameters()] == ids and all(type(p) is nn.Parameter for p in model.parameters())
    return snapshots


@pytest.mark.parametrize("optimizer_first", [False, True], ids=["optimizer-after", "optimizer-before"])
def test_fp8_all_gather_trains_with_any_optimizer_through_remove_as_plain_fp8(optimizer_first):
    """With the optimizer built before or after the conversion, 3 fp8 steps, remove(), 2 bf16 steps:
    every parameter bitwise that of plain fp8 (no all-gather) through the same steps, and every weight
    moves at every step, after remove() too."""
    gathered = _train(True, optimizer_first)
    plain = _train(False, optimizer_first)
    for step, (a, b) in enumerate(zip(gathered, plain)):
        assert all(torch.equal(p, q) for p, q in zip(a, b)), f"step {step}"
    for step in range(1, len(gathered)):
        assert all(not torch.equal(p, q) for p, q in zip(gathered[step - 1], gathered[step])), f"step {step} moved"


def test_fp8_all_gather_keeps_the_weights_own_tensor_hooks():
    """An optimizer stepping in the backward (post-accumulate-grad hooks on the weights) keeps working
    under fp8 all-gather and after remove(): the hooks see each gradient."""
    model = _mlp()
    seen = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    policy = precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True, fp8_all_gather=True)
    x = torch.randn(8, 32)
    for _ in range(2):
        model.zero_grad()
        _autocast_out(model, x).float().sum().backward()
        assert len(seen) and torch.equal(seen[-1], model[0].weight.grad)
        policy.remove()
    assert len(seen) == 2


def test_fp8_all_gather_is_refused_where_the_weight_cannot_be_swapped_in_place():
    model = _mlp()
    watcher = weakref.ref(model[2].weight)
    layers = list(model)
    with pytest.raises(ValueError) as info:
        precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True, fp8_all_gather=True)
    message = str(info.value)
    assert "'2': something holds a weak reference to its weight" in message and "fp8_all_gather=False" in message
    assert list(model) == layers and all(type(p) is nn.Parameter for p in model.parameters())
    assert watcher() is model[2].weight


def test_fp8_all_gather_keeps_tied_weights_tied():
    """Two Linear layers sharing one weight: one parameter object before, during and after, and the
    training bitwise that of plain fp8."""
    def train(all_gather: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        model[2].weight = model[0].weight
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        policy = precision_policy(model, fp32=(), fp8=[nn.Linear], emulate=True, fp8_all_gather=all_gather)
        assert model[0].weight is model[2].weight and len(list(model.parameters())) == 3
        for step in range(2):
            opt.zero_grad()
            _autocast_out(model, torch.randn(4, 64, generator=torch.Generator().manual_seed(step))).float().sum().backward()
            opt.step()
        policy.remove()
        assert model[0].weight is model[2].weight and type(model[0].weight) is nn.Parameter
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(True), train(False)))


def test_the_inspectors_float32_reference_keeps_a_layers_hooks_and_what_an_fp8_convert_class_adds():
    """check_model's float32 reference runs each fp8 layer as a plain Linear: with the layer's forward hooks
    (an adapter added by a hook is in both runs, so the layer's error stays an fp8 error), and a layer an
    fp8_convert class made (a LoRA adapter of its own) stays in fp8 there, with a note saying so."""
    x = torch.randn(8, 32)
    hooked = _with(nn.Linear)
    policy = precision_policy(hooked, fp32=(), fp8=[nn.Linear], emulate=True)
    try:
        hooked[0].register_forward_hook(lambda m, args, out: out + 1000.0)
        report = amp_backends.check_model(hooked, x, "cpu", torch.bfloat16, memory=False)
    finally:
        policy.remove()
    rows = {r.name: r for r in report.rows}
    assert rows["0"].output_error is not None and rows["0"].output_error < 0.01, "the hook ran in both runs"
    assert not any("ran in fp8 in the float32 reference" in n for n in report.notes)

    lora = _with(LoRALinear)
    policy = precision_policy(lora, fp32=(), fp8=[nn.Linear], emulate=True, fp8_convert={LoRALinear: _lora_to_fp8()})
    try:
        report = amp_backends.check_model(lora, x, "cpu", torch.bfloat16, memory=False)
    finally:
        policy.remove()
    assert any("ran in fp8 in the float32 reference too" in n and ": 0;" in n for n in report.notes), report.notes
    assert isinstance(lora[0], LoRALinear), "the model is as it was"
