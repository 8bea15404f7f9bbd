"""HF Accelerate and the Transformers Trainer on the backend's autocast and scaler, on the CPU."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import AutocastKwargs

from amp_backends import AmpBackendsError, GradScaler, PerformanceWarning
from amp_backends.integrations.accelerate import prepare

INJECT = 2


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; every run here starts from a clean one."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(6)]


def _run(amp: bool, fused: bool = False, inject: int | None = INJECT, steps: int = 6, save_dir=None, load_dir=None,
         mixed_precision: str = "no"):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, mixed_precision=mixed_precision)
    scaler = prepare(acc, "cpu", None if mixed_precision != "no" else torch.float16,
                     init_scale=2.0**10, growth_interval=3) if amp else None
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    first = model[0]
    dtypes = set()
    first.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=0.05))
    model, opt = acc.prepare(model, opt)
    start = 0
    if load_dir is not None:
        acc.load_state(load_dir)
        start = 3
    norms, skipped = [], []
    for step, (x, y) in list(enumerate(_batches()))[start:steps]:
        loss = torch.nn.functional.mse_loss(model(x), y)
        acc.backward(loss)
        if step == inject:
            first.weight.grad[0, 0] = math.inf
        norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        skipped.append(acc.optimizer_step_was_skipped)
        if save_dir is not None and step == 2:
            acc.save_state(save_dir)
    params = [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    return {"norms": norms, "skipped": skipped, "params": params, "dtypes": dtypes, "scaler": scaler,
            "acc": acc, "model": model}


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_on_cpu_skips_inf_and_clips_unscaled_gradients(fused):
    ref = _run(amp=False, fused=fused, inject=None)
    ours = _run(amp=True, fused=fused)
    assert ours["dtypes"] == {torch.float16} and ref["dtypes"] == {torch.float32}
    assert ours["skipped"] == [s == INJECT for s in range(6)], "optimizer_step_was_skipped, fused optimizers too"
    for a, b in zip(ours["norms"][:INJECT], ref["norms"][:INJECT]):
        assert a == pytest.approx(b, rel=1e-2), "Accelerate alone returns the norm of gradients still x1024"
    assert math.isinf(ours["norms"][INJECT])
    assert ours["scaler"].stats.skipped == 1 and all(torch.isfinite(p).all() for p in ours["params"])


def test_mixed_precision_fp16_on_cpu_means_fp16_not_fp32():
    ours = _run(amp=True, mixed_precision="fp16", inject=None, steps=2)
    assert ours["dtypes"] == {torch.float16} and ours["scaler"].is_enabled()


def test_save_state_and_load_state_resume_identically(tmp_path):
    straight = _run(amp=True, save_dir=tmp_path / "state")
    assert (tmp_path / "state" / "scaler.pt").exists()
    resumed = _run(amp=True, load_dir=tmp_path / "state")
    assert resumed["norms"] == straight["norms"][3:]
    assert resumed["scaler"].state_dict() == straight["scaler"].state_dict()
    assert all(torch.equal(a, b) for a, b in zip(resumed["params"], straight["params"]))


def test_autocast_handler_unwrap_and_misuse():
    run = _run(amp=True, inject=None, steps=1)
    acc, model = run["acc"], run["model"]
    a = torch.randn(4, 4)
    with acc.autocast():
        assert torch.mm(a, a).dtype == torch.float16
    with acc.autocast(autocast_handler=AutocastKwargs(enabled=False)):
        assert torch.mm(a, a).dtype == torch.float32
    seen = []
    inner = acc.unwrap_model(model, keep_fp32_wrapper=False)
    inner[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    inner(torch.randn(2, 8))
    assert seen == [torch.float32], "unwrap_model removes the autocast wrapper, as for Accelerate's own"
    with pytest.raises(AmpBackendsError, match="before accelerator.prepare"):
        prepare(acc, "cpu", torch.float16)


# -- the Transformers Trainer -----------------------------------------------------------
class _Tiny(torch.nn.Module):
    def __init__(self, inject: int | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.backwards = 0
        self.dtypes: set[torch.dtype] = set()

        def hook(grad):
            self.backwards += 1
            return torch.full_like(grad, math.inf) if self.backwards - 1 == inject else grad

        self.net[0].weight.register_hook(hook)

    def forward(self, x, labels=None):
        out = self.net(x)
        self.dtypes.add(out.dtype)
        return {"loss": torch.nn.functional.mse_loss(out.float(), labels), "logits": out}


def _train(tmp_path, amp: bool, inject: int | None = INJECT, max_steps: int = 6, save_steps: int | None = None,
           resume: str | None = None):
    transformers = pytest.importorskip("transformers")
    from amp_backends.integrations.transformers import AmpTrainer

    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(1, generator=g)} for _ in range(48)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=max_steps, learning_rate=0.05,
        optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.5, logging_steps=1, use_cpu=True,
        report_to="none", save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    model = _Tiny(inject)
    if amp:
        trainer = AmpTrainer(model=model, args=args, train_dataset=data, amp_backend="cpu", amp_dtype=torch.float16,
                             amp_scaler_kwargs={"init_scale": 2.0**10})
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=resume)
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    return trainer, model, norms


def test_trainer_logs_the_true_grad_norm_and_skips_inf(tmp_path):
    _, _, ref_norms = _train(tmp_path / "fp32", amp=False, inject=None)
    trainer, model, norms = _train(tmp_path / "amp", amp=True)
    assert model.dtypes == {torch.float16} and isinstance(trainer.accelerator.scaler, GradScaler)
    for a, b in zip(norms[:INJECT], ref_norms[:INJECT]):
        assert a == pytest.approx(b, rel=1e-2), "Accelerate alone logs the norm x1024"
    assert not math.isfinite(norms[INJECT])
    assert trainer.amp_scaler.stats.skipped == 1 and all(torch.isfinite(p).all() for p in model.parameters())


def test_trainer_checkpoint_holds_the_scaler_and_resumes_identically(tmp_path):
    straight, straight_model, _ = _train(tmp_path / "a", amp=True, save_steps=3)
    ckpt = tmp_path / "a" / "checkpoint-3"
    assert torch.load(ckpt / "scaler.pt", weights_only=True)["scale"] == 2.0**9, "backed off at step 2"
    resumed, resumed_model, _ = _train(tmp_path / "b", amp=True, inject=None, resume=str(ckpt))
    assert resumed.amp_scaler.state_dict() == straight.amp_scaler.state_dict()
    for a, b in zip(resumed_model.parameters(), straight_model.parameters()):
        assert torch.equal(a, b)


def test_bf16_check_finite_through_accelerates_own_step_call():
    """Accelerate calls ``scaler.step(optimizer, closure)`` with the closure None, positionally:
    the unscaled (bf16) scaler with check_finite takes it and still refuses inf steps."""
    acc = Accelerator(cpu=True)
    scaler = prepare(acc, "cpu", torch.bfloat16, check_finite=True)
    assert not scaler.is_enabled()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    skipped = []
    for step, (x, y) in enumerate(_batches()[:4]):
        acc.backward(torch.nn.functional.mse_loss(model(x).float(), y))
        if step == 1:
            acc.unwrap_model(model)[0].weight.grad[0, 0] = math.inf
        opt.step()
        opt.zero_grad()
        skipped.append(acc.optimizer_step_was_skipped)
    assert skipped == [False, True, False, False]
    assert all(torch.isfinite(p).all() for p in acc.unwrap_model(model).parameters())


def test_trainer_bf16_with_check_finite(tmp_path):
    transformers = pytest.importorskip("transformers")
    from amp_backends.integrations.transformers import AmpTrainer

    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(8, generator=g), "labels": torch.randn(1, generator=g)} for _ in range(32)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=4, learning_rate=0.05, optim="sgd",
        use_cpu=True, report_to="none", save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )
    model = _Tiny(inject=1)
    trainer = AmpTrainer(model=model, args=args, train_dataset=data, amp_backend="cpu", amp_dtype=torch.bfloat16,
                         amp_scaler_kwargs={"check_finite": True})
    trainer.train()
    assert trainer.amp_scaler.stats.skipped == 1 and all(torch.isfinite(p).all() for p in model.parameters())


class _Siblings(torch.nn.Module):
    """q, k and v read float32 activations that autocast casts for each of them."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        h = x * 2
        return self.q(h) * self.k(h) + self.v(other)


def test_cpu_offload_makes_the_shared_casts_lever_stand_aside_and_say_so(monkeypatch):
    """accelerate's ``cpu_offload`` wraps each layer's forward on the instance: memory_lean's shared casts
    stand aside there (the wrapper is handed the float32 input, as without the lever), and say so: one
    PerformanceWarning, ``Lean.stood_aside`` names q, k and v with accelerate's wrapper. The output and
    the input's gradient are bitwise those of the same offloaded model without the lever."""
    from amp_backends.memory import hooks_around, memory_lean

    monkeypatch.setattr(hooks_around, "_WARNED", set())
    x, other = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    results, said, lean = [], [], None
    for on in (False, True):
        torch.manual_seed(0)
        model = _Siblings()
        accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
        if on:
            lean = memory_lean(model, None, saves=False, activations=False, activation_outputs=False)
        x.grad = None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):  # a second forward warns no more
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = model(x, other)
        y.float().pow(2).sum().backward()
        results.append((y.detach(), x.grad.clone()))
        said = [str(w.message) for w in caught if issubclass(w.category, PerformanceWarning)]
    assert all(torch.equal(a, b) for a, b in zip(*results))
    wrapper = "shared_casts: its forward replaced on the instance (accelerate.hooks.add_hook_to_module.<locals>.new_forward)"
    assert lean is not None and lean.stood_aside == {"q": wrapper, "k": wrapper, "v": wrapper}
    assert len(said) == 1 and "shared_casts lever stands aside on a Linear" in said[0], said
