"""A hostile review of the Lightning, Fabric, Accelerate and timm integrations, one test per fix, each
against the framework's own mixed precision on the CPU: Lightning's ``MixedPrecision("16-mixed")``
with torch's ``GradScaler``, Fabric's, or torch's ``GradScaler`` driven by hand.

Each test skips on its own without Lightning or Accelerate (the timm one needs neither).
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.amp.grad_scaler import OptState

from amp_backends import AmpBackendsError, PerformanceWarning

Batch = tuple[torch.Tensor, torch.Tensor]
QUIET: dict[str, Any] = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0)


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        warnings.filterwarnings("ignore", ".*max_steps.*")
        loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        yield
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@pytest.fixture
def L() -> ModuleType:
    """Lightning, or the test skips."""
    return pytest.importorskip("lightning")


@pytest.fixture
def acc_mod() -> Iterator[ModuleType]:
    """Accelerate with fresh process-wide state, or the test skips."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield accelerate
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


# -- shared pieces --------------------------------------------------------------------------
def _data(n: int, inf_at: int | None = None) -> list[Batch]:
    """n batches of 4; batch ``inf_at`` x1e30 (finite in float32, inf in an fp16 forward)."""
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(n, 4, 8, generator=g), torch.randn(n, 4, 2, generator=g)
    if inf_at is not None:
        xs[inf_at] = xs[inf_at] * 1e30
    return list(zip(xs, ys))


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _amp(dtype: torch.dtype = torch.float16, **scaler_kwargs: Any) -> Any:
    from amp_backends.integrations.lightning import AmpPrecision

    return AmpPrecision("cpu", dtype, **scaler_kwargs)


def _lightnings(**scaler_kwargs: Any) -> Any:
    """Lightning's own 16-mixed plugin with torch's scaler on the CPU (it would pick bf16 there by itself)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **scaler_kwargs))


def _fabrics(dtype: torch.dtype = torch.float16, **scaler_kwargs: Any) -> Any:
    """Fabric's own mixed precision plugin (a scaler for fp16 only, as Fabric requires)."""
    from lightning.fabric.plugins.precision import MixedPrecision

    if dtype == torch.bfloat16:
        return MixedPrecision("bf16-mixed", "cpu")
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **scaler_kwargs))


@functools.cache
def _module_class() -> type:
    """The LightningModule the Trainer tests share (built on first use, so that the file imports without Lightning)."""
    import lightning as L

    class Net(L.LightningModule):
        """Sequential 8-16-2; manual optimization with ``self.clip_gradients`` when ``manual_clip`` is given;
        ``training_step`` returns None (Lightning's "skip this batch") on ``skip_batch``; records the
        gradient norm ``on_before_optimizer_step`` sees."""

        def __init__(self, optimizer: str = "sgd", manual_clip: float | None = None, skip_batch: int | None = None):
            super().__init__()
            self.net = _net()
            self.optimizer_kind, self.manual_clip, self.skip_batch = optimizer, manual_clip, skip_batch
            self.automatic_optimization = manual_clip is None
            self.norms: list[float | None] = []

        def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor | None:
            if batch_idx == self.skip_batch:
                return None
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
            if self.automatic_optimization:
                return loss
            opt = self.optimizers()
            assert not isinstance(opt, list), "one optimizer"
            self.manual_backward(loss)
            # the wrapper, as Lightning's docs write it (its stub asks for an Optimizer)
            self.clip_gradients(opt, gradient_clip_val=self.manual_clip, gradient_clip_algorithm="norm")  # type: ignore[arg-type]
            opt.step()
            opt.zero_grad()
            return None

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            grads = [p.grad.double().norm() for p in self.parameters() if p.grad is not None]
            self.norms.append(float(torch.stack(grads).norm()) if grads else None)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if self.optimizer_kind == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            return torch.optim.AdamW(self.parameters(), lr=0.01, fused=self.optimizer_kind == "adamw-fused")

    return Net


def _fit(plugin: Any, model: Any = None, batches: list[Batch] | None = None, ckpt_path: str | None = None,
         **trainer_kwargs: Any) -> tuple[Any, Any]:
    """Fit ``model`` (a default Net) one epoch (unless told) over ``batches`` (4 clean ones) with ``plugin``; (trainer, model)."""
    import lightning as L

    model = _module_class()() if model is None else model
    quiet = {**QUIET, **{k: trainer_kwargs.pop(k) for k in list(trainer_kwargs) if k in QUIET}}
    trainer_kwargs.setdefault("max_epochs", 1)
    trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], **quiet, **trainer_kwargs)
    loader: torch.utils.data.DataLoader[Batch] = torch.utils.data.DataLoader(
        _data(4) if batches is None else batches, batch_size=None)  # type: ignore[arg-type]  # a list serves as a map-style dataset
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return trainer, model


def _assert_same_params(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


# -- 1. manual optimization: self.clip_gradients gets Lightning's optimizer wrapper ---------------
def test_manual_optimization_clip_gradients_unscales_once_as_lightnings_own(L: ModuleType) -> None:
    """Manual optimization hands the plugin a LightningOptimizer: the gradients are unscaled once, not
    once for the wrapper and again for the optimizer (updates were 1,000x too small)."""
    Net = _module_class()
    _, ours = _fit(_amp(init_scale=2.0**10), Net(manual_clip=1e6), max_steps=3)
    _, theirs = _fit(_lightnings(init_scale=2.0**10), Net(manual_clip=1e6), max_steps=3)
    init = _flat(Net())
    assert (_flat(theirs) - init).norm() > 0.1, "the reference trained"
    _assert_same_params(ours, theirs)
    assert ours.norms == pytest.approx(theirs.norms, rel=1e-6), "the hook sees unscaled gradients, as Lightning's"


# -- 2. a batch the Trainer skips (training_step returned None) with gradient clipping ---------
@pytest.mark.parametrize("accumulate", [1, 2])
def test_skipped_batch_with_gradient_clip_val_trains_as_lightnings_own(L: ModuleType, accumulate: int) -> None:
    """training_step returning None on batch 1, gradient_clip_val set: the skipped batch is not clipped
    (nor unscaled), so the next step runs (it asserted) and, with accumulation, is not 1,000x too large."""
    Net = _module_class()
    kw: dict[str, Any] = dict(gradient_clip_val=1e6, accumulate_grad_batches=accumulate)
    _, ours = _fit(_amp(init_scale=2.0**10), Net(skip_batch=1), **kw)
    _, theirs = _fit(_lightnings(init_scale=2.0**10), Net(skip_batch=1), **kw)
    assert (_flat(theirs) - _flat(Net())).norm() > 0.01, "the reference trained"
    _assert_same_params(ours, theirs)


# -- 3. clipping by value on a step whose fp16 gradients overflowed -----------------------------
def test_value_clipping_on_an_overflowed_step_runs_and_backs_off_as_lightnings_and_fabrics_own(L: ModuleType) -> None:
    """gradient_clip_algorithm='value' (Trainer) and clip_gradients(clip_val=...) (Fabric) on a step whose
    gradients overflowed at the default scale: torch's clip_grad_value_ was handed an empty list and raised
    'Expected !nested_tensorlist[0].empty()'; now the step is skipped and the scale backs off as Lightning's."""
    batches = _data(4, inf_at=1)
    kw: dict[str, Any] = dict(batches=batches, max_steps=4, gradient_clip_val=0.1, gradient_clip_algorithm="value")
    amp, ref = _amp(), _lightnings()
    _, ours = _fit(amp, **kw)
    _, theirs = _fit(ref, **kw)
    assert ref.scaler.get_scale() == 2.0**15, "the reference backed off once"
    assert amp.scaler.get_scale() == ref.scaler.get_scale() and amp.stats.skipped == 1
    _assert_same_params(ours, theirs)

    def fabric_run(plugin: Any) -> torch.nn.Module:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        net = _net()
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for x, y in batches:
            fabric.backward(torch.nn.functional.mse_loss(model(x).float(), y))
            fabric.clip_gradients(model, opt, clip_val=0.1)
            opt.step()
            opt.zero_grad()
        return net

    amp, ref = _amp(), _fabrics()
    ours_net, theirs_net = fabric_run(amp), fabric_run(ref)
    assert amp.scaler.get_scale() == ref.scaler.get_scale() == 2.0**15
    _assert_same_params(ours_net, theirs_net)


# -- 4. Fabric: the model's outputs in float32 -----------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fabric_outputs_are_float32_and_a_loss_outside_the_forward_is_fabrics_own(L: ModuleType,
                                                                                  dtype: torch.dtype) -> None:
    """Fabric's own plugin gives the model's floating outputs in float32; so does AmpPrecision now (they came
    back in the autocast dtype). A loss computed outside the forward from outputs ~320 ((out**2).mean(),
    102,400 > fp16's 65,504) is then the same finite float32 loss as with Fabric's own, the layers still in
    the autocast dtype, and training matches."""

    def run(plugin: Any) -> tuple[list[torch.Tensor], set[torch.dtype], torch.nn.Linear]:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 3)
        torch.nn.init.constant_(lin.weight, 40.0)
        inner: set[torch.dtype] = set()
        lin.register_forward_hook(lambda m, i, o: inner.add(o.dtype))
        model, opt = fabric.setup(lin, torch.optim.SGD(lin.parameters(), lr=1e-6))
        losses = []
        for _ in range(3):
            out = model(torch.ones(4, 8))
            assert out.dtype == torch.float32
            loss = (out**2).mean()
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses, inner, lin

    kw = {"init_scale": 64.0} if dtype == torch.float16 else {}  # scaled gradients ~213 x scale stay finite
    amp, ref = _amp(dtype, **kw), _fabrics(dtype, **kw)
    ours, ours_inner, ours_net = run(amp)
    theirs, theirs_inner, theirs_net = run(ref)
    assert ours_inner == theirs_inner == {dtype}, "the forward itself still runs in the autocast dtype"
    assert all(a.dtype == torch.float32 and torch.isfinite(a) and torch.equal(a, b) for a, b in zip(ours, theirs))
    if dtype == torch.float16:
        assert amp.scaler.get_scale() == ref.scaler.get_scale() == 64.0 and amp.stats.skipped == 0
    assert (ours_net.weight < 40.0).all(), "the steps ran"
    _assert_same_params(ours_net, theirs_net)


# -- 5. fused optimizers: on_before_optimizer_step sees unscaled gradients ----------------------
@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
def test_fused_adamw_hook_sees_the_unscaled_norm(L: ModuleType, clip: float | None) -> None:
    """AdamW(fused=True): on_before_optimizer_step sees the same gradient norm as a non-fused AdamW under
    Lightning's own plugin (it saw the norm x1024), and the parameters follow."""
    Net = _module_class()
    _, fused = _fit(_amp(init_scale=2.0**10), Net(optimizer="adamw-fused"), max_steps=2, gradient_clip_val=clip)
    _, plain = _fit(_lightnings(init_scale=2.0**10), Net(optimizer="adamw"), max_steps=2, gradient_clip_val=clip)
    assert len(fused.norms) == len(plain.norms) == 2
    assert fused.norms[0] == plain.norms[0], "the same gradients, unscaled alike"
    assert fused.norms == pytest.approx(plain.norms, rel=1e-5)
    for a, b in zip(fused.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- 6. a checkpoint Lightning's own plugin wrote ------------------------------------------------
def test_checkpoint_of_lightnings_own_plugin_resumes_amp_precisions_scaler(L: ModuleType, tmp_path: Any) -> None:
    """Switching to AmpPrecision mid-run: the scaler state Lightning's MixedPrecision saved (under
    "MixedPrecision", or an older checkpoint's "native_amp_scaling_state") is restored (the scale stayed at
    the default 65536), and the resumed run equals the same resume with Lightning's own plugin."""
    ref = _lightnings(init_scale=64.0, growth_interval=2)
    trainer, _ = _fit(ref, max_steps=3, enable_checkpointing=True, default_root_dir=str(tmp_path))
    path = tmp_path / "theirs.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["MixedPrecision"]
    assert saved["scale"] == 128.0 and saved["_growth_tracker"] == 1, "the reference grew once"

    amp, again = _amp(), _lightnings()
    resume: dict[str, Any] = dict(max_epochs=2, max_steps=5, ckpt_path=str(path))
    trainer, ours = _fit(amp, **resume)
    _, theirs = _fit(again, **resume)
    assert trainer.global_step == 4, "one step after the resume"
    assert amp.scaler.get_scale() == again.scaler.get_scale() == 256.0, "grew at the 2nd step of the interval"
    assert amp.scaler.state_dict()["_growth_tracker"] == again.scaler.state_dict()["_growth_tracker"] == 0
    _assert_same_params(ours, theirs)

    older = _amp()
    older.on_load_checkpoint({"native_amp_scaling_state": saved})
    assert older.scaler.get_scale() == 128.0


# -- 7. a clip on every micro-batch of an accumulation ---------------------------------------
def _accumulation_batches() -> list[Batch]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(4)]


def _accelerate_run(acc_mod: ModuleType, clip_every_micro_batch: bool) -> torch.nn.Module:
    from amp_backends.integrations.accelerate import prepare

    acc = acc_mod.Accelerator(cpu=True, gradient_accumulation_steps=2)
    prepare(acc, "cpu", torch.float16, init_scale=2.0**10)
    net = _net()
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for x, y in _accumulation_batches():
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            if clip_every_micro_batch or acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    return net


def _torch_by_hand(clip_every_micro_batch: bool) -> torch.nn.Module:
    """The same accumulation on torch's GradScaler: autocast forward, outputs in float32 (as Accelerate's),
    the loss divided by the accumulation, unscale_ and clip, step and update every 2nd micro-batch."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for i, (x, y) in enumerate(_accumulation_batches()):
        with torch.autocast("cpu", dtype=torch.float16):
            out = net(x)
        scaler.scale(torch.nn.functional.mse_loss(out.float(), y) / 2).backward()
        if clip_every_micro_batch or i % 2 == 1:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        if i % 2 == 1:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return net


def test_accelerate_clip_on_every_micro_batch_is_refused_as_torch_refuses_it(acc_mod: ModuleType) -> None:
    """Accelerate's clip_grad_norm_ on every micro-batch inside accumulate() raises at the second clip naming
    sync_gradients, as torch's scaler raises at its second unscale_ (the update was 56x the fp32 one); one
    clip per step (when sync_gradients) trains bitwise as torch's GradScaler by hand, as before."""
    with pytest.raises(RuntimeError, match="unscale_"):
        _torch_by_hand(clip_every_micro_batch=True)
    with pytest.raises(RuntimeError, match="sync_gradients"):
        _accelerate_run(acc_mod, clip_every_micro_batch=True)
    once = _accelerate_run(acc_mod, clip_every_micro_batch=False)
    assert not torch.equal(_flat(once), _flat(_net())), "it stepped"
    _assert_same_params(once, _torch_by_hand(clip_every_micro_batch=False))


def test_fabric_clip_on_every_micro_batch_is_refused_as_fabrics_own_refuses_it(L: ModuleType) -> None:
    """Fabric's clip_gradients on both micro-batches of an accumulation raises at the second clip (naming
    sync_gradients) before any step, as Fabric's own plugin (torch's scaler) raises; one clip per step
    trains bitwise as Fabric's own."""

    def fabric_run(plugin: Any, clip_every_micro_batch: bool) -> torch.nn.Module:
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        net = _net()
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for i, (x, y) in enumerate(_data(2)):
            with fabric.no_backward_sync(model, enabled=i == 0):
                fabric.backward(torch.nn.functional.mse_loss(model(x).float(), y) / 2)
            if clip_every_micro_batch or i == 1:
                fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        return net

    with pytest.raises(RuntimeError, match="unscale_"):
        fabric_run(_fabrics(init_scale=2.0**10), clip_every_micro_batch=True)
    amp = _amp(init_scale=2.0**10)
    with pytest.raises(RuntimeError, match="sync_gradients"):
        fabric_run(amp, clip_every_micro_batch=True)
    assert amp.stats.steps == 0 and amp.scaler.get_scale() == 2.0**10
    once = fabric_run(_amp(init_scale=2.0**10), clip_every_micro_batch=False)
    assert not torch.equal(_flat(once), _flat(_net())), "it stepped"
    _assert_same_params(once, fabric_run(_fabrics(init_scale=2.0**10), clip_every_micro_batch=False))


# -- 8. prepare(accelerator) twice -----------------------------------------------------------
def test_prepare_twice_is_refused_and_changes_nothing(acc_mod: ModuleType) -> None:
    """A second prepare on one Accelerator is refused (the first call's autocast wrapped the forward, the
    second's scaler stepped: fp16 compute with a disabled scaler); the first call's setup stays."""
    from amp_backends.integrations.accelerate import prepare

    acc = acc_mod.Accelerator(cpu=True)
    scaler = prepare(acc, "cpu", torch.float16)
    before = (acc.scaler, acc.amp_backend, acc.native_amp, acc.prepare_model, acc.prepare_optimizer,
              acc.unscale_gradients, acc.autocast)
    with pytest.raises(AmpBackendsError, match="ran on this Accelerator already"):
        prepare(acc, "cpu", torch.bfloat16)
    assert (acc.scaler, acc.amp_backend, acc.native_amp, acc.prepare_model, acc.prepare_optimizer,
            acc.unscale_gradients, acc.autocast) == before
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    seen: list[torch.dtype] = []
    net[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model = acc.prepare(net)
    assert model(torch.randn(2, 4)).dtype == torch.float32 and seen == [torch.float16]
    assert acc.scaler is scaler and scaler.is_enabled() and scaler.get_scale() == 2.0**16


# -- 9. timm's NativeScaler with clip_mode='agc' and no timm --------------------------------------
def test_agc_without_timm_is_refused_before_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """clip_mode='agc' where timm cannot be imported raises ValueError before the backward and the unscale
    (it came after them: gradients written and the optimizer left UNSCALED); the next call then trains
    bitwise as torch's GradScaler by hand."""
    from amp_backends.integrations.timm import NativeScaler

    monkeypatch.setitem(sys.modules, "timm", None)
    monkeypatch.setitem(sys.modules, "timm.utils.agc", None)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ns = NativeScaler("cpu", torch.float16, init_scale=2.0**10)
    x = torch.randn(3, 4)

    def loss(m: torch.nn.Module) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return m(x).float().pow(2).mean()

    with pytest.raises(ValueError, match="install timm"):
        ns(loss(model), opt, clip_grad=1.0, clip_mode="agc", parameters=model.parameters())
    assert all(p.grad is None for p in model.parameters()), "no backward ran"
    assert ns.scaler._per_optimizer_states[id(opt)]["stage"] is OptState.READY
    ns(loss(model), opt, clip_grad=1.0, clip_mode="norm", parameters=model.parameters())

    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 2)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(loss(ref)).backward()
    scaler.unscale_(ref_opt)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    scaler.step(ref_opt)
    scaler.update()
    _assert_same_params(model, ref)
    assert ns.state_dict() == scaler.state_dict() and not math.isnan(ns.scaler.get_scale())
