"""Hostile input to precision policies: every refusal names the argument and the way out and leaves the
model as it was (no forward wrapped, another policy untouched); what can work simply works (module
instances, shared modules, low-precision weights, policies that overlap), and a policy never claims a
module it no longer runs.

The generated part crosses each bad selector with its position among good ones and with a policy
already on the model."""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch
from torch import nn

import amp_backends
from amp_backends import precision_policy

RAW = ("object is not iterable", "positional argument", "Boolean value of Tensor", "has no attribute",
       "Expected one of cpu")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
        yield


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8, elementwise_affine=False), nn.ReLU(), nn.LayerNorm(8),
                         nn.Linear(8, 2))


def _wrapped(model: nn.Module) -> dict[str, object]:
    return {name: m.__dict__["forward"] for name, m in model.named_modules() if "forward" in m.__dict__}


def _out_dtypes(model: nn.Module, x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.dtype]:
    seen: dict[str, torch.dtype] = {}
    handles = [m.register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, o.dtype))
               for n, m in model.named_modules() if n]
    try:
        with torch.autocast("cpu", dtype):
            model(x)
    finally:
        for h in handles:
            h.remove()
    return seen


def _raises_on_unaffine(name: str, module: nn.Module) -> bool:
    return module.weight.shape[0] > 0  # LayerNorm(elementwise_affine=False) has weight None


def _one_argument(module: nn.Module) -> bool:
    return True


def _returns_tensor(name: str, module: nn.Module) -> torch.Tensor:
    return torch.tensor(True)


def _returns_str(name: str, module: nn.Module) -> str:
    return "yes"


# (selector, the words the refusal must carry)
BAD_SELECTORS = {
    "none": (None, "got None"),
    "root": ("", "the whole model"),
    "unknown-pattern": ("no_such_layer", "selects no module"),
    "unused-type": (nn.GRU, "selects no module"),
    "number": (42, "takes module classes"),
    "class-not-module": (int, "takes module classes"),
    "raising-predicate": (_raises_on_unaffine, "predicate _raises_on_unaffine raised on module"),
    "one-argument-predicate": (_one_argument, "must take (name, module)"),
    "tensor-predicate": (_returns_tensor, "must return True or False, got Tensor"),
    "str-predicate": (_returns_str, "must return True or False, got str"),
    "foreign-instance": (nn.LayerNorm(8), "not a submodule"),
}


@pytest.mark.parametrize(("case", "position", "other_policy"),
                         list(itertools.product(BAD_SELECTORS, ["alone", "after-good", "before-good"], [False, True])))
def test_generated_bad_selectors_are_refused_and_change_nothing(case, position, other_policy):
    model = _model()
    other = precision_policy(model, fp32=[nn.Linear]) if other_policy else None
    before = _wrapped(model)
    x = torch.randn(3, 4)
    dtypes = _out_dtypes(model, x)
    bad, words = BAD_SELECTORS[case]
    selectors = {"alone": [bad], "after-good": [nn.LayerNorm, bad], "before-good": [bad, nn.LayerNorm]}[position]
    if case == "none" and position == "alone":
        selectors = None
    with pytest.raises((TypeError, ValueError)) as info:
        precision_policy(model, fp32=selectors)
    message = str(info.value)
    assert message.startswith("precision_policy(fp32=...)") and words in message, message
    ours = message.split(": AttributeError:")[0]  # the predicate's own error is quoted after ours
    assert not any(raw in ours for raw in RAW), message
    assert _wrapped(model) == before, "nothing wrapped or unwrapped"
    assert _out_dtypes(model, x) == dtypes, "the model runs as it did"
    if other is not None:
        other.remove()
        assert _wrapped(model) == {}


@pytest.mark.parametrize(("device_types", "error"), [
    ("bogus", ValueError), (["bogus"], ValueError), (["cpu", None], ValueError), (3, TypeError), ([""], ValueError),
])
def test_bad_device_types_are_refused_before_any_forward(device_types, error):
    model = _model()
    with pytest.raises(error, match=r"precision_policy\(device_types=\.\.\.\)") as info:
        precision_policy(model, fp32=[nn.LayerNorm], device_types=device_types)
    assert not any(raw in str(info.value) for raw in RAW)
    assert _wrapped(model) == {}


def test_one_device_type_as_a_string_is_that_device_type():
    model = _model()
    policy = precision_policy(model, fp32=[nn.LayerNorm], device_types="cpu")
    assert {h for w in _wrapped(model).values() for h in w.holders.values()} == {("cpu",)}
    assert _out_dtypes(model, torch.randn(3, 4))["3"] == torch.float32
    policy.remove()


def test_a_module_instance_selects_that_module():
    model = _model()
    policy = precision_policy(model, fp32=[model[3]])
    assert policy.selected == {"3": "the LayerNorm given"}
    dtypes = _out_dtypes(model, torch.randn(3, 4))
    assert dtypes["3"] == torch.float32 and dtypes["1"] == torch.bfloat16


def test_a_shared_module_is_selected_by_any_of_its_names():
    shared = nn.LayerNorm(8)
    model = nn.Sequential(nn.Linear(4, 8), shared, nn.ReLU(), shared)
    policy = precision_policy(model, fp32=["3"])
    assert list(policy.selected) == ["1"], "one module, reported under its first name"
    with torch.autocast("cpu", torch.bfloat16):
        assert model(torch.randn(2, 4)).dtype == torch.float32


def test_a_second_policy_keeps_its_modules_when_the_first_is_removed():
    model = _model()
    x = torch.randn(3, 4)
    with torch.autocast("cpu", torch.bfloat16):
        reference = model(x)
    first = precision_policy(model, fp32=[nn.LayerNorm])
    second = precision_policy(model, fp32=[nn.LayerNorm])
    assert "(removed)" not in repr(second) and list(second.selected) == ["1", "3"]
    first.remove()
    assert _out_dtypes(model, x)["3"] == torch.float32, "the second policy still runs it in float32"
    second.remove()
    assert _wrapped(model) == {}
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(model(x), reference), "both removed: the model runs bitwise as before"


def test_a_module_replaced_after_the_policy_is_no_longer_claimed():
    model = _model()
    policy = precision_policy(model, fp32=["0", "4"])
    assert _out_dtypes(model, torch.randn(3, 4))["4"] == torch.float32
    model[4] = nn.Linear(8, 2)
    assert list(policy.selected) == ["0"] and policy.replaced == ["4"]
    assert repr(policy) == "<PrecisionPolicy fp32: 0>"
    assert _out_dtypes(model, torch.randn(3, 4))["4"] == torch.bfloat16, "the new module is not the policy's"
    policy.remove()
    assert _wrapped(model) == {}


def test_an_empty_policy_is_not_called_removed():
    policy = precision_policy(_model(), fp32=[])
    assert repr(policy) == "<PrecisionPolicy fp32: none>"
    policy.remove()
    assert repr(policy).endswith("(removed)>")


def test_multihead_attentions_out_proj_cannot_be_selected_alone():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mha(x, x, x)[0]

    model = Attention()
    with pytest.raises(ValueError, match="select the MultiheadAttention itself"):
        precision_policy(model, fp32=["mha.out_proj"])
    assert _wrapped(model) == {}
    policy = precision_policy(model, fp32=["mha"])
    with torch.autocast("cpu", torch.bfloat16):
        assert model(torch.randn(3, 2, 8)).dtype == torch.float32
    policy.remove()


def test_torch_jit_script_is_told_to_remove_the_policy_first():
    model = _model()
    policy = precision_policy(model, fp32=[nn.LayerNorm])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates scripting
        with pytest.raises(Exception, match=r"call policy.remove\(\) before scripting"):
            torch.jit.script(model)
        policy.remove()
        scripted = torch.jit.script(model)
    assert torch.equal(scripted(torch.ones(2, 4)), model(torch.ones(2, 4)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_with_low_precision_weights_runs_its_selected_modules_in_float32(dtype):
    """A model loaded in bf16 (or fp16): the selected LayerNorm computes in float32 from float32 copies of
    its weights, equal to doing it by hand, and its gradients still reach the low-precision weights."""
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2)).to(dtype)
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.5, 0.5)
    precision_policy(model, fp32=[nn.LayerNorm])
    x = torch.randn(3, 4, dtype=dtype)
    seen = {}
    model[1].register_forward_hook(lambda m, i, o: seen.update(inp=i[0], out=o))
    with torch.autocast("cpu", torch.bfloat16):
        model(x).float().sum().backward()
    by_hand = nn.functional.layer_norm(seen["inp"].float(), (8,), model[1].weight.float(), model[1].bias.float())
    assert seen["out"].dtype == torch.float32 and torch.equal(seen["out"], by_hand)
    assert model[1].weight.grad is not None and model[1].weight.grad.dtype == dtype
    assert model[1].weight.dtype == dtype, "the weights stay as the model keeps them"


def test_a_backend_declaring_fp32_ops_as_a_string_means_that_one_op():
    cpu = type(amp_backends.get("cpu"))

    class OneString(cpu):
        name = "cpu-one-string"
        fp32_ops = "binary_cross_entropy"

    holder = nn.ModuleDict({"model": nn.Linear(4, 1), "loss": nn.BCELoss()})
    policy = precision_policy(holder, fp32=(), backend=OneString())
    assert policy.selected == {"loss": "backend 'cpu-one-string': binary_cross_entropy in float32"}


def test_the_recipe_without_example_inputs_says_how_it_guessed_the_head():
    class ClassifierFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.classifier = nn.Linear(8, 3)
            self.body = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.classifier(self.body(x))

    guessed = precision_policy(ClassifierFirst())
    assert "pass example_inputs" in guessed.head_found_by
    model = ClassifierFirst()  # kept: a policy holds its model weakly
    found = precision_policy(model, example_inputs=torch.randn(2, 4))
    assert "recipe: the final classifier / head" in found.selected.get("classifier", "")
    assert "body" not in found.selected


# -- the compiled-backward hold travels with the float32 wrappers (copies, collection, pickles) ------
def _setting() -> object:
    from torch._functorch import config

    return getattr(config, "backward_pass_autocast", None)


def _mlp3() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 8))


def _grads(model: nn.Module, x: torch.Tensor, compiled: bool) -> list[torch.Tensor]:
    run = torch.compile(model, backend="aot_eager") if compiled else model
    with torch.autocast("cpu", torch.bfloat16):
        out = run(x)
    out.float().square().sum().backward()
    return [p.grad for p in model.parameters()]


needs_setting = pytest.mark.skipif(_setting() is None, reason="this torch has no backward_pass_autocast setting")


@pytest.fixture
def fresh_setting():
    """No leftover hold from another test (an unremoved policy holds until its model is collected),
    and a fresh compile cache (copies of one model share its code objects)."""
    import gc

    gc.collect()
    torch._dynamo.reset()
    before = _setting()
    assert before == "same_as_forward", before
    yield before
    torch._dynamo.reset()


@needs_setting
def test_a_deep_copy_kept_after_remove_compiles_its_backward_as_eager(fresh_setting):
    """The copy's float32 modules keep their float32 backward under AOTAutograd after the original's
    policy is removed: its compiled gradients equal eager's bitwise (without the hold the head's and the
    norm's backward run in bf16: measured up to 0.06 apart)."""
    import gc

    model = _mlp3()
    policy = precision_policy(model)
    eager_copy, compiled_copy = copy.deepcopy(model), copy.deepcopy(model)
    policy.remove()
    gc.collect()
    assert _setting() == "off", "the copies' float32 wrappers still hold it"
    x = torch.randn(8, 16)
    for (name, _), a, b in zip(model.named_parameters(), _grads(eager_copy, x, False), _grads(compiled_copy, x, True)):
        assert torch.equal(a, b), name
    del eager_copy, compiled_copy
    torch._dynamo.reset()
    gc.collect()
    assert _setting() == fresh_setting, "torch's value is back once no float32 wrapper lives"


@needs_setting
def test_a_copy_keeps_the_hold_after_the_original_is_garbage_collected(fresh_setting):
    import gc

    model = _mlp3()
    precision_policy(model)  # never removed
    eager_copy, compiled_copy = copy.deepcopy(model), copy.deepcopy(model)
    del model
    gc.collect()
    assert _setting() == "off"
    x = torch.randn(8, 16)
    for a, b in zip(_grads(eager_copy, x, False), _grads(compiled_copy, x, True)):
        assert torch.equal(a, b)
    del eager_copy, compiled_copy
    torch._dynamo.reset()
    gc.collect()
    assert _setting() == fresh_setting


@needs_setting
def test_a_model_unpickled_in_a_fresh_process_compiles_its_backward_as_eager(tmp_path):
    """A whole-model pickle, loaded where no policy was ever made: its float32 modules hold the setting
    from the moment they are unpickled, and the compiled gradients equal eager's bitwise."""
    from conftest import run_json

    model = _mlp3()
    precision_policy(model)
    torch.save(model, tmp_path / "model.pt")
    out = run_json(f"""
    import copy, gc, json, warnings
    import torch
    from torch._functorch import config
    warnings.simplefilter("ignore")
    before = config.backward_pass_autocast
    model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
    held = config.backward_pass_autocast
    x = torch.randn(8, 16)
    grads = []
    for compiled in (False, True):
        twin = copy.deepcopy(model)
        run = torch.compile(twin, backend="aot_eager") if compiled else twin
        with torch.autocast("cpu", torch.bfloat16):
            out = run(x)
        out.float().square().sum().backward()
        grads.append([p.grad for p in twin.parameters()])
    equal = all(torch.equal(a, b) for a, b in zip(*grads))
    del model, twin, run
    torch._dynamo.reset()
    gc.collect()
    print(json.dumps({{"before": before, "held": held, "equal": equal, "after": config.backward_pass_autocast}}))
    """)
    assert out == {"before": "same_as_forward", "held": "off", "equal": True, "after": "same_as_forward"}


@needs_setting
@pytest.mark.parametrize("users", ["off", "same_as_forward", [{"device_type": "cpu", "dtype": torch.bfloat16}]],
                         ids=["off", "same_as_forward", "list"])
def test_remove_keeps_a_compile_setting_the_user_set_while_the_policy_held_it(fresh_setting, users):
    from torch._functorch import config

    try:
        policy = precision_policy(_model())
        assert _setting() == "off"
        config.backward_pass_autocast = users  # the user's own choice, made while the policy holds it
        policy.remove()
        assert _setting() == users, "the user's value stays, even one equal to what the policy had set"
        config.backward_pass_autocast = fresh_setting
        untouched = precision_policy(_model())
        untouched.remove()
        assert _setting() == fresh_setting, "a setting nobody changed comes back"
    finally:
        config.backward_pass_autocast = fresh_setting


@needs_setting
def test_torchs_setting_comes_back_at_remove_after_a_compiled_step(fresh_setting):
    """Read before and after: the policy's hold during a compiled training step, torch's value after
    remove(), and the model trains on (eager) as it would without the policy."""
    model = _mlp3()
    policy = precision_policy(model)
    x = torch.randn(8, 16)
    _grads(model, x, True)
    assert _setting() == "off"
    policy.remove()
    assert _setting() == fresh_setting
    _grads(model, x, False)
    assert _setting() == fresh_setting


@needs_setting
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp32+fp8"])
def test_torchs_setting_comes_back_when_the_policed_model_is_collected_while_the_policy_lives(fresh_setting, fp8):
    """The policy object kept (as a variable usually is), the model dropped: the policy holds the model
    weakly, so the model is freed, and with its last float32 module torch's value comes back."""
    import gc
    import weakref

    if fp8:
        pytest.importorskip("torchao")
    model = _mlp3()
    kwargs = {"fp8": ["0"], "emulate": True, "backend": "cpu"} if fp8 else {}
    policy = precision_policy(model, **kwargs)
    assert policy.selected and _setting() == "off" and (not fp8 or list(policy.fp8) == ["0"])
    _grads(model, torch.randn(8, 16), True)
    gone = weakref.ref(model)
    del model
    torch._dynamo.reset()
    gc.collect()
    assert gone() is None, "the policy does not keep the model alive"
    assert _setting() == fresh_setting, "torch's value is back with the last policed module"
    assert policy.model is None and policy.selected == {} and policy.fp8 == {}
    policy.remove()  # nothing left to undo: harmless
    assert _setting() == fresh_setting
