"""A training step's walk through the package: ``GradScaler.step`` goes downward, layer by layer, each
module entered from one place, and the kernel is the one callback into a plugin. Traced with
``sys.setprofile`` on real steps (plain, arena, fused trusted, fused skipped from the host, clipped)."""

from __future__ import annotations

import copy
import gc
import sys
import warnings

import pytest
import torch

import amp_backends
from amp_backends.devices import fused

#: The modules a step may enter, from the top: a call may only go to a module later in this list.
ORDER = [
    "amp_backends.scaler.scaler",
    "amp_backends.scaler.treatment",
    "amp_backends.scaler.steps",
    "amp_backends.scaler.clipping",
    "amp_backends.scaler.gradwork",
    "amp_backends.scaler.consensus",
    "amp_backends.scaler.telemetry",
    "amp_backends.gradients.collect",
    "amp_backends.gradients.arena",
    "amp_backends.gradients.watched",
    "amp_backends.gradients.executor",
    "amp_backends.gradients.kernel",
    "amp_backends.gradients.groups",
    "amp_backends.torch_private",  # the lowest layer: torch's private ops by their recorded names
]


def _walk(make_opt, arena=False, clip=False, backend=None):
    gc.collect()  # lazy logits an earlier test left in a cycle keep the lazy head's hook on every optimizer's step
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = make_opt(model.parameters())
    if arena:
        amp_backends.flat_grads(opt)
    scaler = (backend or amp_backends.get("cpu")).grad_scaler("float16")
    calls: list[tuple[str, str]] = []
    for step in range(3):  # the first step chooses the plan; later ones follow it
        opt.zero_grad()
        scaler.scale(model(torch.randn(3, 4)).float().sum()).backward()
        if clip:
            scaler.clip_grad_norm_(opt, 1.0)

        def profile(frame, event, arg):
            if event != "call":
                return
            callee = frame.f_globals.get("__name__", "")
            caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
            if callee.startswith("amp_backends") and callee != caller and step == 2:
                calls.append((caller, callee))

        sys.setprofile(profile)
        try:
            scaler.step(opt)
        finally:
            sys.setprofile(None)
        scaler.update()
    return calls


def _ignoring_backend():
    be = copy.copy(amp_backends.get("cpu"))
    be.fused_found_inf = {"adamw": (fused.IGNORES, "a stand-in that never reads found_inf")}
    return be


CASES = {
    "sgd": dict(make_opt=lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd, arena": dict(make_opt=lambda p: torch.optim.SGD(p, lr=0.1), arena=True),
    "adamw fused": dict(make_opt=lambda p: torch.optim.AdamW(p, lr=0.1, fused=True)),
    "adamw fused, skipped from the host": dict(make_opt=lambda p: torch.optim.AdamW(p, lr=0.1, fused=True),
                                                backend="ignoring"),
    "adam, clipped, arena": dict(make_opt=lambda p: torch.optim.Adam(p, lr=0.1), arena=True, clip=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_walks_downward_through_each_module_from_one_place(case):
    kwargs = dict(CASES[case])
    if kwargs.get("backend") == "ignoring":
        kwargs["backend"] = _ignoring_backend()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calls = _walk(**kwargs)
    inside = [(a, b) for a, b in calls if a.startswith("amp_backends")]
    assert inside, "the step entered the package"
    unknown = {b for _, b in calls} - set(ORDER)
    assert not unknown, f"a step entered modules outside its path: {unknown}"
    upward = [(a, b) for a, b in inside if ORDER.index(b) <= ORDER.index(a)]
    assert not upward, f"calls that climb back up: {upward}"
    parents: dict[str, set[str]] = {}
    for a, b in inside:
        parents.setdefault(b, set()).add(a)
    shared = {b: p for b, p in parents.items() if len(p) > 1}
    assert not shared, f"modules entered from more than one place: {shared}"
    assert ("amp_backends.gradients.executor", "amp_backends.gradients.kernel") in inside or case.startswith("adam, "), \
        "the kernel runs the op, called by the executor alone"


@pytest.mark.parametrize("arena,clip", [(False, False), (True, False), (True, True)],
                         ids=["per-tensor", "arena", "arena, clipped"])
def test_the_triton_plugins_op_runs_without_calling_back_into_the_core(arena, clip):
    """One float16 step through the Triton kernel (its interpreter on CPU): the executor enters the
    plugin once per (device, dtype) group, and the plugin's op calls nothing of the core package."""
    pytest.importorskip("triton")
    from amp_backends_plugins.triton import TritonKernel

    kernel = TritonKernel()
    kernel.min_elements = 0  # the launch itself, not torch's op for small groups
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.amp_master_weights = True  # float16 gradients are the op's to unscale
    if arena:
        amp_backends.flat_grads(opt)
    scaler = amp_backends.GradScaler("cpu", init_scale=1024.0)
    scaler._grads.kernel = kernel
    calls: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_back is not None:
            callee, caller = frame.f_globals.get("__name__", ""), frame.f_back.f_globals.get("__name__", "")
            if callee != caller and "amp_backends" in callee + caller:
                calls.append((caller, callee))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(2):
            opt.zero_grad()
            scaler.scale(model(torch.randn(3, 4).half()).float().sum()).backward()
            sys.setprofile(profile if step == 1 else None)
            try:
                if clip:
                    scaler.clip_grad_norm_(opt, 1.0)
                scaler.step(opt)
            finally:
                sys.setprofile(None)
            scaler.update()
    plugin = "amp_backends_plugins.triton"
    entered = [(a, b) for a, b in calls if b == plugin and not a.startswith(plugin)]
    assert entered == [("amp_backends.gradients.executor", plugin)], entered
    back = [(a, b) for a, b in calls if a.startswith(plugin) and b.startswith("amp_backends.")]
    assert not back, f"the plugin's op called back into the core: {back}"
    asked = {b for _, b in calls if b.startswith("amp_backends.registry")}
    assert not asked, f"a settled step (its clip too) asks the registry nothing: {asked}"
    assert torch.isfinite(torch.cat([p.detach().float().flatten() for p in model.parameters()])).all()
