"""The lean mode's float32 masters against plain torch doing the same by hand: whatever writes the
model's parameters (load_state_dict, in-place edits, another optimizer, DDP's broadcast, casts) reaches
the masters; the optimizer's state, hooks and closures are the user's optimizer's own; the step is a
constant number of multi-tensor ops."""

from __future__ import annotations

import copy
import io
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import amp_backends
from amp_backends.memory.lean import LeanError, memory_lean
from amp_backends.memory.master import MasterWeights

from fp8_marks import needs_torchao
from torchrun import torchrun

HERE = Path(__file__).resolve().parents[1]  # tests/: the workers


def _mlp(width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.LayerNorm(width), nn.Linear(width, 4))


X, Y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])


def _backward(model: nn.Module) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(model(X).float(), Y).backward()


class _Reference:
    """Plain torch by hand: float32 copies of the parameters, the same optimizer class, fed the lean
    model's gradients upcast; a write to the model is made to the copy as its float32 value."""

    def __init__(self, model: nn.Module, make_opt, lean) -> None:
        masters = lean.masters
        self.params = [masters.get(p, p).detach().clone().float().requires_grad_(True) for p in model.parameters()]
        self.opt = make_opt(self.params)
        self.model = model

    def step(self) -> None:
        for p, r in zip(self.model.parameters(), self.params):
            r.grad = None if p.grad is None else p.grad.detach().float().clone()
        self.opt.step()

    def follow_writes(self, *written: torch.Tensor) -> None:
        """The writes just made to ``written`` (parameters that held their copies' rounding before), made
        to the copies: each element the write changed takes its new value, the others keep the copy's."""
        with torch.no_grad():
            for p, r in zip(self.model.parameters(), self.params):
                if any(p is w for w in written):
                    r.copy_(torch.where(p == r.to(p.dtype), r, p.float()))

    def assert_equal(self, lean) -> None:
        masters = lean.masters
        for p, r in zip(self.model.parameters(), self.params):
            assert torch.equal(masters.get(p, p).float(), r), "masters are torch's update, bitwise"
            assert torch.equal(p, r.to(p.dtype)), "the model holds the masters rounded"


def _through_a_file(state):
    """``state`` as a checkpoint gives it back (torch's load_state_dict keeps the tensors it is given)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def test_load_state_dict_after_memory_lean_is_what_trains_and_is_exact():
    model = _mlp()
    lean = memory_lean(model, _adamw(model.parameters()), backend="cpu", weights=torch.bfloat16)
    ckpt = {k: v + 0.01 * torch.randn_like(v) for k, v in _mlp().state_dict().items()}  # float32, not bf16 values
    model.load_state_dict(ckpt)
    assert all(torch.equal(lean.masters[p], ckpt[n]) for n, p in model.named_parameters() if p in lean.masters), \
        "the masters take the float32 checkpoint exactly"
    ref = _Reference(model, _adamw, lean)
    for _ in range(3):
        lean.optimizer.zero_grad()
        _backward(model)
        lean.optimizer.step()
        ref.step()
        ref.assert_equal(lean)
    sub = {k: v * 0.5 for k, v in model[0].state_dict().items()}
    model[0].load_state_dict(sub)  # through a submodule: still exact
    assert torch.equal(lean.state_dict()["0.weight"], sub["weight"])


def test_an_in_place_edit_under_no_grad_reaches_the_masters():
    model = _mlp()
    lean = memory_lean(model, _adamw(model.parameters()), backend="cpu", weights=torch.bfloat16)
    ref = _Reference(model, _adamw, lean)
    for step in range(4):
        lean.optimizer.zero_grad()
        _backward(model)
        lean.optimizer.step()
        ref.step()
        if step == 1:
            with torch.no_grad():
                model[0].weight.clamp_(-0.05, 0.05)
                nn.init.zeros_(model[3].bias)
            ref.follow_writes(model[0].weight, model[3].bias)
            bound = torch.tensor(0.05).bfloat16().float()
            assert float(lean.state_dict()["0.weight"].abs().max()) <= bound, "state_dict sees the edit at once"
        ref.assert_equal(lean)


def test_a_second_optimizer_trains_its_part_in_float32_and_an_overlapping_one_is_taken_in():
    model = _mlp()
    plain = copy.deepcopy(model)
    head = list(model[3].parameters())
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    lean = memory_lean(model, _adamw(body), backend="cpu", weights=torch.bfloat16)
    other = torch.optim.SGD(head, lr=0.1)
    assert all(p.dtype == torch.float32 for p in head), "what the lean optimizer does not train stays float32"
    plain_other = torch.optim.SGD(plain[3].parameters(), lr=0.1)
    for _ in range(3):
        lean.optimizer.zero_grad()
        other.zero_grad()
        _backward(model)
        plain[3].weight.grad, plain[3].bias.grad = model[3].weight.grad.clone(), model[3].bias.grad.clone()
        lean.optimizer.step()
        other.step()
        plain_other.step()
    assert torch.equal(model[3].weight, plain[3].weight), "the second optimizer's work is kept"
    assert torch.equal(lean.state_dict()["3.weight"], plain[3].weight)
    lean.remove()
    assert torch.equal(model[3].weight, plain[3].weight), "and remove() hands it back"

    model = _mlp()
    lean = memory_lean(model, _adamw(model.parameters()), backend="cpu", weights=torch.bfloat16)
    sgd = torch.optim.SGD([model[0].weight], lr=0.5)  # overlaps the lean optimizer: updates the bf16 weight
    ref = _Reference(model, _adamw, lean)
    lean.optimizer.zero_grad()
    _backward(model)
    sgd.step()
    ref.follow_writes(model[0].weight)
    lean.optimizer.step()
    ref.step()
    ref.assert_equal(lean)


def test_lean_under_ddp_starts_every_rank_from_rank_0s_weights_and_ddp_first_is_refused(tmp_path):
    proc = torchrun(HERE / "lean_ddp_worker.py", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["identical"], "the masters are the same on both ranks after DDP's broadcast and 3 steps"
        assert r["trained"]
        assert "wrap it in DDP" in r["refused"] and r["other_dtype"] == "torch.float32", "refused, nothing changed"


def test_a_model_already_in_bfloat16_gets_masters_and_trains_as_float32_copies_do():
    model = _mlp().to(torch.bfloat16)
    lean = memory_lean(model, _adamw(model.parameters()), backend="cpu", weights=torch.bfloat16)
    assert len(lean.masters) == len(list(model.parameters())), "every low-precision parameter has a master"
    ref = _Reference(model, _adamw, lean)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(20):
        lean.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(model(X.bfloat16()).float(), Y).backward()
        lean.optimizer.step()
        ref.step()
    ref.assert_equal(lean)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_a_cast_after_memory_lean_gives_the_new_low_precision_parameters_masters():
    model = _mlp()
    lean = memory_lean(model, _adamw(model.parameters()), backend="cpu", weights=torch.bfloat16)
    model.to(torch.bfloat16)
    norm = [p.detach().clone() for p in model[2].parameters()]
    with pytest.warns(RuntimeWarning, match="became low precision"):
        for _ in range(5):
            lean.optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                F.cross_entropy(model(X.bfloat16()).float(), Y).backward()
            lean.optimizer.step()
    assert all(not torch.equal(b, p) for b, p in zip(norm, model[2].parameters())), "the norm still trains"
    masters = {n: lean.masters[p].clone() for n, p in model.named_parameters()}
    model.float()
    lean.optimizer.zero_grad()
    lean.optimizer.sync()
    assert not lean.masters, "float32 again: no masters needed"
    assert all(torch.equal(p, masters[n]) for n, p in model.named_parameters()), "with the masters' values"


def test_a_lean_model_dropped_is_freed():
    """memory_lean keeps no reference to the model (its mark is weak): a model and its handle dropped
    are collected, and what they held with them."""
    import gc
    import weakref

    model = _mlp()
    lean = memory_lean(model, _adamw(model.parameters()), backend="cpu", weights=torch.bfloat16, lm_head="3")
    alive = weakref.ref(model)
    del model, lean
    gc.collect()
    assert alive() is None


def test_memory_lean_twice_is_refused_until_removed():
    model = _mlp()
    opt = _adamw(model.parameters())
    lean = memory_lean(model, opt, backend="cpu", weights=torch.bfloat16)
    with pytest.raises(LeanError, match="already on"):
        memory_lean(model, _adamw(model.parameters()), backend="cpu", weights=torch.bfloat16)
    lean.remove()
    memory_lean(model, opt, backend="cpu", weights=torch.bfloat16).remove()


def test_the_optimizer_state_and_hooks_are_the_users_optimizers_own():
    model = _mlp()
    opt = _adamw(model.parameters())
    calls = []
    opt.register_step_post_hook(lambda o, a, k: calls.append([p.dtype for g in o.param_groups for p in g["params"]]))
    lean = memory_lean(model, opt, backend="cpu", weights=torch.bfloat16)
    w = model[0].weight
    assert len(lean.optimizer.state[w]) == 0  # reading it before a step breaks nothing
    lean.optimizer.zero_grad()
    _backward(model)
    lean.optimizer.step()
    assert len(calls) == 1 and len(calls[0]) == len(list(model.parameters())), "one post-hook call a step, every parameter"
    assert calls[0][0] == torch.float32, "it sees the parameters holding their float32 masters"
    state = opt.state[w]
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].shape == w.shape and float(state["step"]) == 1
    sd = lean.optimizer.state_dict()
    plain = _mlp()
    plain_opt = _adamw(plain.parameters())
    plain_opt.load_state_dict(_through_a_file(sd))
    assert plain_opt.state[plain[0].weight]["exp_avg"].dtype == torch.float32


def test_a_closure_runs_first_as_lightning_passes_it():
    model = _mlp()
    lean = memory_lean(model, _adamw(model.parameters()), backend="cpu", weights=torch.bfloat16)
    ref = _Reference(model, _adamw, lean)

    def closure():
        lean.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(X).float(), Y)
        loss.backward()
        return loss

    loss = lean.optimizer.step(closure)
    ref.step()
    assert torch.is_tensor(loss) and loss.requires_grad is False or loss.grad_fn is not None
    ref.assert_equal(lean)


def test_the_kept_wrapper_goes_on_with_the_same_adamw_state_after_remove():
    """The docs' snippet keeps ``optimizer = lean.optimizer``; after ``lean.remove()`` it steps the float32
    model on with AdamW's state as it was (step count 2, not a restart), as a plain AdamW would."""
    model = _mlp()
    lean = memory_lean(model, _adamw(model.parameters()), backend="cpu", weights=torch.bfloat16)
    optimizer = lean.optimizer
    optimizer.zero_grad()
    _backward(model)
    optimizer.step()
    inner = lean.remove()
    plain = copy.deepcopy(model)
    plain_opt = _adamw(plain.parameters())
    plain_opt.load_state_dict(_through_a_file(inner.state_dict()))
    for m, o in ((model, optimizer), (plain, plain_opt)):
        o.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(m(X).float(), Y).backward()
        o.step()
    assert float(inner.state[model[0].weight]["step"]) == 2
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))


@needs_torchao
def test_without_masters_remove_and_state_dict_give_float32():
    from torchao.optim import _AdamW as AoAdamW  # the float AdamW with stochastic rounding

    model = _mlp()
    lean = memory_lean(model, AoAdamW(model.parameters(), lr=1e-2, bf16_stochastic_round=True), backend="cpu",
                       weights=torch.bfloat16, master=False)
    assert model[0].weight.dtype == torch.bfloat16 and not lean.masters
    values = {n: p.detach().float() for n, p in model.named_parameters()}
    assert all(v.dtype == torch.float32 and torch.equal(v, values[k]) for k, v in lean.state_dict().items()
               if k in values)
    lean.remove()
    assert all(p.dtype == torch.float32 and torch.equal(p, values[n]) for n, p in model.named_parameters())


def test_a_layer_autocast_cannot_run_in_low_precision_stays_float32_and_trains():
    model = nn.Sequential(nn.Linear(16, 8))
    bil = nn.Bilinear(8, 8, 4)
    net = nn.ModuleDict({"lin": model, "bil": bil})
    lean = memory_lean(net, _adamw(net.parameters()), backend="cpu", weights=torch.bfloat16)
    assert bil.weight.dtype == torch.float32 and "Bilinear" in lean.kept["bil.weight"]
    assert model[0].weight.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = net["lin"](X).float()
        net["bil"](h, h).float().sum().backward()
    lean.optimizer.step()


class _Launches(TorchDispatchMode):
    """Counts the ops that do device work (views, aliases and allocations left out)."""

    # views, allocations, reads of the optimizer's host-side step counters, the profiler's markers
    FREE = {"empty", "empty_strided", "split_with_sizes", "split", "view", "alias", "detach", "_local_scalar_dense",
            "_record_function_enter_new", "_record_function_exit"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func._schema.name.split("::")[-1] not in self.FREE:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _launches(layers: int, lean: bool) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    if lean:
        opt = memory_lean(model, opt, backend="cpu", weights=torch.bfloat16).optimizer
    for _ in range(2):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, 8)).float().sum().backward()
        if _ == 1:
            with _Launches() as counter:
                opt.step()
            return counter.count
        opt.step()
    raise AssertionError


def test_the_master_step_is_a_constant_number_of_multi_tensor_ops():
    """Ops dispatched by one optimizer step, counted directly: the same for 4 and 64 parameters, and at
    most twice plain AdamW(foreach=True)'s on the float32 model."""
    small, large = _launches(2, lean=True), _launches(32, lean=True)
    plain = _launches(32, lean=False)
    assert small == large, (small, large)
    assert large <= 2 * plain, (large, plain)


class _Reads(TorchDispatchMode):
    """Counts reads of a tensor's value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def _host_reads(make, lean: bool) -> int:
    """Host reads in one step handed found_inf (torch's fused protocol), beyond none at all."""
    model = _mlp()
    opt = make(model.parameters())
    if lean:
        opt = memory_lean(model, opt, backend="cpu", weights=torch.float16).optimizer
    for i in range(2):
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
            with torch.autocast("cpu", dtype=torch.float16):
                F.cross_entropy(model(X).float(), Y).backward()
        if lean:
            opt.grad_scale, opt.found_inf = None, torch.zeros(())
        with _Reads() as reads:
            opt.step()
        if lean:
            del opt.grad_scale, opt.found_inf
    return reads.count


def test_a_fused_optimizer_skips_on_the_device_without_a_host_read():
    """With torch's fused AdamW the lean step reads nothing on the host (found_inf goes to the kernel);
    with a foreach AdamW it reads found_inf once, as torch's scaler does for such an optimizer."""
    fused = lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)  # noqa: E731
    foreach = lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True)  # noqa: E731
    assert _host_reads(fused, lean=True) == _host_reads(fused, lean=False) == 0
    assert _host_reads(foreach, lean=True) == _host_reads(foreach, lean=False) + 1


def test_a_fused_inner_step_under_the_scaler_is_torchs_fused_adamw_on_float32_copies():
    """float16 weights, the scaler, torch's fused AdamW inside: each step equals torch's fused AdamW on
    float32 copies handed the same scaled gradients, grad_scale and found_inf (torch's fused protocol,
    done by hand), an overflowing step included: bitwise."""
    model = _mlp()
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)  # noqa: E731
    lean = memory_lean(model, make(model.parameters()), backend="cpu", weights=torch.float16)
    ref = _Reference(model, make, lean)
    scaler = amp_backends.get("cpu").grad_scaler("float16", init_scale=2.0**6)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
        for step in range(3):
            lean.optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(X).float(), Y) * (float("inf") if step == 1 else 1.0)
            scale = torch.full((), scaler.get_scale())
            scaler.scale(loss).backward()
            grads = [p.grad.detach().float().clone() for p in model.parameters()]
            found = torch.tensor(float(not all(torch.isfinite(g).all() for g in grads)))
            scaler.step(lean.optimizer)
            scaler.update()
            for r, g in zip(ref.params, grads):
                r.grad = g
            ref.opt.grad_scale, ref.opt.found_inf = scale, found
            ref.opt.step()
            del ref.opt.grad_scale, ref.opt.found_inf
            ref.assert_equal(lean)
            assert scaler.last_step_skipped == (step == 1)


def test_a_lean_checkpoint_through_a_file_resumes_bitwise():
    model = _mlp()
    lean = memory_lean(model, _adamw(model.parameters()), backend="cpu", weights=torch.bfloat16)
    lean.optimizer.zero_grad()
    _backward(model)
    lean.optimizer.step()
    buf = io.BytesIO()
    torch.save({"model": lean.state_dict(), "opt": lean.optimizer.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    again = _mlp()
    back = memory_lean(again, _adamw(again.parameters()), backend="cpu", weights=torch.bfloat16)
    again.load_state_dict(ckpt["model"])  # the model's own load: the masters take it exactly
    back.optimizer.load_state_dict(ckpt["opt"])
    assert back.optimizer.state[again[0].weight]["exp_avg"].dtype == torch.float32
    for m, o in ((model, lean.optimizer), (again, back.optimizer)):
        o.zero_grad()
        _backward(m)
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(lean.state_dict().values(), back.state_dict().values()))


def test_master_weights_is_an_optimizer_the_scaler_and_schedulers_accept():
    model = _mlp()
    lean = memory_lean(model, _adamw(model.parameters()), backend="cpu", weights=torch.bfloat16)
    assert isinstance(lean.optimizer, MasterWeights) and isinstance(lean.optimizer, torch.optim.Optimizer)
    sched = torch.optim.lr_scheduler.StepLR(lean.optimizer, 1, gamma=0.5)
    lean.optimizer.zero_grad()
    _backward(model)
    lean.optimizer.step()
    sched.step()
    assert lean.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)


def _fp16_clip_run(clip: str):
    """float16 weights, tiny gradients under a large scale: scaler.unscale_ then a clip; the lean model
    against torch's AdamW on float32 copies fed the float32 division of the same scaled gradients."""
    torch.manual_seed(0)
    model = _mlp()
    lean = memory_lean(model, _adamw(model.parameters()), backend="cpu", weights=torch.float16)
    ref = _Reference(model, _adamw, lean)
    scaler = amp_backends.get("cpu").grad_scaler("float16", init_scale=2.0**12)
    lost = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
        for _ in range(3):
            lean.optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(X).float() * 1e-3, Y) * 1e-2
            inv = torch.full((), scaler.get_scale()).double().reciprocal().float()
            scaler.scale(loss).backward()
            exact = [p.grad.detach().float() * inv for p in model.parameters()]
            lost += sum(int(((g != 0) & (g.half() == 0)).sum()) for g, p in zip(exact, model.parameters())
                        if p.dtype == torch.float16)
            scaler.unscale_(lean.optimizer)
            if clip == "scaler":
                total = scaler.clip_grad_norm_(lean.optimizer, 1e-4)
            else:
                total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-4)
            scaler.step(lean.optimizer)
            scaler.update()
            for r, g in zip(ref.params, exact):
                r.grad = g
            ref_total = torch.nn.utils.clip_grad_norm_(ref.params, 1e-4)
            ref.opt.step()
            yield lean, ref, total, ref_total, lost


def test_float16_weights_unscaled_and_clipped_through_the_scaler_keep_every_small_gradient():
    """scaler.unscale_ divides the float16 gradients in float32 into the masters' gradients, and
    scaler.clip_grad_norm_ clips those: bitwise torch's float32 recipe, with values that a float16 unscale
    would flush to zero (counted) kept."""
    for lean, ref, total, ref_total, lost in _fp16_clip_run("scaler"):
        assert torch.equal(total, ref_total)
        ref.assert_equal(lean)
    assert lost > 0, "the test's gradients do have values float16 loses"


def test_torchs_clip_after_unscale_on_float16_weights_is_taken_with_a_warning():
    with pytest.warns(RuntimeWarning, match="scaler.clip_grad_norm_"):
        for lean, ref, total, ref_total, lost in _fp16_clip_run("torch"):
            pass
    assert all(torch.isfinite(p).all() for p in lean.model.parameters())


def test_the_lean_fuzz_is_plain_torch_by_hand_bitwise(request):
    """Seeded random programs (tests/lean_differential.py), an eighth of --fuzz-programs (at least 20):
    every master equals plain torch's float32 copy after every step, whatever was interleaved."""
    import lean_differential as ld

    programs = max(20, request.config.getoption("--fuzz-programs") // 8)
    failures = []
    for seed in range(programs):
        program = ld.make_program(seed)
        diff = ld.run_quietly(program)
        if diff:
            failures.append(f"seed {seed}: {diff}\n  program: {program}")
    assert not failures, f"{len(failures)} of {programs} programs differ:\n" + "\n".join(failures[:5])


def test_the_lean_fuzz_covers_every_operation_dtype_and_optimizer():
    import lean_differential as ld

    programs = [ld.make_program(seed) for seed in range(20)]  # the fewest the test above runs
    assert {op for p in programs for op in p["ops"]} == set(ld.OPS)
    assert {(p["weights"], p["optimizer"]) for p in programs} == {
        (w, o) for w in ("float16", "bfloat16") for o in ("sgd", "adam", "adamw")}
    assert {p["impl"] for p in programs} == {"foreach", "fused", "loop"}
    assert sum(p["momentum"] > 0 for p in programs) > 0


def test_the_lean_step_bench_runs_and_counts_a_constant_number_of_ops(tmp_path):
    """bench/lean_step.py at its smoke size: every kind timed, the lean step's ops a constant four more
    than plain AdamW's (the gradients concatenated and cast; the masters cast and copied back)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("lean_step", HERE.parent / "bench" / "lean_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "lean.json"
    assert bench.main(["--smoke", "--rounds", "1", "--models", "gpt2", "--device", "cpu", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert set(row["step_ms"]) >= {"amp-foreach", "lean-foreach"}
    assert row["ops"]["lean-foreach"] == row["ops"]["amp-foreach"] + 4
