"""Per-layer precision against a hostile review: overlapping selectors, a submodule the model itself names
``module``, nn.MultiheadAttention's out_proj (whose forward MHA never calls) as the last Linear, a float32
block holding fp8 candidates, models loaded in bfloat16 (a float32 block, BatchNorm's running statistics,
check_model's float32 reference), a selected module called without tensors, a plan whose head is not the
last Linear registered, the user's attributes on a Linear converted to fp8, and the model itself as a
selector.

References are plain torch: the module run by hand in float32 (autocast off, float32 copies of its
weights), the same model without the policy, and direct counts (forward hooks, named_modules)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import amp_backends
from amp_backends import RECIPE, PrecisionPlan, check_model, plan_precision, precision_policy
from amp_backends.precision.fp8 import engine as fp8_engine
from amp_backends.precision.policy import fp32_modules

from fp8_marks import needs_torchao


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


# -- helpers --------------------------------------------------------------------------------------
def _fp32_copy(module: nn.Module) -> nn.Module:
    """A float32 copy of ``module`` (taken before any policy touches it)."""
    return copy.deepcopy(module).float()


def _by_hand_fp32(ref: nn.Module, *args: Any) -> Any:
    """``ref`` (a float32 copy) run with autocast off on float32 copies of ``args``."""
    with torch.autocast("cpu", enabled=False):
        return ref(*(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))


def _outputs(model: nn.Module, run: Callable[[], Any]) -> dict[str, torch.Tensor]:
    """Each named submodule's (first tensor) output during ``run()``, by forward hooks."""
    seen: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[..., None]:
        return lambda mod, args, out: seen.__setitem__(name, out[0] if isinstance(out, tuple) else out)

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def _linears_run(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The nn.Linear layers whose forward the model calls, in the order it calls them (a direct count)."""
    order: list[str] = []
    handles = [m.register_forward_hook(lambda mod, a, o, n=n: order.append(n))
               for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return order


def _wrapped(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


class Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc(x)))


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(self.b(self.a(x))))


# -- 1. overlapping selectors ---------------------------------------------------------------------
@pytest.mark.parametrize("case", ["class+name", "linear+head", "recipe+class", pytest.param("fp8", marks=needs_torchao)])
def test_overlapping_selectors_select_the_union(case: str) -> None:
    """Selectors that pick the same module are all accepted (none "selects no module"); the policy runs
    the union of what each picks, as named_modules() counts it."""
    torch.manual_seed(0)
    model: nn.Module = Chain() if case == "fp8" else Three()
    if case == "fp8":
        policy = precision_policy(model, fp32=(), fp8=[nn.Linear, "b"], emulate=True)
        assert set(policy.fp8) == {n for n, m in model.named_modules() if n}
        assert all(fp8_engine.is_fp8(m) for m in model.children())
        policy.remove()
        return
    selectors = {"class+name": [nn.LayerNorm, "norm"], "linear+head": [nn.Linear, "head"],
                 "recipe+class": [RECIPE, nn.LayerNorm]}[case]
    types = tuple(s for s in selectors if isinstance(s, type))
    last_linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
    names = {s for s in selectors if isinstance(s, str) and s != RECIPE} | ({last_linear} if RECIPE in selectors else set())
    types += (nn.LayerNorm,) if RECIPE in selectors else ()
    expected = {n for n, m in model.named_modules() if n and (isinstance(m, types) or n in names)}
    unpoliced = copy.deepcopy(model)
    policy = precision_policy(model, fp32=selectors)
    assert set(policy.selected) == expected
    x = torch.randn(3, 8).bfloat16()
    for name, module in model.named_children():  # each module alone: float32 by hand, or as without the policy
        with torch.autocast("cpu", torch.bfloat16):
            y, y_plain = module(x), unpoliced.get_submodule(name)(x)
        assert torch.equal(y, _by_hand_fp32(_fp32_copy(unpoliced.get_submodule(name)), x) if name in expected
                           else y_plain), name
    policy.remove()


# -- 2. a submodule named "module" ----------------------------------------------------------------
class Named(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module, self.fc, self.head = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(self.module(x)))


class Wrapper(nn.Module):
    """A wrapper of the user's (an EMA copy, ``AveragedModel``): its only child is named ``module``, no
    parameters of its own."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_a_submodule_the_model_names_module_is_selected_and_a_real_wrapper_is_stripped() -> None:
    """The model's own ``module`` (a LayerNorm) is picked by the recipe and by the pattern "module", and
    runs in float32 as the LayerNorm by hand; behind DataParallel and torch.compile the patterns match
    without the wrapper's prefix, as behind a user's wrapper and AveragedModel holding it as ``module``."""
    torch.manual_seed(0)
    model = Named()
    ref = _fp32_copy(model.module)
    policy = precision_policy(model)
    assert set(policy.selected) == {"module", "head"}
    x = torch.randn(4, 16).bfloat16()
    with torch.autocast("cpu", torch.bfloat16):
        y = model.module(x)
    assert y.dtype == torch.float32 and torch.equal(y, _by_hand_fp32(ref, x))
    policy.remove()
    policy = precision_policy(model, fp32=["module"])
    assert set(policy.selected) == {"module"}
    policy.remove()
    compiled = torch.compile(model)
    for wrapper, prefix in ((nn.DataParallel(model), "module."), (compiled, "_orig_mod."),
                            (nn.DataParallel(compiled), "module._orig_mod.")):
        for pattern in ("fc", "module"):
            policy = precision_policy(wrapper, fp32=[pattern])
            assert set(policy.selected) == {prefix + pattern}
            policy.remove()
        policy = precision_policy(wrapper)
        assert set(policy.selected) == {prefix + "module", prefix + "head"}
        policy.remove()
    for holder in (Wrapper(model), torch.optim.swa_utils.AveragedModel(model)):
        policy = precision_policy(holder, fp32=["fc"])
        assert set(policy.selected) == {"module.fc"}
        policy.remove()
    assert _wrapped(model) == []


# -- 3. the default head beside an MHA's out_proj -------------------------------------------------
class AttnPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.norm = nn.Linear(16, 16), nn.LayerNorm(16)
        self.pool = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.proj(x))
        return self.pool(h[:, :1], h, h)[0]


def test_default_policy_takes_the_last_linear_outside_an_mha_as_head() -> None:
    """precision_policy(model) on a model whose last registered Linear is an MHA's out_proj is accepted:
    the head is the last Linear registered outside the MultiheadAttention, and it runs in float32."""
    torch.manual_seed(0)
    model = AttnPool()
    mha = [n for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)]
    linears = [n for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not any(n.startswith(h + ".") for h in mha)]
    policy = precision_policy(model)
    assert policy.selected == {linears[-1]: "recipe: the final classifier / head", "norm": "recipe: LayerNorm"}
    with torch.autocast("cpu", torch.bfloat16):
        outs = _outputs(model, lambda: model(torch.randn(2, 5, 16)))
    assert outs["proj"].dtype == torch.float32
    policy.remove()


# -- 4. a float32 block holding Linears fp8 selects -----------------------------------------------
class Blocked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


@needs_torchao
def test_float32_block_keeps_its_linears_out_of_fp8_and_the_reverse_order_is_refused() -> None:
    """fp32=["block"] with fp8=[nn.Linear]: the block's Linears stay Linears with the float32 reason, the
    block's output is the block by hand in float32 (bitwise); fp8 first, then fp32 on the block: refused,
    nothing changed."""
    torch.manual_seed(0)
    model, x = Blocked(), torch.randn(8, 32)
    ref = _fp32_copy(model.block)
    policy = precision_policy(model, fp32=["block"], fp8=[nn.Linear], emulate=True)
    assert set(policy.fp8) == {"head"}
    assert {n: "float32" in why for n, why in policy.fp8_skipped.items()} == {"block.0": True, "block.2": True}
    assert [type(m) for m in model.block] == [nn.Linear, nn.GELU, nn.Linear]
    with torch.autocast("cpu", torch.bfloat16):
        y = model.block(x)
    assert y.dtype == torch.float32 and torch.equal(y, _by_hand_fp32(ref, x))
    policy.remove()

    first = precision_policy(model, fp32=(), fp8=["block.0", "block.2"], emulate=True)
    with pytest.raises(ValueError, match="trains in fp8 by another policy"):
        precision_policy(model, fp32=["block"])
    assert _wrapped(model) == [] and fp32_modules(model) == []
    assert set(first.fp8) == {"block.0", "block.2"} and fp8_engine.is_fp8(model.block[0])
    first.remove()


# -- 5. a float32 block in a bfloat16 model -------------------------------------------------------
class Bf16Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.inp(x)))


def test_float32_block_of_a_bf16_model_runs_float32_copies_of_its_childrens_weights() -> None:
    """A bf16 model with fp32=["block"] runs; the block's output is the block by hand in float32 from
    float32 copies of its weights, and its weights' gradients are the by-hand ones rounded to bf16."""
    torch.manual_seed(0)
    model = Bf16Net().to(torch.bfloat16)
    ref = _fp32_copy(model.block)
    policy = precision_policy(model, fp32=["block"])
    with torch.autocast("cpu", torch.bfloat16):
        outs = _outputs(model, lambda: model(torch.randn(4, 16)))
    assert outs["block"].dtype == torch.float32
    h = torch.randn(4, 16).bfloat16()
    with torch.autocast("cpu", torch.bfloat16):
        y = model.block(h)
    with torch.autocast("cpu", enabled=False):
        y_ref = ref(h.float())
    assert torch.equal(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    for mine, theirs in zip(model.block.parameters(), ref.parameters()):
        assert mine.grad.dtype == torch.bfloat16 and torch.equal(mine.grad, theirs.grad.bfloat16())
    policy.remove()


# -- 6. BatchNorm's running statistics in a bfloat16 model ----------------------------------------
def test_bf16_batchnorm_under_the_default_policy_updates_its_running_statistics() -> None:
    """A bf16 model's BatchNorm (float32 by the recipe) updates running_mean/var and num_batches_tracked
    in training as a float32 BatchNorm by hand does on the same inputs, its statistics stored in bf16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).to(torch.bfloat16)
    stored = {k: v.clone() for k, v in model[1].named_buffers()}
    policy = precision_policy(model)
    assert "1" in policy.selected
    for _ in range(3):
        x = torch.randn(32, 8, dtype=torch.bfloat16) * 3 + 5
        with torch.autocast("cpu", torch.bfloat16):
            outs = _outputs(model, lambda x=x: model(x))
            bn_in = model[0](x)
        by_hand = nn.BatchNorm1d(16)
        by_hand.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in stored.items()}, strict=False)
        by_hand.weight.data, by_hand.bias.data = model[1].weight.detach().float(), model[1].bias.detach().float()
        with torch.autocast("cpu", enabled=False):
            y_ref = by_hand(bn_in.float())
        stored = {k: v.to(stored[k].dtype) for k, v in by_hand.named_buffers()}
        assert torch.equal(outs["1"], y_ref)
        for name, value in model[1].named_buffers():
            assert torch.equal(value, stored[name]), name
    assert model[1].num_batches_tracked.item() == 3 and model[1].running_mean.dtype == torch.bfloat16
    policy.remove()


# -- 7. fp8=RECIPE beside an MHA ------------------------------------------------------------------
D = 1040  # out_proj above torchao's tensorwise break-even (N > 1024, a multiple of 16): only the MHA rule keeps it out


class WithMHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(self.mid(self.attn(h, h, h, need_weights=False)[0]))


@needs_torchao
@pytest.mark.parametrize("example", [True, False], ids=["example_inputs", "registration_order"])
def test_fp8_recipe_never_converts_an_mha_out_proj_nor_labels_it_last(example: bool) -> None:
    """fp8=RECIPE: out_proj stays a Linear with the MultiheadAttention reason (with and without
    example_inputs); the first and last labels go to the first and last Linear the model runs (hooks)."""
    torch.manual_seed(0)
    model, x = WithMHA(), torch.randn(2, 3, 16)
    ran = _linears_run(model, x)
    assert "attn.out_proj" not in ran
    policy = precision_policy(model, fp32=(), fp8=RECIPE, emulate=True, example_inputs=x if example else None)
    skipped = policy.fp8_skipped
    assert "MultiheadAttention" in skipped["attn.out_proj"] and "last" not in skipped["attn.out_proj"]
    assert type(model.attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert "first Linear" in skipped[ran[0]] and "last Linear" in skipped[ran[-1]]
    assert set(policy.fp8) == set(ran[1:-1]) == {"mid"}
    policy.remove()


# -- 8. check_model on a bfloat16 model -----------------------------------------------------------
def test_check_model_on_a_bf16_model_measures_against_a_true_float32_run() -> None:
    """check_model on a bf16 model: the last layer's output error is the error against the model's
    float32 copy run in float32, and the report notes the float32 copies."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    model = model.to(torch.bfloat16)
    x = torch.randn(16, 64).bfloat16()
    report = check_model(model, x, backend="cpu", dtype=torch.bfloat16, memory=False)
    with torch.no_grad():
        y_fp32 = copy.deepcopy(model).float()(x.float())
        with torch.autocast("cpu", torch.bfloat16):
            y_low = model(x)
    true_error = _rel(y_low.float(), y_fp32)
    assert true_error > 1e-3
    assert report.rows[-1].name == "4"
    assert report.rows[-1].output_error == pytest.approx(true_error, rel=1e-4)
    assert any("float32 copies" in note for note in report.notes)


# -- 9. a selected module called without tensors --------------------------------------------------
class Rotary(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq_len, dtype=torch.float32)
        freqs = torch.matmul(t[:, None], self.inv_freq[None, :])  # autocast lowers matmul
        return freqs.cos(), freqs.sin()


class WithRotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary, self.head = Rotary(), nn.Linear(32, 4)


def test_a_selected_module_called_with_a_length_runs_in_float32() -> None:
    """A selected rotary embedding called with an int (no tensor input) runs with autocast off: float32
    outputs equal to the plain float32 computation."""
    model = WithRotary()
    ref = _fp32_copy(model.rotary)
    policy = precision_policy(model, fp32=["rotary"])
    with torch.autocast("cpu", torch.bfloat16):
        cos, sin = model.rotary(512)
    ref_cos, ref_sin = _by_hand_fp32(ref, 512)
    assert cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    policy.remove()


# -- 10. a plan whose head is not the last Linear registered --------------------------------------
class OutOfOrder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head, self.mid = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.relu(self.inp(x)))))


@needs_torchao
def test_plan_keeps_the_head_it_ran_through_save_load_and_the_policy(tmp_path: Any) -> None:
    """Registration order inp, head, mid; run order inp -> mid -> head: plan_precision (verify on) works,
    its head is the last Linear the model runs, the head survives JSON, and the policy applying the plan
    keeps "head" in float32 and converts "mid"."""
    torch.manual_seed(0)
    model, x = OutOfOrder(), torch.randn(64, 64)
    plan = plan_precision(model, x, budget=0.5, emulate=True, backend="cpu")
    assert plan.head == _linears_run(model, x)[-1] == "head"
    assert plan.layers["mid"].format.startswith(("fp8", "mxfp8"))
    plan.save(tmp_path / "plan.json")
    loaded = PrecisionPlan.load(tmp_path / "plan.json")
    assert loaded.head == "head" and loaded.to_dict() == plan.to_dict()
    policy = precision_policy(model, plan=loaded, emulate=True)
    assert "head" in policy.selected and set(policy.fp8) == {"mid"}
    assert fp8_engine.is_fp8(model.mid) and not fp8_engine.is_fp8(model.head)
    with torch.autocast("cpu", torch.bfloat16):
        outs = _outputs(model, lambda: model(x))
    assert outs["head"].dtype == torch.float32
    policy.remove()


# -- 11. the user's attributes on a Linear converted to fp8 ---------------------------------------
class Scaled(nn.Module):
    def __init__(self, scale: object) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.b.residual_scale = scale  # read by the parent's forward (GPT-style init code)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.a(x) + self.b(x) * self.b.residual_scale)


@needs_torchao
def test_fp8_conversion_carries_the_users_attribute_and_gives_it_back() -> None:
    """An attribute set on a Linear is the same object on its fp8 layer (the parent's forward reads it;
    the output is the unconverted model's within fp8's error) and back on the Linear after remove()."""
    torch.manual_seed(0)
    scale = torch.tensor(0.5)
    model, x = Scaled(scale), torch.randn(16, 32)
    ref = copy.deepcopy(model)
    ref.b.residual_scale = scale
    with torch.autocast("cpu", torch.bfloat16):
        y_ref = ref(x)
    policy = precision_policy(model, fp32=(), fp8=["b"], emulate=True)
    assert fp8_engine.is_fp8(model.b) and model.b.residual_scale is scale
    with torch.autocast("cpu", torch.bfloat16):
        y = model(x)
    assert 0 < _rel(y.float(), y_ref.float()) < 0.1
    policy.remove()
    assert type(model.b) is nn.Linear and model.b.residual_scale is scale
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(model(x), y_ref)


# -- 12. the model itself as a selector -----------------------------------------------------------
def test_the_model_itself_is_refused_and_nothing_changes() -> None:
    """fp32=[model] (or the model behind a wrapper) is refused saying the model itself is never
    selected; no forward is wrapped."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    wrapper = nn.DataParallel(model)
    for root, selector in ((model, model), (wrapper, wrapper), (wrapper, model)):
        with pytest.raises(ValueError, match="the model itself is never selected") as error:
            precision_policy(root, fp32=[selector])
        assert "nothing changed" in str(error.value)
        assert _wrapped(root) == [] and fp32_modules(root) == []
