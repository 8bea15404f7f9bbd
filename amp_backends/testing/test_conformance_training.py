"""Conformance: the GradScaler end to end, a model that trains, distributed found_inf."""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import amp_backends
import amp_backends.distributed


def _setup(backend, seed=0):
    torch.manual_seed(seed)
    dev = backend.device()
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(dev)
    x = torch.randn(128, 8).to(dev)
    y = torch.tanh(x.cpu() @ torch.linspace(-1, 1, 8).unsqueeze(1)).to(dev)
    return model, x, y


def test_scaler_skips_on_overflow_backs_off_and_grows(backend):
    model, x, y = _setup(backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = amp_backends.GradScaler(backend, init_scale=2.0**8, growth_interval=3)
    scales = []
    for step in range(8):
        opt.zero_grad()
        with backend.autocast(torch.float16 if torch.float16 in backend.supported_dtypes() else None):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step == 2:
            with torch.no_grad():
                model[0].weight.grad.view(-1)[5] = math.inf
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert unchanged is (step == 2) and scaler.last_step_skipped is (step == 2)
        scales.append(scaler.get_scale())
    assert scales[2] == 2.0**7, "backoff x0.5 on the overflow"
    assert scales[5] == 2.0**8, "growth x2 after growth_interval clean steps"
    assert scaler.stats.skipped == 1 and scaler.stats.overflows == 1


def test_overflow_computed_on_the_device_is_found(backend):
    """An overflow made by a device op (not written in from the host): found however the device
    reports it, per tensor (IEEE inf) or through a status register (saturation mode)."""
    model, x, y = _setup(backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = amp_backends.GradScaler(backend, init_scale=2.0**8)
    loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    huge = torch.full((), 3e38, device=backend.device())
    with torch.no_grad():
        model[2].weight.grad.mul_(huge).mul_(huge)  # beyond float32's range on the device
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped and all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0**7


def _overflowing(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` times 3e38 on the device: its backward, through the scale, leaves float32's
    range, so every gradient overflows on the device (inf, or saturated with the status set)."""
    return loss * torch.full((), 3e38, device=loss.device)


@pytest.mark.parametrize("bad", [0, 1, 2])
def test_accumulation_keeps_an_overflow_from_any_micro_batch(backend, bad):
    """Three micro-batches, one ``step()``: an overflow in any of them skips the step and backs
    off. A device that keeps overflow in a status register must not clear it on every
    ``scale()`` (torch_npu clears it once per iteration)."""
    model, x, y = _setup(backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = amp_backends.GradScaler(backend, init_scale=2.0**8)
    before = [p.detach().clone() for p in model.parameters()]
    for micro in range(3):
        xs, ys = x[micro::3], y[micro::3]
        loss = torch.nn.functional.mse_loss(model(xs).float(), ys) / 3
        scaler.scale(_overflowing(loss) if micro == bad else loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.last_step_skipped, f"the overflow in micro-batch {bad} of 3 was lost"
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert scaler.get_scale() == 2.0**7
    # the next iteration is clean again: the overflow does not leak into it
    opt.zero_grad()
    for micro in range(3):
        scaler.scale(torch.nn.functional.mse_loss(model(x[micro::3]).float(), y[micro::3]) / 3).backward()
    scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped and scaler.get_scale() == 2.0**7


def test_two_optimizers_both_skip_an_overflowing_iteration(backend):
    """One backward, two optimizers stepped by one scaler: an overflow in the backward skips
    both (a status register is read once and holds for the iteration), and the next
    iteration steps both."""
    model, x, y = _setup(backend)
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.05)
    opt_b = torch.optim.SGD(model[2].parameters(), lr=0.05)
    scaler = amp_backends.GradScaler(backend, init_scale=2.0**8)
    for step in range(2):
        opt_a.zero_grad()
        opt_b.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(_overflowing(loss) if step == 0 else loss).backward()
        before = [p.detach().clone() for p in model.parameters()]
        skipped = []
        for opt in (opt_a, opt_b):
            scaler.step(opt)
            skipped.append(scaler.last_step_skipped)
        scaler.update()
        unchanged = [torch.equal(b, p) for b, p in zip(before, model.parameters())]
        assert skipped == [step == 0] * 2, f"iteration {step}: skipped {skipped}"
        assert unchanged == [step == 0] * 4
    assert scaler.get_scale() == 2.0**7


def test_arena_matches_the_per_tensor_path(backend):
    """flat_grads() on this device: the same steps, skips and parameters as without it."""
    def run(arena):
        model, x, y = _setup(backend, seed=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if arena:
            amp_backends.flat_grads(opt)
        scaler = amp_backends.GradScaler(backend, init_scale=2.0**8, growth_interval=2)
        for step in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            if step == 1:
                with torch.no_grad():
                    model[0].weight.grad[1, 3] = math.inf
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
        return [p.detach().cpu() for p in model.parameters()], scaler.stats.skipped, scaler.get_scale()

    params, skipped, scale = run(True)
    ref_params, ref_skipped, ref_scale = run(False)
    assert skipped == ref_skipped == 1 and scale == ref_scale
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))


def test_scaler_state_dict_round_trip(backend):
    scaler = amp_backends.GradScaler(backend, init_scale=1024.0, growth_interval=7)
    scaler.scale(torch.ones((), device=backend.device()))
    scaler.update(512.0)
    state = scaler.state_dict()
    torchs = {"scale": 512.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 7, "_growth_tracker": 0}
    # A backend whose vendor scaler needs "dynamic" in a checkpoint (torch_npu's) gets it too.
    assert state == ({**torchs, "dynamic": True} if backend.state_dict_dynamic else torchs)
    fresh = amp_backends.GradScaler(backend)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    theirs = torch.amp.GradScaler(backend.device_type)
    theirs.load_state_dict(state)
    assert theirs.state_dict() == torchs
    with pytest.raises(amp_backends.StateDictError):
        fresh.load_state_dict({**state, "scale": -1.0})
    assert fresh.state_dict() == state


def _train(backend, amp: bool, steps: int = 150):
    model, x, y = _setup(backend, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = backend.grad_scaler(enabled=amp)
    for _ in range(steps):
        opt.zero_grad()
        with backend.autocast(enabled=amp):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x).float(), y).item()


def test_model_trains_under_amp_close_to_fp32(backend):
    amp_loss = _train(backend, amp=True)
    fp32_loss = _train(backend, amp=False)
    assert amp_loss < 0.02, "trains to the loss threshold under AMP"
    assert abs(amp_loss - fp32_loss) < 0.01, "within tolerance of the fp32 run"


def _rank(rank: int, world: int, init: str, backend_name: str, out: str) -> None:
    be = amp_backends.get(backend_name)
    dist.init_process_group(be.dist_backend, init_method=init, rank=rank, world_size=world)
    try:
        dev = be.device(rank) if be.device_type != "cpu" else be.device()
        param = torch.nn.Parameter(torch.ones(4, device=dev))
        opt = torch.optim.SGD([param], lr=0.1)
        scaler = amp_backends.GradScaler(be, process_group="world")
        skipped = []
        for step in range(3):
            scaler.scale((param * 2).sum()).backward()
            if rank == 1 and step == 1:
                param.grad[0] = math.nan
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            skipped.append(scaler.last_step_skipped)
        Path(out, f"{rank}").write_text(repr(skipped))
    finally:
        amp_backends.distributed.destroy_process_group()


def _join(ranks: object, outputs: list[Path], deadline_s: float = 180.0, grace_s: float = 15.0) -> None:
    """Wait for the ranks; a rank that raised fails the test. Ranks are judged by what they wrote:
    one that wrote its result but hangs while tearing the process group down (seen with some
    torch releases and Gloo) is ended after ``grace_s`` instead of hanging the suite."""
    start = time.monotonic()
    written_at = None
    while not ranks.join(timeout=1):  # type: ignore[attr-defined]  # torch's spawn context, untyped
        now = time.monotonic()
        if written_at is None and all(p.exists() for p in outputs):
            written_at = now
        if (written_at is not None and now - written_at > grace_s) or now - start > deadline_s:
            for proc in ranks.processes:  # type: ignore[attr-defined]  # torch's spawn context, untyped
                if proc.is_alive():
                    proc.kill()
            if written_at is None:
                pytest.fail(f"the ranks wrote no result within {deadline_s:g} s")
            return


def test_distributed_found_inf_agreement(backend):
    if not dist.is_available() or not dist.is_backend_available(backend.dist_backend):
        pytest.skip(f"distributed backend {backend.dist_backend!r} is not available in this torch")
    if backend.device_type != "cpu":
        count = getattr(getattr(torch, backend.device_type, None), "device_count", lambda: 0)()
        if count < 2:
            pytest.skip(f"needs 2 {backend.device_type} devices for 2 ranks, found {count}")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        ranks = mp.spawn(_rank, args=(2, init, backend.name, tmp), nprocs=2, join=False)
        _join(ranks, [Path(tmp, str(r)) for r in range(2)])
        results = [Path(tmp, str(r)).read_text() for r in range(2)]
    assert results[0] == results[1] == repr([False, True, False])
