"""Lightning (Trainer and Fabric) with AmpPrecision on the CPU, end to end: fp16 really used,
an injected inf skipped, clipping on the true norm, checkpoints that resume identically, DDP."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")
from amp_backends import PerformanceWarning
from amp_backends.integrations.lightning import AmpPrecision

HERE = Path(__file__).resolve().parents[1]  # tests/: the workers
INJECT = 2
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        yield


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(48, 8, generator=g), torch.randn(48, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _grad_norm(params) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params if p.grad is not None))


class RecordingSGD(torch.optim.SGD):
    """Records the gradient norm the update actually uses (after clipping)."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.used_norms: list[float] = []

    def step(self, closure=None):
        self.used_norms.append(_grad_norm(p for g in self.param_groups for p in g["params"]))
        return super().step(closure)


class Regressor(L.LightningModule):
    def __init__(self, inject: int | None = INJECT, fused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.inject, self.fused = inject, fused
        self.batches = 0
        self.dtypes: set[torch.dtype] = set()
        self.true_norms: list[float] = []
        self.skipped: list[bool] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.dtypes.add(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), y)

    def on_after_backward(self):
        if self.batches == self.inject:
            self.net[0].weight.grad[0, 0] = math.inf

    def on_before_optimizer_step(self, optimizer):
        self.true_norms.append(_grad_norm(self.parameters()))  # Lightning's promise: unscaled here

    def on_train_batch_end(self, outputs, batch, batch_idx):
        prec = self.trainer.precision_plugin
        self.skipped.append(prec.last_step_skipped if isinstance(prec, AmpPrecision) else False)
        self.batches += 1

    def configure_optimizers(self):
        if self.fused:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        return RecordingSGD(self.parameters(), lr=0.05)


def _fit(model, plugins, epochs=1, ckpt_path=None, **kw):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, plugins=plugins, gradient_clip_val=0.5,
                        **QUIET, **kw)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return trainer


def test_trainer_fp16_on_cpu_skips_inf_and_clips_the_true_norm():
    ref = Regressor(inject=None)
    _fit(ref, [])
    model = Regressor()
    precision = AmpPrecision("cpu", torch.float16, init_scale=2.0**10, growth_interval=100)
    trainer = _fit(model, [precision])
    assert trainer.precision == "16-mixed" and model.dtypes == {torch.float16}, "fp16 on the CPU, as asked"
    assert model.skipped == [b == INJECT for b in range(6)]
    assert precision.stats.skipped == 1 and precision.scaler.get_scale() == 2.0**9
    for ours, fp32 in zip(model.true_norms[:INJECT], ref.true_norms[:INJECT]):
        assert ours == pytest.approx(fp32, rel=1e-2), "the norm of unscaled gradients, not x1024"
    assert math.isinf(model.true_norms[INJECT])
    opt = trainer.optimizers[0]
    assert len(opt.used_norms) == 5 and max(opt.used_norms) <= 0.5 + 1e-4, "clipped, and never stepped on inf"


def test_trainer_clips_through_the_scaler_with_a_fused_optimizer():
    """Lightning's own MixedPrecision refuses to clip with a fused optimizer; the clip is folded into grad_scale."""
    model = Regressor(fused=True)
    precision = AmpPrecision("cpu", torch.float16, init_scale=2.0**10)
    _fit(model, [precision])
    assert model.skipped == [b == INJECT for b in range(6)]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_trainer_checkpoint_resumes_identically(tmp_path):
    straight = Regressor()
    p1 = AmpPrecision("cpu", torch.float16, init_scale=2.0**10, growth_interval=3)
    _fit(straight, [p1], epochs=2)
    first = Regressor()
    trainer = _fit(first, [AmpPrecision("cpu", torch.float16, init_scale=2.0**10, growth_interval=3)], epochs=1)
    path = tmp_path / "one-epoch.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["AmpPrecision"] == trainer.precision_plugin.scaler.state_dict(), "the scaler's state is in the checkpoint"
    resumed = Regressor(inject=None)
    p2 = AmpPrecision("cpu", torch.float16)  # defaults: the checkpoint restores scale and tracker
    _fit(resumed, [p2], epochs=2, ckpt_path=str(path))
    assert p2.scaler.state_dict() == p1.scaler.state_dict()
    for a, b in zip(resumed.parameters(), straight.parameters()):
        assert torch.equal(a, b)


def _fabric_run(precision, steps=5, inject=INJECT, save_at=None, load=None, path=None, **clip):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[precision] if precision else None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    dtypes = set()
    model[0].register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first = model[0]
    model, opt = fabric.setup(model, opt)
    batches = list(_data())
    start = 0
    if load:
        state = {"model": model, "optimizer": opt, "scaler": precision.scaler, "step": 0}
        fabric.load(path, state)
        start = state["step"]
    norms, skipped = [], []
    for step in range(start, steps):
        x, y = batches[step]
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        fabric.backward(loss)
        if step == inject:
            first.weight.grad[0, 0] = math.inf
        norms.append(float(fabric.clip_gradients(model, opt, max_norm=0.5, **clip)))  # Fabric's defaults
        opt.step()
        opt.zero_grad()
        skipped.append(precision.last_step_skipped if precision else False)
        if save_at is not None and step + 1 == save_at:
            fabric.save(path, {"model": model, "optimizer": opt, "scaler": precision.scaler, "step": step + 1})
    return norms, skipped, [p.detach().clone() for p in model.parameters()], dtypes


def test_fabric_fp16_on_cpu_skips_inf_clips_true_norm_and_resumes(tmp_path):
    ref_norms, _, _, ref_dtypes = _fabric_run(None, inject=None)
    precision = AmpPrecision("cpu", torch.float16, init_scale=2.0**10, growth_interval=2)
    norms, skipped, params, dtypes = _fabric_run(precision, save_at=3, path=tmp_path / "f.ckpt")
    assert dtypes == {torch.float16} and ref_dtypes == {torch.float32}, "Fabric would have made this bf16"
    assert skipped == [s == INJECT for s in range(5)] and precision.stats.skipped == 1
    for a, b in zip(norms[:INJECT], ref_norms[:INJECT]):
        assert a == pytest.approx(b, rel=1e-2)
    resumed = AmpPrecision("cpu", torch.float16)
    norms2, _, params2, _ = _fabric_run(resumed, load=True, path=tmp_path / "f.ckpt")
    assert norms2 == norms[3:] and resumed.scaler.state_dict() == precision.scaler.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(params, params2))


@pytest.mark.parametrize("clip", [{}, {"error_if_nonfinite": True}, {"error_if_nonfinite": False}],
                         ids=["fabric-default", "raise-on-nonfinite", "no-raise"])
def test_fabric_clip_on_an_overflowed_step_clips_nothing_and_the_scaler_skips(clip):
    """Fabric's default error_if_nonfinite=True would raise on the overflow the scaler handles:
    the plugin gives Fabric nothing to clip for that step (norm 0), and found_inf tells why."""
    precision = AmpPrecision("cpu", torch.float16, init_scale=2.0**10)
    norms, skipped, params, _ = _fabric_run(precision, **clip)
    assert skipped == [s == INJECT for s in range(5)]
    assert norms[INJECT] == 0.0 and all(n > 0 for i, n in enumerate(norms) if i != INJECT)
    assert all(torch.isfinite(p).all() for p in params)


def test_fabric_bf16_with_check_finite_skips_without_scaling():
    precision = AmpPrecision("cpu", torch.bfloat16, check_finite=True)
    assert not precision.scaler.is_enabled() and precision.precision == "bf16-mixed"
    _, skipped, params, dtypes = _fabric_run(precision)
    assert dtypes == {torch.bfloat16} and skipped == [s == INJECT for s in range(5)]
    assert all(torch.isfinite(p).all() for p in params)


def test_two_process_ddp_trainer_skips_together(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(HERE / "lightning_ddp_worker.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["world_size"] == 2 and r["identical_across_ranks"] and r["finite"]
        assert [e["skipped"] for e in r["record"]] == [e["batch"] == 2 for e in r["record"]]
        assert r["stats"] == {"skipped": 1, "overflows": 1}
    assert ranks[0]["record"] == ranks[1]["record"]


class LeanRegressor(L.LightningModule):
    """configure_optimizers turns the lean mode on: bf16 weights, float32 masters under the user's SGD."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        self.lean = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        from amp_backends.memory.lean import memory_lean

        self.lean = memory_lean(self.net, torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9),
                                backend="cpu", weights=torch.bfloat16)
        return self.lean.optimizer


def test_lightning_bf16_mixed_trains_a_lean_optimizer_as_the_same_loop_by_hand():
    """Lightning's bf16-mixed precision steps the lean optimizer with a closure; the float32 masters after
    six steps equal the same lean loop written by hand, bitwise."""
    module = LeanRegressor()
    L.Trainer(accelerator="cpu", devices=1, precision="bf16-mixed", max_epochs=1, **QUIET).fit(module, _data())
    from amp_backends.memory.lean import memory_lean

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    lean = memory_lean(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), backend="cpu",
                       weights=torch.bfloat16)
    for x, y in _data():
        lean.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(net(x).float(), y)
        loss.backward()
        lean.optimizer.step()
    ours, theirs = module.lean.state_dict(), lean.state_dict()
    assert module.net[0].weight.dtype == torch.bfloat16
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert not torch.equal(theirs["0.weight"], LeanRegressor().net[0].weight.float())
