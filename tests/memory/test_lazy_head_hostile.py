"""The LM-head lever (lazy logits, the fused linear-cross-entropy) under a hostile review's uses, each
against plain torch doing the same: lazy logits read after a fused optimizer's step (which moves no
version counter) are refused, while a step that does not hold the head leaves them readable; class
weights whose targets' weights sum to a negative number give torch's loss and gradients, not nan;
forward-mode AD and ``head(input=x)`` work as on the plain head; the block size counts what torch's
caching allocator holds unused as free (no accelerator needed: the device's answers are stood in for)."""

from __future__ import annotations

import copy
import math
import types
import warnings
from collections.abc import Callable, Iterable

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn

from amp_backends.memory import chunked_loss, fused_loss
from amp_backends.memory.chunked_loss import LazyHeadError, LazyLogits, lazy_head
from amp_backends.memory.fused_loss import BLOCK_BYTES_MAX, FREE_SHARE, block_bytes, chunk_rows, linear_cross_entropy

N, H, V = 40, 16, 50  # rows, width, vocabulary: tiny, several blocks at rows=8
MiB, GiB = 2**20, 2**30


@pytest.fixture(autouse=True)
def _warn_afresh() -> None:
    """Lazy logits warn once per op and process: each test sees its own first warnings."""
    chunked_loss._WARNED.clear()


def _ulp32(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 23)


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(H, H), nn.Linear(H, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _pair() -> tuple[_LM, _LM, torch.Tensor, torch.Tensor]:
    """A model, its copy with a lazy head, an input (2, 5, H) and 10 targets."""
    torch.manual_seed(0)
    plain = _LM()
    lazy = copy.deepcopy(plain)
    lazy_head(lazy.head)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, V, (10,), generator=torch.Generator().manual_seed(2))
    return plain, lazy, x, y


# -- a fused optimizer's step makes lazy logits stale --------------------------------------------
FUSED: dict[str, Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]] = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-1, fused=True),
}


def _fused(name: str, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
    """``name`` with fused=True on ``params``; the test skipped where this torch has no fused CPU kernel."""
    probe = torch.zeros(2, requires_grad=True)
    probe.grad = torch.ones(2)
    try:
        FUSED[name]([probe]).step()
    except (RuntimeError, ValueError, TypeError) as exc:
        pytest.skip(f"{name}(fused=True) on the CPU: {exc}")
    return FUSED[name](params)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_lazy_logits_read_after_a_fused_optimizers_step_are_refused(name: str) -> None:
    """Read before the step, lazy logits are the plain ones (bitwise); after a step of a fused
    optimizer holding the head (its kernel moves no version counter) every read is refused, where it
    used to return the new weights' logits."""
    plain, lazy, x, y = _pair()
    opt = _fused(name, lazy.parameters())
    ref = plain(x).detach()
    logits = lazy(x)
    assert isinstance(logits, LazyLogits)
    assert torch.equal(logits.materialize().detach(), ref), "read before the step: the forward's logits"
    F.cross_entropy(logits.reshape(-1, V), y).backward()
    before = lazy.head.weight.detach().clone()
    opt.step()
    assert not torch.equal(lazy.head.weight, before), "the case: the step moved the head's weight"
    for use in (lambda t: t.materialize(), lambda t: t.argmax(-1), lambda t: t.float().sum(),
                lambda t: F.cross_entropy(t.reshape(-1, V), y)):
        with pytest.raises(LazyHeadError, match="weight or bias changed"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "computed whole": not reached
            use(logits)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_a_fused_step_of_an_optimizer_not_holding_the_head_leaves_lazy_logits_readable(name: str) -> None:
    """A fused optimizer over the body only (the head frozen, or stepped elsewhere): its step changes
    nothing the logits are made of, so they stay readable, bitwise the plain logits of the forward,
    and their loss is the plain one's. (Behaviour the fix keeps: it counts steps per tensor.)"""
    plain, lazy, x, y = _pair()
    opt = _fused(name, lazy.body.parameters())
    ref = plain(x).detach()
    logits = lazy(x)
    F.cross_entropy(logits.reshape(-1, V), y).backward()
    body = lazy.body.weight.detach().clone()
    opt.step()
    assert not torch.equal(lazy.body.weight, body), "the case: the body moved"
    assert torch.equal(logits.materialize().detach(), ref)
    ours = F.cross_entropy(logits.reshape(-1, V), y)
    expected = F.cross_entropy(ref.reshape(-1, V), y)
    assert abs(ours.item() - expected.item()) <= 4 * _ulp32(expected.item())


def test_memory_lean_head_lever_refuses_gpt2_logits_after_a_fused_adamw_step() -> None:
    """Transformers' Trainer's default optimizer, fused AdamW, through memory_lean with only the head
    lever on (float32 weights, no masters between the optimizer and the head): the model's logits
    read after the step are refused; read before it they are the plain model's."""
    transformers = pytest.importorskip("transformers")
    from amp_backends.memory import memory_lean

    cfg = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=H, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(cfg)
    model = copy.deepcopy(plain)
    lean = memory_lean(model, _fused("AdamW", model.parameters()), lm_head="lm_head", saves=False,
                       activations=False, activation_outputs=False, shared_casts=False)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = plain(ids).logits.detach()
    out = model(ids, labels=ids)
    assert isinstance(out.logits, LazyLogits)
    assert torch.equal(out.logits.materialize().detach(), ref)
    out.loss.backward()
    lean.optimizer.step()
    with pytest.raises(LazyHeadError, match="weight or bias changed"):
        out.logits.argmax(-1)
    lean.remove()


# -- class weights summing to a negative number ------------------------------------------------------
def _negative_weights_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input, weight, bias, targets (some ignored) and class weights whose sum over the targets is < 0."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.3
    b = torch.randn(V, generator=g)
    y = torch.randint(0, V, (N,), generator=g)
    y[3::7] = -100
    cw = torch.rand(V, generator=g) + 0.5
    cw[y[0]] = -40.0  # one strongly negative class
    return h, w, b, y, cw


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("path", ["linear_cross_entropy", "lazy head"])
def test_class_weights_summing_to_a_negative_number_give_torchs_loss_and_gradients(path: str, smoothing: float) -> None:
    """A mean over targets whose class weights sum to a negative number: torch divides by it; so does the
    fused loss (it returned nan, loss and every gradient). Loss within 4 float32 ulps, gradients within
    2e-6 of the largest, all finite: the tolerances of tests/memory/test_lean_loss.py."""
    h0, w0, b0, y, cw = _negative_weights_case()
    valid = y != -100
    assert cw[y[valid]].sum() < 0, "the case: the targets' weights sum to a negative number"
    leaves = [t.clone().requires_grad_(True) for t in (h0, w0, b0)]
    h, w, b = leaves
    ref = F.cross_entropy(F.linear(h, w, b), y, weight=cw, label_smoothing=smoothing)
    ref_grads = torch.autograd.grad(ref, leaves)
    ours_leaves = [t.clone().requires_grad_(True) for t in (h0, w0, b0)]
    h, w, b = ours_leaves
    if path == "linear_cross_entropy":
        ours = linear_cross_entropy(h, w, y, b, class_weight=cw, label_smoothing=smoothing, rows=8)
    else:
        head = nn.Linear(H, V)
        head.weight, head.bias = nn.Parameter(w), nn.Parameter(b)
        ours_leaves = [h, head.weight, head.bias]
        lazy_head(head)
        logits = head(h)
        assert isinstance(logits, LazyLogits)
        ours = F.cross_entropy(logits, y, weight=cw, label_smoothing=smoothing)
    ours_grads = torch.autograd.grad(ours, ours_leaves)
    assert math.isfinite(ref.item()) and math.isfinite(ours.item()), (ref.item(), ours.item())
    assert abs(ours.item() - ref.item()) <= 4 * _ulp32(ref.item()), (ours.item(), ref.item())
    for o, r in zip(ours_grads, ref_grads):
        assert o.isfinite().all()
        assert (o - r).abs().max() <= 2e-6 * r.abs().max(), (o - r).abs().max().item()


# -- forward-mode AD and nn.Linear's keyword -----------------------------------------------------------
def test_forward_mode_ad_through_a_lazy_head_is_plain_torchs_jvp() -> None:
    """Under a forward-AD level (make_dual on the input) the head returns plain logits: the logits'
    and the loss's tangents are plain torch's, bitwise (the lever raised torch's NotImplementedError)."""
    plain, lazy, x, y = _pair()
    tangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    results = []
    for model in (plain, lazy):
        with fwAD.dual_level():
            logits = model(fwAD.make_dual(x, tangent))
            loss = F.cross_entropy(logits.reshape(-1, V), y)
            out, dout = fwAD.unpack_dual(logits)
            value, dvalue = fwAD.unpack_dual(loss)
            assert dout is not None and dvalue is not None
            results.append((type(logits), out.detach(), dout.detach(), value.detach(), dvalue.detach()))
    (_, *ref), (kind, *ours) = results
    assert kind is torch.Tensor, "plain logits under forward AD"
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    logits = lazy(x)  # the level closed: lazy again
    assert isinstance(logits, LazyLogits)


def test_head_called_with_the_input_keyword_works_as_positionally() -> None:
    """``head(input=x)``, nn.Linear.forward's own name: the same lazy logits, loss and gradients as
    ``head(x)``, and as the plain head's (it raised TypeError)."""
    plain, lazy, x, y = _pair()
    h = torch.tanh(lazy.body(x)).detach().requires_grad_(True)
    by_name, by_place = lazy.head(input=h), lazy.head(h)
    assert isinstance(by_name, LazyLogits) and by_name.shape == by_place.shape == (2, 5, V)
    ref = plain.head(input=h.detach()).detach()
    assert torch.equal(by_name.materialize().detach(), ref)
    assert torch.equal(by_place.materialize().detach(), ref)
    grads = []
    for logits in (by_name, by_place):
        loss = F.cross_entropy(logits.reshape(-1, V), y)
        grads.append((loss.detach(), torch.autograd.grad(loss, [h, lazy.head.weight, lazy.head.bias])))
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))


# -- the block size: the allocator's cached bytes are free to the loss --------------------------------
def _fake_device_module(reserved: int, allocated: int, free: int | None = None) -> types.SimpleNamespace:
    """A ``torch.<type>`` module's memory queries, answering what they are told (``free``: the driver's)."""
    module = types.SimpleNamespace(memory_reserved=lambda device=None: reserved,
                                   memory_allocated=lambda device=None: allocated)
    if free is not None:
        module.mem_get_info = lambda device=None: (free, 141 * GiB)
    return module


def _no_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.accelerator (where this torch has it) names no accelerator: the device module is asked."""
    if hasattr(torch, "accelerator"):
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)


def _expected(free: int) -> int:
    return max(MiB, min(free // FREE_SHARE, BLOCK_BYTES_MAX))


@pytest.mark.parametrize("asked_through", ["device module", "torch.accelerator"])
def test_the_block_size_counts_what_the_caching_allocator_holds_unused(
        monkeypatch: pytest.MonkeyPatch, asked_through: str) -> None:
    """The driver reports 64 MiB free while torch's caching allocator holds 5 GiB reserved and unused
    (the driver counts those as taken): a block is sized from 64 MiB + 5 GiB, not from 64 MiB (which
    gave a few rows a block on a device with gigabytes to spare). Stood in for on a fake device type
    (``xpu``): asked through its module's mem_get_info, or through torch.accelerator."""
    driver_free, reserved, allocated = 64 * MiB, 6 * GiB, 1 * GiB
    device = torch.device("xpu")
    if asked_through == "device module":
        _no_accelerator(monkeypatch)
        monkeypatch.setattr(torch, "xpu", _fake_device_module(reserved, allocated, free=driver_free))
    else:
        if not hasattr(torch, "accelerator"):
            pytest.skip(f"torch {torch.__version__} has no torch.accelerator (the device module is asked)")
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: device)
        monkeypatch.setattr(torch.accelerator, "get_memory_info", lambda d=None: (driver_free, 141 * GiB),
                            raising=False)
        monkeypatch.setattr(torch, "xpu", _fake_device_module(reserved, allocated))
    assert block_bytes(device) == _expected(driver_free + reserved - allocated) > 64 * _expected(driver_free)
    per_row = 50257 * (4 + 2 * 2)  # GPT-2's vocabulary in bfloat16
    assert chunk_rows(50257, device, torch.bfloat16) == _expected(driver_free + reserved - allocated) // per_row
    assert fused_loss._free_bytes(device) == driver_free + reserved - allocated


def test_the_cached_bytes_are_never_negative_and_zero_where_the_module_cannot_say(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """More allocated than reserved (a stale count) adds nothing; a device module without the
    allocator's counts adds nothing; a CPU has no free-memory question (the fixed 64 MiB). Behaviour
    the old code shared: a guard, not a reproducer."""
    device = torch.device("xpu")
    _no_accelerator(monkeypatch)
    monkeypatch.setattr(torch, "xpu", _fake_device_module(reserved=1 * GiB, allocated=2 * GiB, free=64 * MiB))
    assert block_bytes(device) == _expected(64 * MiB)
    monkeypatch.setattr(torch, "xpu", types.SimpleNamespace(mem_get_info=lambda device=None: (64 * MiB, GiB)))
    assert block_bytes(device) == _expected(64 * MiB)
    assert block_bytes("cpu") == 64 * MiB


def test_a_step_that_leaves_a_frozen_head_alone_leaves_its_lazy_logits_readable() -> None:
    """A frozen head (no gradient) handed to a fused optimizer with the rest: its step moves nothing of
    the head, so the lazy logits stay readable, bitwise the plain head's; the step hook goes with the
    last lazy logits."""
    plain, lazy, x, _ = _pair()
    for model in (plain, lazy):
        model.head.requires_grad_(False)
    opt = _fused("AdamW", lazy.parameters())
    logits = lazy(x)
    assert isinstance(logits, LazyLogits)
    logits.float().sum().backward()
    opt.step()
    assert lazy.head.weight.grad is None
    with torch.no_grad():
        expected = plain(x)  # the weights the forward saw (the body has moved since: not read again)
    assert torch.equal(logits.materialize(), expected)
    del logits
    assert not chunked_loss._LIVE and not chunked_loss._STEP_HOOK
