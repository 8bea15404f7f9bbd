"""Conformance: availability, dtypes, autocast policy, and the unscale/inf-check op."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import amp_backends
from amp_backends.testing import grad_op_
from ..torch_private import amp_foreach_non_finite_check_and_unscale_


def test_availability_and_reason(backend):
    assert backend.is_available() is True
    assert backend.unavailable_reason() is None
    assert amp_backends.get(backend.name) is backend
    assert backend.name in amp_backends.available()


def test_dtypes(backend):
    supported = backend.supported_dtypes()
    assert supported and supported[0] == backend.default_dtype
    assert set(supported) <= {torch.float16, torch.bfloat16}
    assert isinstance(backend.dist_backend, str)
    if not backend.dist_backend:  # no collectives for the device (mps): refused with the reason
        with pytest.raises(amp_backends.AmpBackendsError, match="no torch.distributed process-group backend"):
            amp_backends.distributed.init_process_group(backend)
    assert backend.device().type == backend.device_type


def test_collective_library_declared(backend):
    """What the process group's library reduces: declared (or a preset for an unambiguous name), naming its
    source, and taking the one form low-precision communication asks for (divide, then SUM) in the
    backend's default dtype or float32."""
    from amp_backends.devices.collectives import Collectives, preset

    if not backend.dist_backend:
        pytest.skip(f"{backend.name} has no process-group backend")
    lib = backend.collectives or preset(backend.dist_backend)
    if lib is None:
        pytest.skip(f"{backend.name}'s {backend.dist_backend!r} library is not declared (collectives = ...)")
    assert isinstance(lib, Collectives) and lib.source
    assert lib.process_group in str(backend.dist_backend).lower() or backend.dist_backend == "ccl"
    assert lib.reduces(torch.float32, "sum")
    assert lib.reduces(backend.default_dtype, "sum") or lib.wire_dtype(backend.default_dtype) == torch.float32


@pytest.mark.parametrize("bad", [torch.float64, torch.int32, "not_a_dtype"])
def test_unsupported_dtype_is_refused_clearly(backend, bad):
    with pytest.raises(amp_backends.UnsupportedDtypeError) as info:
        backend.autocast(bad)
    message = str(info.value)
    assert backend.name in message and str(backend.default_dtype).replace("torch.", "") in message


def _low_dtypes(backend):
    return list(backend.supported_dtypes())


def test_autocast_lowers_matmul_linear_conv(backend):
    dev = backend.device()
    x = torch.randn(4, 8, device=dev)
    w = torch.randn(8, 8, device=dev)
    conv = torch.nn.Conv2d(3, 4, 3).to(dev)
    img = torch.randn(1, 3, 8, 8, device=dev)
    for dtype in _low_dtypes(backend):
        with backend.autocast(dtype):
            assert (x @ w).dtype == dtype
            assert torch.mm(x, w).dtype == dtype
            assert F.linear(x, w).dtype == dtype
            assert conv(img).dtype == dtype


def _module_cases(dev: torch.device) -> list[tuple[torch.nn.Module, tuple]]:
    """Modules whose op the device's lists place, each with inputs; ``None`` stands for the low-precision
    activation (a matmul's output under autocast)."""
    target = torch.zeros(4, dtype=torch.long, device=dev)
    return [
        (torch.nn.Linear(8, 8, device=dev), (None,)), (torch.nn.LayerNorm(8, device=dev), (None,)),
        (torch.nn.GroupNorm(2, 8, device=dev), (None,)), (torch.nn.BatchNorm1d(8, device=dev), (None,)),
        (torch.nn.Softmax(-1), (None,)), (torch.nn.LogSoftmax(-1), (None,)),
        (torch.nn.MSELoss(), (None, torch.randn(4, 8, device=dev))), (torch.nn.CrossEntropyLoss(), (None, target)),
        (torch.nn.BCELoss(), ("probabilities", torch.rand(4, 8, device=dev))),
        (torch.nn.BCEWithLogitsLoss(), (None, torch.rand(4, 8, device=dev))),
    ]


def test_autocast_follows_the_device_lists(backend):
    """Each module runs as the backend's declared lists say (``Device.autocast_lists``): float32 ops
    give float32, lowered ops the autocast dtype, banned ops raise, the rest keep their input's dtype."""
    dev = backend.device()
    lists = backend.autocast_lists
    x = torch.randn(4, 8, device=dev)
    w = torch.randn(8, 8, device=dev)
    for dtype in _low_dtypes(backend):
        for (module, args), given in itertools.product(_module_cases(dev), ("low", "float32")):
            policy = lists.module_policy(module)
            with backend.autocast(dtype):
                low = x @ w
                assert low.dtype == dtype
                act = low if given == "low" else x
                inputs = [act if a is None else act.sigmoid() if a == "probabilities" else a for a in args]
                if policy == "banned":
                    with pytest.raises(RuntimeError):
                        module(*inputs)
                    continue
                out = module(*inputs)
            expected = {"fp32": torch.float32, "lower": dtype}.get(policy, act.dtype)
            assert out.dtype == expected, (
                f"{type(module).__name__} on a {given} input under {backend.name}'s {dtype} autocast gave "
                f"{out.dtype}; the declared lists ({lists.source}) say {policy or 'its input dtype'}")


def test_autocast_nesting_disable_and_decorator(backend):
    dev = backend.device()
    x = torch.randn(4, 4, device=dev)
    low = backend.default_dtype
    with backend.autocast():
        assert (x @ x).dtype == low
        with backend.autocast(enabled=False):
            assert (x @ x).dtype == torch.float32
        assert (x @ x).dtype == low
    assert (x @ x).dtype == torch.float32

    @backend.autocast()
    def forward(a):
        return a @ a

    assert forward(x).dtype == low
    assert (x @ x).dtype == torch.float32


def _grads(backend, seed):
    """Contiguous, transposed, sliced and empty gradients in every supported dtype and fp32."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for dtype in (torch.float32, *backend.supported_dtypes()):
        base = torch.randn(9, 7, generator=g) * 64
        out += [  # each its own memory: .to() of the same dtype would alias base
            base.to(dtype).clone(),
            base.to(dtype).clone().t(),
            base.to(dtype).clone()[1:8:3, ::2],
            torch.empty(0, dtype=dtype),
        ]
    return [t.to(backend.device()) for t in out]


CASES = [(None, "-")] + [(v, w) for v in (math.inf, -math.inf, math.nan) for w in ("first", "last", "middle")]


@pytest.mark.parametrize(("value", "where"), CASES)
def test_unscale_and_check(backend, value, where):
    if backend.global_overflow_status:  # an iteration starts with the status cleared (the scaler's scale() does
        backend.clear_overflow_status()  # it), before its gradients: an earlier test's overflow is not this one's
    grads = _grads(backend, seed=7)
    if value is not None:
        for i in range(0, len(grads), 4):  # one tensor of each dtype group and layout in turn
            target = grads[i + (i // 4) % 3]
            n = target.numel()
            pos = {"first": 0, "last": n - 1, "middle": n // 2}[where]
            target[tuple(int(k) for k in torch.unravel_index(torch.tensor(pos), target.shape))] = value
    expected = [(t.cpu().double() * 0.125).to(t.dtype) for t in grads]
    if value is not None and backend.global_overflow_status:
        # a device-wide status that says overflow leaves the gradients scaled, as the device's op
        # does (op-plugin's NPU kernel returns before unscaling); the step is skipped anyway
        expected = [t.cpu().clone() for t in grads]
    found = torch.zeros((), device=backend.device())
    grad_op_(backend, grads, found, torch.full((), 0.125, device=backend.device()))
    assert found.item() == (0.0 if value is None else 1.0)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("preset", [False, True], ids=["inf-in-the-first-group-only", "found-set-before"])
def test_found_inf_is_only_ever_raised(backend, preset):
    """found_inf is raised, never cleared: an inf in the first dtype group only, or a found_inf an earlier
    call set, is still found after the later, clean groups (an op that copies its own verdict into
    found_inf loses it, and the scaler steps on inf)."""
    if backend.global_overflow_status:
        backend.clear_overflow_status()
    grads = _grads(backend, seed=11)
    if not preset:
        grads[0].view(-1)[0] = math.inf
    found = torch.full((), 1.0 if preset else 0.0, device=backend.device())
    grad_op_(backend, grads, found, torch.full((), 0.125, device=backend.device()))
    assert found.item() == 1.0


def test_declared_op_limits_are_well_formed(backend):
    """The declarative contract: what the device's own ops accept, stated consistently."""
    if backend.unscale_dtypes is not None:
        assert torch.float32 in backend.unscale_dtypes, "float32 gradients are the common case"
    limit = backend.max_tensor_elements
    assert limit is None or (isinstance(limit, int) and limit > 0)
    assert isinstance(backend.has_fp64, bool) and isinstance(backend.global_overflow_status, bool)
    assert backend.built_for_torch is None or isinstance(backend.built_for_torch, str)
    if backend.global_overflow_status:
        backend.clear_overflow_status()  # implemented, as a device declaring the status must
        found = torch.zeros((), device=backend.device())
        backend.read_overflow_status_(found)
        assert found.item() == 0.0, "cleared just now"


@pytest.mark.parametrize("bad", [None, math.inf])
def test_unscale_gradients_of_every_training_dtype(backend, bad):
    """Gradients of float32 parameters, and of parameters kept in each autocast dtype (bf16
    models), unscale to torch's CPU results: a device op that refuses a dtype must say so in
    ``unscale_dtypes`` so the core can route around it."""
    if backend.global_overflow_status:
        pytest.skip("this device reports overflow through its status register, not per tensor")
    dev = backend.device()
    for dtype in {torch.float32, *backend.supported_dtypes()}:
        if dtype == torch.float16:
            continue  # fp16 parameters are refused by every scaler (keep them in fp32)
        ref = [(torch.randn(5, 7) * 64).to(dtype), (torch.randn(7, 5) * 64).to(dtype).t()]
        if bad is not None:
            ref[1][4, 6] = bad
        grads = [g.to(dev) for g in ref]
        found, ref_found = torch.zeros((), device=dev), torch.zeros(())
        inv = torch.tensor(1.0 / 64)
        grad_op_(backend, grads, found, inv.to(dev))
        amp_foreach_non_finite_check_and_unscale_(ref, ref_found, inv)
        assert found.item() == ref_found.item(), dtype
        if bad is None:
            assert all(torch.equal(g.cpu(), r) for g, r in zip(grads, ref)), dtype


def test_scale_runs_the_backends_hook(backend):
    scaler = amp_backends.GradScaler(backend, init_scale=4.0)
    out = scaler.scale(torch.ones((), device=backend.device()))
    assert out.item() == 4.0


# -- device-bug guards: what must hold whatever the device's kernels do -----------------------
#: Finite values across float16's range (normal, tiny, large); each stays finite and non-zero
#: when halved, in float16 and in bfloat16.
_SPREAD = [1.0, -3.5, 0.15625, 2.0**-13, -6.0e-4, 3.0e4, -6.0e4, 1024.0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_unscale_never_zeroes_finite_low_precision_gradients(backend, dtype):
    """Unscaling float16/bfloat16 gradients gives torch's CPU result (the product in float32, cast
    back), never zeros (an MPS unscale once zeroed them: pytorch PR 184286)."""
    if backend.global_overflow_status:
        backend.clear_overflow_status()
    dev = backend.device()
    ref = torch.tensor(_SPREAD, dtype=dtype)
    grads = [ref.clone().to(dev), ref[:5].clone().to(dev)]
    found = torch.zeros((), device=dev)
    grad_op_(backend, grads, found, torch.full((), 0.5, device=dev))
    expected = (ref.float() * 0.5).to(dtype)
    assert found.item() == 0.0
    assert torch.equal(grads[0].cpu(), expected), f"{dtype}: {grads[0].cpu().tolist()} != {expected.tolist()}"
    assert torch.equal(grads[1].cpu(), expected[:5])
    assert bool((grads[0].cpu() != 0).all()), "a finite non-zero gradient became zero"


_FUSED = {
    "adam": lambda params, **kw: torch.optim.Adam(params, lr=0.1, **kw),
    "adamw": lambda params, **kw: torch.optim.AdamW(params, lr=0.1, **kw),
    "sgd": lambda params, **kw: torch.optim.SGD(params, lr=0.1, momentum=0.9, **kw),
    "adagrad": lambda params, **kw: torch.optim.Adagrad(params, lr=0.1, **kw),
}


def _fused_optimizer(kind, params):
    try:
        return _FUSED[kind](params, fused=True)
    except (RuntimeError, ValueError) as exc:
        pytest.skip(f"torch makes no fused {kind} for this device: {exc}")


@pytest.mark.parametrize("kind", list(_FUSED))
def test_fused_kernels_do_what_the_backend_declares(backend, kind):
    """Each fused optimizer kind (Adam, AdamW, SGD, Adagrad), run on the device by the probe: handed
    found_inf = 1, and handed found_inf = 0 with grad_scale = 1024 and the gradient multiplied by it,
    compared with the unfused step on the unscaled gradient. What its kernel really does (it skips and
    divides by grad_scale, skips but never divides, ignores found_inf, refuses it, has no kernel, or
    refuses the optimizer) is what the backend says (``Backend.fused_found_inf``, else probed). A kernel
    that steps although found_inf was set, declared as honouring it, trains on scaled and overflowed
    gradients (op-plugin's _fused_adamw_ on Ascend does exactly that); one that skips but never divides,
    declared as honouring both, trains on gradients multiplied by the loss scale."""
    from amp_backends.devices import fused

    dev = backend.device()
    opt = _fused_optimizer(kind, [torch.nn.Parameter(torch.ones(4, device=dev))])
    said = fused.fused_kernel_of(backend, opt)
    seen = fused.probe(opt, dev)
    if said.status == fused.HONOURS:
        assert seen.status == fused.HONOURS, (
            f"{kind}(fused=True) on {dev}: the backend says its kernel skips on found_inf and divides by grad_scale, "
            f"but it is {seen.status} ({seen.note}): declare {{'{kind}': '{seen.status}'}} in the backend's "
            "fused_found_inf")
    elif said.status == fused.SCALE_BLIND:  # unscaled first, then handed found_inf: it must skip on it
        assert seen.status in (fused.HONOURS, fused.SCALE_BLIND), (
            f"{kind}(fused=True) on {dev}: declared {said.status} (it skips on found_inf), but it is {seen.status} "
            f"({seen.note}): declare {{'{kind}': '{seen.status}'}}")
    elif said.status in (fused.ABSENT, fused.REFUSED):
        assert seen.status in (fused.ABSENT, fused.REFUSED), (
            f"{kind}(fused=True) runs on {dev} ({seen.status}, {seen.note}) though the backend declares it "
            f"{said.status}")
    else:  # the scaler skips from the host: only a kernel that would not skip itself may be declared so
        assert seen.status != fused.ABSENT, f"{kind}(fused=True) has no kernel on {dev}: declare it absent"


def _state_of(opt: torch.optim.Optimizer) -> dict:
    return {(i, k): (v.detach().cpu().clone() if torch.is_tensor(v) else v)
            for i, s in enumerate(opt.state.values()) for k, v in s.items()}


@pytest.mark.parametrize("kind", list(_FUSED))
def test_a_skipped_fused_step_leaves_the_weights_alone(backend, kind):
    """Through the scaler, a step with an inf gradient leaves the weights, and the optimizer's state,
    as they were with every fused optimizer kind the device can run, whatever its kernel does with
    found_inf; the next clean step moves them, exactly as the unfused optimizer (``fused=False,
    foreach=False``) moves a copy of the model through the scaler's plain path: a kernel handed
    grad_scale that never divides by it would step on gradients multiplied by the loss scale."""
    import copy

    from amp_backends.devices import fused

    dev = backend.device()
    model = torch.nn.Linear(4, 2).to(dev)
    twin = copy.deepcopy(model)
    opt = _fused_optimizer(kind, model.parameters())
    if fused.fused_kernel_of(backend, opt).status in (fused.ABSENT, fused.REFUSED):
        pytest.skip(f"{kind}(fused=True) cannot run on {backend.name}: {fused.fused_kernel_of(backend, opt).note}")
    unfused = _FUSED[kind](twin.parameters(), fused=False, foreach=False)
    scaler = amp_backends.GradScaler(backend, init_scale=2.0**8)
    reference = amp_backends.GradScaler(backend, init_scale=2.0**8)
    for poison in (False, True, False, False):
        before = [q.detach().cpu().clone() for q in model.parameters()]
        state = _state_of(opt)
        for m, o, s in ((model, opt, scaler), (twin, unfused, reference)):
            o.zero_grad()
            loss = m(torch.ones(3, 4, device=dev)).float().sum()
            if poison:
                loss = loss * torch.full((), math.inf, device=dev)
            s.scale(loss).backward()
            s.step(o)
            s.update()
        after = [q.detach().cpu() for q in model.parameters()]
        for name, (got, want) in {"the weights": (after, [q.detach().cpu() for q in twin.parameters()]),
                                  "the optimizer's state": (list(_state_of(opt).values()),
                                                            list(_state_of(unfused).values()))}.items():
            for a, b in zip(got, want):
                if torch.is_tensor(a) and a.is_floating_point():
                    torch.testing.assert_close(a.float(), b.float(), rtol=1e-4, atol=1e-6, msg=lambda m, name=name: (
                        f"{kind}(fused=True) through the scaler: {name} differ from the unfused optimizer's ({m}): "
                        f"the kernel is {fused.fused_kernel_of(backend, opt)}"))
        if poison:
            assert scaler.last_step_skipped, "the step with an inf gradient was not skipped"
            assert all(torch.equal(a, b) for a, b in zip(after, before)), (
                f"{kind}(fused=True): the weights moved on a skipped step")
            now = _state_of(opt)
            assert now.keys() == state.keys() and all(
                torch.equal(now[k], state[k]) if torch.is_tensor(state[k]) else now[k] == state[k] for k in state
            ), f"{kind}(fused=True): the optimizer's state changed on a skipped step"
        else:
            assert not scaler.last_step_skipped
            assert not all(torch.equal(a, b) for a, b in zip(after, before)), "a clean step changed nothing"
