"""The float32 masters under hostile use, against torch's optimizer on float32 copies doing the same by
hand: writes that change some elements or none, optimizer state made before the masters, optimizers
that keep their own parameter lists, casts, hooks of the step, float64 layers, what the model keeps
alive, state-dict hooks, the wrapped optimizer's own methods, and ``remove()``."""

from __future__ import annotations

import copy
import gc
import io
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_backends
from amp_backends.memory.lean import LeanError, memory_lean
from amp_backends.memory.master import MasterWeights, MasterWeightsError

X, Y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
        yield


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _backward(model: nn.Module, x: torch.Tensor = X) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(model(x).float(), Y).backward()


def _copies(lean, model: nn.Module) -> list[torch.Tensor]:
    return [lean.masters[p].detach().clone().requires_grad_(True) for p in model.parameters()]


def _feed(model: nn.Module, ref: list[torch.Tensor]) -> None:
    for p, r in zip(model.parameters(), ref):
        r.grad = p.grad.float()


def _lean(model: nn.Module, make=lambda ps: torch.optim.AdamW(ps, lr=1e-2)):  # type: ignore[no-untyped-def]
    """``model`` with bfloat16 weights and float32 masters, under the optimizer ``make`` builds."""
    return memory_lean(model, make(model.parameters()), backend="cpu", weights=torch.bfloat16)


def _train(model: nn.Module, lean, steps: int, ref=None, ref_opt=None, x: torch.Tensor = X) -> None:  # type: ignore[no-untyped-def]
    """``steps`` lean steps; with ``ref``, torch's ``ref_opt`` steps the float32 copies beside, fed the same
    gradients upcast."""
    for _ in range(steps):
        lean.optimizer.zero_grad()
        _backward(model, x)
        if ref is not None:
            _feed(model, ref)
        lean.optimizer.step()
        if ref_opt is not None:
            ref_opt.step()


class _Renormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, max_norm=1e6)  # renormalises its rows in place at each forward: a no-op
        self.head = nn.Linear(16, 50)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(t))


@pytest.mark.parametrize("write", ["renorm", "clamp"])
def test_a_write_that_changes_no_value_keeps_the_masters_as_torch_keeps_float32_weights(write):
    """``nn.Embedding(max_norm=...)``'s renorm (every forward) and a clamp that clips nothing (every step)
    bump the version counters and change no value: the masters are torch's AdamW on float32 copies given
    the same op, bitwise, after 40 steps (they were reset to their rounding at every write, the updates
    below bfloat16's resolution lost)."""
    torch.manual_seed(0)
    model = _Renormed() if write == "renorm" else _Renormed().head
    t = torch.randint(0, 50, (32,), generator=torch.Generator().manual_seed(1))
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(2))
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-4)  # noqa: E731
    lean = memory_lean(model, make(model.parameters()), backend="cpu", weights=torch.bfloat16)
    ref = _copies(lean, model)
    ref_opt = make(ref)
    for _ in range(40):
        lean.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(model(t if write == "renorm" else x).float(), t).backward()
        _feed(model, ref)
        with torch.no_grad():
            if write == "renorm":
                torch.embedding_renorm_(ref[0], t, 1e6, 2.0)
            else:
                model.weight.clamp_(-10, 10)
                ref[0].clamp_(-10, 10)
        lean.optimizer.step()
        ref_opt.step()
    for p, r in zip(model.parameters(), ref):
        assert torch.equal(lean.masters[p], r.detach())


def test_a_clamp_gives_its_clipped_elements_the_new_value_and_keeps_the_others_masters():
    model = _mlp()
    lean = _lean(model)
    _train(model, lean, 3)
    weight = model[0].weight
    before, held = lean.masters[weight].clone(), weight.detach().clone()
    bound = float(before.abs().quantile(0.5))
    with torch.no_grad():
        weight.clamp_(-bound, bound)
    after = lean.masters[weight]
    clipped = weight.detach() != held
    assert 0 < int(clipped.sum()) < clipped.numel()
    assert torch.equal(after[~clipped], before[~clipped]), "the elements the clamp left keep their float32 bits"
    assert torch.equal(after[clipped], weight.detach()[clipped].float()), "the clipped ones take the bound"


def test_optimizer_state_made_in_low_precision_before_the_masters_is_widened():
    """Adagrad built over a model already in bfloat16 (its sums made in __init__) trains as torch's Adagrad
    on float32 copies, bitwise; an Adam that stepped on the bfloat16 model steps after memory_lean, its
    moments float32 (it raised a dtype error)."""
    model = _mlp().to(torch.bfloat16)
    make = lambda ps: torch.optim.Adagrad(ps, lr=1e-2)  # noqa: E731
    lean = _lean(model, make)
    ref = _copies(lean, model)
    ref_opt = make(ref)
    _train(model, lean, 20, ref, ref_opt, x=X.bfloat16())
    assert lean.optimizer.state[model[0].weight]["sum"].dtype == torch.float32
    assert all(torch.equal(lean.masters[p], r.detach()) for p, r in zip(model.parameters(), ref))

    model = _mlp().to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _backward(model, X.bfloat16())
    opt.step()
    opt.zero_grad()
    lean = memory_lean(model, opt, backend="cpu", weights=torch.bfloat16)
    _backward(model, X.bfloat16())
    lean.optimizer.step()
    state = lean.optimizer.state[model[0].weight]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


class _KeepsItsList(torch.optim.Optimizer):
    def __init__(self, params, lr: float) -> None:  # type: ignore[no-untyped-def]
        super().__init__(params, {"lr": lr})
        self.plist = [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        for p in self.plist:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.defaults["lr"])


@pytest.mark.parametrize("kind", ["own-list", "lbfgs"])
def test_an_optimizer_keeping_its_own_parameter_list_is_refused_with_nothing_changed(kind):
    """Its step would update the parameters in its list, not the masters swapped into its groups, and the
    masters would overwrite them (nothing trained): refused before any parameter is lowered."""
    model = _mlp()
    opt = _KeepsItsList(model.parameters(), 0.5) if kind == "own-list" else torch.optim.LBFGS(model.parameters())
    attribute = "plist" if kind == "own-list" else "_params"
    before = model(X)
    with pytest.raises(LeanError, match=attribute):
        memory_lean(model, opt, backend="cpu", weights=torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(model(X), before)
    with pytest.raises(MasterWeightsError, match=attribute):
        MasterWeights(opt)


def test_model_half_after_bfloat16_weights_keeps_the_masters_and_the_step_rounds_them_to_float16():
    model = _mlp()
    lean = _lean(model)
    _train(model, lean, 2)
    before = {n: lean.masters[p].clone() for n, p in model.named_parameters()}
    model.half()
    assert all(torch.equal(lean.masters[p], before[n]) for n, p in model.named_parameters())
    lean.optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        F.cross_entropy(model(X).float(), Y).backward()
    lean.optimizer.step()
    assert all(p.dtype == torch.float16 and torch.equal(p, lean.masters[p].half()) for p in model.parameters())


def test_state_dict_inside_a_step_hook_keeps_the_masters_and_is_the_steps_state():
    """A checkpoint taken in a step post-hook: the step and the later ones train (the masters were dropped,
    every later step raised KeyError), and what the hook took is the state_dict after the step."""
    model = _mlp()
    lean = memory_lean(model, torch.optim.AdamW(model.parameters(), lr=1e-2), backend="cpu", weights=torch.bfloat16)
    taken = []
    lean.optimizer.register_step_post_hook(lambda opt, args, kwargs: taken.append(copy.deepcopy(lean.optimizer.state_dict())))
    w0 = model[0].weight.detach().clone()
    for _ in range(3):
        lean.optimizer.zero_grad()
        _backward(model)
        lean.optimizer.step()
        after = lean.optimizer.state_dict()
        assert len(lean.masters) == 4 and all(p in lean.optimizer.state for p in model.parameters())
        for key, state in after["state"].items():
            for name, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(taken[-1]["state"][key][name]))
    assert not torch.equal(w0, model[0].weight)


def test_float64_layers_are_kept_and_an_error_inside_the_step_leaves_the_groups_the_parameters():
    model = _mlp()
    model[2].double()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lean = memory_lean(model, opt, backend="cpu", weights=torch.bfloat16)
    assert [p.dtype for p in model.parameters()] == [torch.bfloat16] * 2 + [torch.float64] * 2
    assert set(lean.kept) == {"2.weight", "2.bias"}
    assert all(m.dtype == torch.float32 for m in lean.masters.values()) and len(lean.masters) == 2
    w = model[2].weight.detach().clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(model[2](model[1](model[0](X)).double()).float(), Y).backward()
    lean.optimizer.step()
    assert not torch.equal(w, model[2].weight)

    def broken(grad_scale):  # type: ignore[no-untyped-def]
        raise RuntimeError("a gradient that cannot be taken")

    lean.optimizer._master_grads = broken
    with pytest.raises(RuntimeError, match="cannot be taken"):
        lean.optimizer.step()
    held = [p for g in opt.param_groups for p in g["params"]]
    assert all(a is b for a, b in zip(held, model.parameters()))
    assert all(p in opt.state for p in model.parameters()) and not any(m in opt.state for m in lean.masters.values())


def test_the_model_keeps_no_optimizer_alive_and_its_copies_carry_none():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lean = memory_lean(model, opt, backend="cpu", weights=torch.bfloat16)
    _backward(model)
    lean.optimizer.step()
    gc.collect()
    wrappers = sum(type(o) is MasterWeights for o in gc.get_objects())
    copied = copy.deepcopy(model)
    assert sum(type(o) is MasterWeights for o in gc.get_objects()) == wrappers, "deepcopy(model) copied no optimizer"
    masters = {n: m.clone() for n, m in zip(dict(model.named_parameters()), lean.masters.values())}
    copied.load_state_dict({k: torch.zeros_like(v, dtype=torch.float32) for k, v in copied.state_dict().items()})
    lean.optimizer.sync()
    assert all(torch.equal(a, b) for a, b in zip(masters.values(), lean.masters.values())), "the copy's load reached none"
    whole, weights = io.BytesIO(), io.BytesIO()
    torch.save(model, whole)
    torch.save(model.state_dict(), weights)
    assert whole.tell() < 2 * weights.tell() + 20_000
    inner = weakref.ref(opt)
    del lean, opt
    gc.collect()
    assert inner() is None, "the model alone keeps no optimizer (its masters and moments) alive"


def test_state_dict_hooks_registered_on_the_wrapper_run():
    model = _mlp()
    lean = memory_lean(model, torch.optim.AdamW(model.parameters()), backend="cpu", weights=torch.bfloat16)
    calls = []
    opt = lean.optimizer
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load-pre"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "load-pre", "load-post"]


def test_remove_gives_each_parameter_storage_of_its_own():
    model = _mlp()
    lean = memory_lean(model, torch.optim.AdamW(model.parameters()), backend="cpu", weights=torch.bfloat16)
    lean.remove()
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 4
    buffer = io.BytesIO()
    torch.save(model[2].bias, buffer)
    assert buffer.tell() < 10_000, "one bias saved, not the whole buffer of the masters"


class _SwapsWeights(torch.optim.SGD):
    """A schedule-free optimizer's shape: ``eval()`` and ``train()`` swap each parameter with a float32
    buffer in its state, which its step keeps."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                z = self.state[p].setdefault("z", p.detach().clone())
                z.lerp_(p, 0.5)

    @torch.no_grad()
    def eval(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                z = self.state[p]["z"]
                held = p.detach().clone()
                p.copy_(z)
                z.copy_(held)

    train = eval


def test_the_wrapped_optimizers_public_methods_run_on_the_masters():
    """``lean.optimizer.eval()`` and ``.train()`` (a schedule-free optimizer's, which Transformers' Trainer
    calls where the optimizer has them) act on the float32 masters as the same optimizer on float32
    copies, bitwise; a plain attribute reads through; a private one does not."""
    model = _mlp()
    make = lambda ps: _SwapsWeights(ps, lr=0.1)  # noqa: E731
    lean = _lean(model, make)
    ref = _copies(lean, model)
    ref_opt = make(ref)
    _train(model, lean, 3, ref, ref_opt)
    lean.optimizer.eval()
    ref_opt.eval()
    assert all(torch.equal(lean.masters[p], r.detach()) for p, r in zip(model.parameters(), ref))
    assert all(torch.equal(p, r.detach().bfloat16()) for p, r in zip(model.parameters(), ref))
    lean.optimizer.train()
    ref_opt.train()
    assert all(torch.equal(lean.masters[p], r.detach()) for p, r in zip(model.parameters(), ref))
    lean.optimizer.optimizer.some_setting = 3
    assert lean.optimizer.some_setting == 3
    with pytest.raises(AttributeError):
        lean.optimizer._not_there  # noqa: B018


class _Wraps(torch.optim.Optimizer):
    """SAM's and Lookahead's shape: another optimizer over the same groups, which it steps."""

    def __init__(self, params) -> None:  # type: ignore[no-untyped-def]
        self.base_optimizer = torch.optim.AdamW(params, lr=1e-2)
        super().__init__(self.base_optimizer.param_groups, {})

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        return self.base_optimizer.step()


def test_an_optimizer_over_another_is_refused_and_a_step_hook_may_call_the_optimizers_methods():
    """An optimizer holding another (its state keyed by what the masters replace, never re-keyed) is
    refused, naming the attribute. A method of the wrapped optimizer called from a step pre-hook runs
    inside the step (it ended the step's swap: the masters got no gradient and never moved); a public
    attribute set through the wrapper reaches the optimizer whose step reads it."""
    model = _mlp()
    with pytest.raises(LeanError, match="base_optimizer"):
        memory_lean(model, _Wraps(model.parameters()), backend="cpu", weights=torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in model.parameters())

    class _WithGetter(torch.optim.AdamW):
        def current_lr(self) -> float:
            return self.param_groups[0]["lr"]

    model = _mlp()
    make = lambda ps: _WithGetter(ps, lr=1e-2)  # noqa: E731
    lean = _lean(model, make)
    ref = _copies(lean, model)
    ref_opt = make(ref)
    seen = []
    lean.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(lean.optimizer.current_lr()))
    _train(model, lean, 3, ref, ref_opt)
    assert seen == [1e-2] * 3
    assert all(torch.equal(lean.masters[p], r.detach()) for p, r in zip(model.parameters(), ref))
    lean.optimizer.optimizer.warmup = 10
    lean.optimizer.warmup = 0
    assert lean.optimizer.optimizer.warmup == 0 and "warmup" not in vars(lean.optimizer)


# -- the model's own state_dict: what every checkpoint of it holds -------------------------------------
class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(20, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 20, bias=False)
        self.head.weight = self.emb.weight  # tied, as language models tie them

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.emb(t))))


def _tied_steps(model: nn.Module, lean, steps: int) -> None:  # type: ignore[no-untyped-def]
    t = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        lean.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(model(t).float().flatten(0, 1), t.flatten()).backward()
        lean.optimizer.step()


def test_a_round_trip_through_the_models_state_dict_keeps_the_masters_and_lean_state_dict_gives_them() -> None:
    """``model.state_dict()`` gives the parameters, as torch's does (a write through it reaches them), and
    warns once that a checkpoint of it holds their rounding; ``model.load_state_dict`` of it leaves every
    master bitwise (it made them their rounding: 16,383 of 16,384 elements of a GPT-2 weight moved), and
    a later step is bitwise that of a model never round-tripped. ``lean.state_dict()`` gives the masters:
    float32 copies (saving one bias writes its bytes, not the masters' buffer), tied weights one tensor."""
    model, twin = _Tied(), _Tied()
    lean, twin_lean = _lean(model), _lean(twin)
    _tied_steps(model, lean, 3)
    _tied_steps(twin, twin_lean, 3)
    masters = {name: lean.masters[p].clone() for name, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = model.state_dict()
        model.state_dict()
    assert [str(w.message)[:40] for w in caught] == ["lean memory: model.state_dict() gives th"]
    assert state["body.weight"].dtype == torch.bfloat16
    model.load_state_dict(copy.deepcopy(state))
    for name, p in model.named_parameters():
        assert torch.equal(lean.masters[p], masters[name]), name
    _tied_steps(model, lean, 1)
    _tied_steps(twin, twin_lean, 1)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(lean.masters[p], twin_lean.masters[q]), name
    exact = lean.state_dict()
    assert {k: v.dtype for k, v in exact.items()} == dict.fromkeys(exact, torch.float32)
    for name, p in model.named_parameters():
        assert torch.equal(exact[name], lean.masters[p]), name
    assert exact["head.weight"] is exact["emb.weight"]
    buffer = io.BytesIO()
    torch.save(exact["body.bias"], buffer)
    assert len(buffer.getvalue()) < 2_000, len(buffer.getvalue())
    with torch.no_grad():  # a write through the model's state_dict reaches the parameter (and then its master)
        state = model.state_dict()
        state["body.bias"].fill_(0.5)
    assert torch.equal(lean.masters[model.body.bias], torch.full((16,), 0.5))


def test_a_low_precision_state_dict_loaded_is_a_write_not_exact_values() -> None:
    """A state_dict of bfloat16 values (a bf16 copy of the model's): no more exact than the parameters,
    so an element it leaves as the parameter holds keeps its master's float32 value (they were all
    replaced by their rounding), and one it changes takes the new value."""
    model = _mlp()
    lean = _lean(model)
    _train(model, lean, 2)
    before = {name: lean.masters[p].clone() for name, p in model.named_parameters()}
    low = {k: v.bfloat16() for k, v in model.state_dict().items()}
    low["0.bias"][0] = 5.0
    model.load_state_dict(low)
    for name, p in model.named_parameters():
        expected = before[name].clone()
        if name == "0.bias":
            expected[0] = 5.0
        assert torch.equal(lean.masters[p], expected), name


def test_save_pretrained_of_the_lean_state_dict_resumes_the_masters_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Transformers' own checkpoint of a lean GPT-2, ``save_pretrained(path, state_dict=lean.state_dict())``:
    loaded back in float32, every weight is its master bitwise (the tied embedding one tensor: safetensors
    refuses shared buffers)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    lean = _lean(model)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        lean.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x, labels=x).loss.backward()
        lean.optimizer.step()
    model.save_pretrained(tmp_path, state_dict=lean.state_dict())
    dtype = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"  # (4.x: its name)
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, **{dtype: torch.float32})
    names = dict(back.named_parameters())
    masters = lean.masters
    assert masters
    for name, p in model.named_parameters():
        assert torch.equal(names[name], masters.get(p, p)), name  # (the norms are kept float32: no master)


def test_a_lean_model_run_outside_autocast_warns_once_naming_the_way() -> None:
    """Llama's float32 RMSNorm (kept float32) feeding a bfloat16 linear raises a dtype error outside
    autocast; the model warns once, naming the backend's autocast, under which evaluation and ``generate``
    run; under autocast no warning; ``remove()`` takes the hook off."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    lean = _lean(model)
    assert any("RMSNorm" in why for why in lean.kept.values())
    x = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(4))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            generated = model.generate(x, max_new_tokens=3, do_sample=False)
        assert not caught
        for _ in range(2):
            with pytest.raises(RuntimeError, match="dtype"):
                model(x)
    assert generated.shape == (2, 9)
    assert [str(w.message)[:57] for w in caught] == ["lean memory: the model ran outside autocast with bfloat16"]
    assert "be.autocast()" in str(caught[0].message)
    lean.remove()
    assert not model._forward_pre_hooks
