"""timm's loss-scaler calling convention, against its documented protocol.

timm (which imports torchvision) cannot be installed beside the CPU torch wheel used here: PyPI's
torchvision fails to load its operators with it. So the reference below is timm's
``NativeScaler`` as documented (``timm/utils/cuda.py``: scale+backward, then on ``need_update``
unscale, clip, step, update), on ``torch.amp.GradScaler``, driven exactly as timm's train
loop drives a ``loss_scaler``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from amp_backends import PerformanceWarning
from amp_backends.integrations.timm import NativeScaler


class TimmProtocolReference:
    """timm.utils.NativeScaler's documented behaviour, on torch's own scaler."""

    state_dict_key = "amp_scaler"

    def __init__(self, **kw):
        self._scaler = torch.amp.GradScaler(device="cpu", **kw)

    def __call__(self, loss, optimizer, clip_grad=None, clip_mode="norm", parameters=None, create_graph=False,
                 need_update=True):
        self._scaler.scale(loss).backward(create_graph=create_graph)
        if need_update:
            if clip_grad is not None:
                self._scaler.unscale_(optimizer)
                if clip_mode == "norm":
                    torch.nn.utils.clip_grad_norm_(parameters, clip_grad)
                else:
                    torch.nn.utils.clip_grad_value_(parameters, clip_grad)
            self._scaler.step(optimizer)
            self._scaler.update()

    def state_dict(self):
        return self._scaler.state_dict()


def _train(loss_scaler, clip_mode="norm", steps=8, accum=2, inject=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for micro in range(accum):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) / accum
            if step == inject and micro == accum - 1:
                loss = loss * math.inf
            need_update = micro == accum - 1
            loss_scaler(loss, opt, clip_grad=0.3, clip_mode=clip_mode, parameters=model.parameters(),
                        need_update=need_update)
            if need_update:
                opt.zero_grad()
    return [p.detach() for p in model.parameters()], loss_scaler.state_dict()


@pytest.mark.parametrize("clip_mode", ["norm", "value"])
def test_native_scaler_is_bitwise_timms_protocol(clip_mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        ours = NativeScaler("cpu", torch.float16, init_scale=2.0**10, growth_interval=3)
        params, state = _train(ours, clip_mode)
    ref_params, ref_state = _train(TimmProtocolReference(init_scale=2.0**10, growth_interval=3), clip_mode)
    assert state == ref_state and all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert ours.stats.skipped == 1 and ours.stats.steps == 7, "the inf step skipped, the rest stepped"
    assert NativeScaler.state_dict_key == TimmProtocolReference.state_dict_key == "amp_scaler"


def test_state_round_trip_and_bad_calls():
    scaler = NativeScaler("cpu", torch.float16, init_scale=64.0)
    fresh = NativeScaler("cpu", torch.float16)
    fresh.load_state_dict(scaler.state_dict())
    assert fresh.state_dict() == scaler.state_dict() and fresh.scaler.get_scale() == 64.0
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.ones(1, 2)).sum()
    with pytest.raises(ValueError, match="clip_mode must be one of norm, value, agc"):
        scaler(loss, opt, clip_grad=1.0, clip_mode="l2", parameters=model.parameters())
    with pytest.raises(ValueError, match="pass parameters="):
        scaler(loss, opt, clip_grad=1.0)


def test_bf16_scaler_is_free_and_can_guard_against_inf():
    scaler = NativeScaler("cpu", torch.bfloat16, check_finite=True)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    scaler(model(torch.ones(1, 2)).sum() * math.inf, opt)
    assert not scaler.scaler.is_enabled() and scaler.last_step_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_checkpoint_resume_continues_identically():
    """timm's train script saves model, optimizer and checkpoint[loss_scaler.state_dict_key]."""

    def run(resume_from=None, steps=6, save_at=3):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = NativeScaler("cpu", torch.float16, init_scale=2.0**10, growth_interval=2)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(steps)]
        start, saved = 0, None
        if resume_from is not None:
            model.load_state_dict(resume_from["model"])
            opt.load_state_dict(resume_from["optimizer"])
            scaler.load_state_dict(resume_from[scaler.state_dict_key])
            start = save_at
        for step in range(start, steps):
            x, y = data[step]
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) * (math.inf if step == 1 else 1.0)
            scaler(loss, opt, clip_grad=0.5, parameters=model.parameters())
            opt.zero_grad()
            if step + 1 == save_at:
                saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                         "optimizer": opt.state_dict(), scaler.state_dict_key: scaler.state_dict()}
        return [p.detach() for p in model.parameters()], scaler.state_dict(), saved

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        params, state, saved = run()
        assert saved["amp_scaler"]["scale"] == 2.0**9, "the skipped step's back-off is in the checkpoint"
        params2, state2, _ = run(resume_from=saved)
    assert state2 == state and all(torch.equal(a, b) for a, b in zip(params, params2))
