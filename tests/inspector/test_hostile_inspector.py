"""The inspector on models that used to fool it: intended infinities (causal masks), uninitialised
memory (dropout's mask), in-place overflow (residuals), loss scales below 1, figures that do not move
monotonically with the scale, and fp8 layers in a float16 check. Each is checked against a direct
computation with torch: the model run in float16 by hand, its non-finite values counted, its
backward scaled by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_backends
from amp_backends import check_model

pytestmark = pytest.mark.filterwarnings("ignore::amp_backends.PerformanceWarning")
FP16 = torch.float16
SCALES = [2.0**k for k in range(-24, 31)]


# -- references by hand ------------------------------------------------------------------------------
def _fp16_loss(model: nn.Module, x: torch.Tensor, loss_fn=lambda out: out.float().mean()) -> torch.Tensor:
    with torch.autocast("cpu", dtype=FP16):
        return loss_fn(model(x))


def _grads(loss: torch.Tensor, params: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    return [g.float() / scale for g in torch.autograd.grad(loss * scale, params, retain_graph=True)]


def _nonfinite(tensors) -> int:
    return sum(int((~torch.isfinite(t)).sum()) for t in tensors)


def _lost(low: list[torch.Tensor], ref: list[torch.Tensor]) -> int:
    return sum(int(((a == 0) & (b != 0)).sum()) for a, b in zip(low, ref))


def _by_hand(model: nn.Module, x: torch.Tensor, loss_fn, ref: list[torch.Tensor]) -> dict[float, tuple[int, int]]:
    """(inf/NaN gradient values, values lost against ``ref``) at every scale, one scaled fp16 backward each."""
    params = [p for p in model.parameters() if p.requires_grad]
    loss = _fp16_loss(model, x, loss_fn)
    out = {}
    for s in SCALES:
        grads = _grads(loss, params, s)
        out[s] = (_nonfinite(grads), _lost(grads, ref))
    return out


def _fp32_grads(model: nn.Module, x: torch.Tensor, loss_fn) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [g.float() for g in torch.autograd.grad(loss_fn(model(x)), params)]


def _best(figures: dict[float, tuple[int, int]]) -> list[float]:
    clean = {s: lost for s, (bad, lost) in figures.items() if not bad}
    return sorted(s for s, lost in clean.items() if lost == min(clean.values()))


# -- 9: infinities the program puts there on purpose ------------------------------------------------
class CausalSelfAttention(nn.Module):
    """nanoGPT's / minGPT's attention: the causal mask written with masked_fill(-inf), then softmax."""

    def __init__(self, d: int = 16, heads: int = 2, t: int = 8) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.heads = heads
        self.register_buffer("bias", torch.tril(torch.ones(t, t)).view(1, 1, t, t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))


class Blow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e5


def test_a_causal_mask_is_no_overflow_and_the_model_can_be_scaled():
    torch.manual_seed(0)
    model, x = CausalSelfAttention(), torch.randn(2, 8, 16)
    report = check_model(model, x, "cpu", FP16)
    loss = _fp16_loss(model, x)
    params = list(model.parameters())
    assert torch.isfinite(loss) and _nonfinite(_grads(loss, params, 2.0**16)) == 0, "finite by hand at 2**16"
    assert report.first_nonfinite_forward is None and report.first_nonfinite_backward is None
    assert not report.beyond_scaling and report.grads_nonfinite == 0 and report.loss_finite
    assert "no loss scale can save" not in report.summary and "best loss scales" in report.summary


def test_a_causal_mask_no_longer_hides_a_real_overflow_after_it():
    torch.manual_seed(1)
    model, x = nn.Sequential(CausalSelfAttention(), Blow()), torch.randn(2, 8, 16)
    with torch.autocast("cpu", dtype=FP16):
        attended = model[0](x)
        expected = int(torch.isinf(attended * 1e5).sum())
    assert torch.isfinite(attended).all() and expected > 0
    with amp_backends.detect_nonfinite(model) as found:
        with torch.autocast("cpu", dtype=FP16):
            loss = model(x).float().mean()
        loss.backward()
    assert (found.forward.module, found.forward.op, found.forward.count) == ("1", "mul", expected), str(found)


class Masked(nn.Module):
    """Scores masked with -inf, then scaled past float16's range: the masked positions carry their -inf
    on, the others overflow (judged element by element)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x)
        mask = torch.ones(8, 8, dtype=torch.bool).triu(1)[: x.shape[0]]
        return scores.masked_fill(mask, float("-inf")) * self.factor


def test_an_overflow_in_a_tensor_that_holds_a_mask_is_judged_per_element():
    torch.manual_seed(2)
    model, x = Masked(2e4), torch.randn(8, 8) * 4
    with torch.autocast("cpu", dtype=FP16):
        masked = model.proj(x).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        expected = int((torch.isinf(masked * 2e4) & torch.isfinite(masked)).sum())
    assert expected > 0 and int(torch.isinf(masked).sum()) == 28, "28 masked positions, some others overflow"
    with amp_backends.detect_nonfinite(model) as found, torch.autocast("cpu", dtype=FP16):
        model(x)
    assert (found.forward.op, found.forward.count) == ("mul", expected), str(found)


class Intended(nn.Module):
    """Every way of writing an inf on purpose: full(-inf) + triu (nn.Transformer's mask), where with a
    scalar -inf, fill_(-inf), each followed by a softmax that turns the -inf into 0."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.proj(x)
        causal = torch.triu(torch.full((8, 8), float("-inf")), diagonal=1)
        a = torch.softmax(s + causal, dim=-1)
        b = torch.softmax(torch.where(causal == 0, s, float("-inf")), dim=-1)
        pad = torch.zeros_like(s).to(s.dtype)
        pad[:, 6:].fill_(float("-inf"))
        c = torch.softmax(s + pad, dim=-1)
        return (a + b + c).float().mean()


def test_infinities_written_on_purpose_are_not_overflows():
    torch.manual_seed(3)
    model, x = Intended(), torch.randn(8, 8)
    loss = _fp16_loss(model, x, lambda out: out)
    assert torch.isfinite(loss) and _nonfinite(_grads(loss, list(model.parameters()), 2.0**16)) == 0
    with amp_backends.detect_nonfinite(model) as found:
        with torch.autocast("cpu", dtype=FP16):
            loss = model(x)
        (loss * 2.0**16).backward()
    assert str(found) == "no inf/NaN in the step"
    report = check_model(model, x, "cpu", FP16, loss_fn=lambda out: out)
    assert report.first_nonfinite_forward is None and not report.beyond_scaling and report.safe_scales


def test_a_nan_made_from_an_intended_inf_is_produced():
    """A row masked entirely: softmax of all -inf is NaN, made by arithmetic (inf - inf)."""
    class FullyMasked(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.zeros(4, 4, dtype=torch.bool)
            mask[2] = True
            return torch.softmax(x.masked_fill(mask, float("-inf")), dim=-1)

    x = torch.randn(4, 4)
    expected = int(torch.isnan(FullyMasked()(x)).sum())
    with amp_backends.detect_nonfinite(FullyMasked()) as found:
        FullyMasked()(x)
    assert expected == 4 and (found.forward.op, found.forward.count) == ("_softmax", expected)


# -- 10: uninitialised memory -----------------------------------------------------------------------
class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


@pytest.mark.parametrize("seed", range(6))
def test_dropout_in_train_mode_is_no_overflow(seed):
    torch.manual_seed(seed)
    model, x = DropoutNet().train(), torch.randn(4, 16)
    rng = torch.get_rng_state()
    report = check_model(model, x, "cpu", FP16)
    torch.set_rng_state(rng)  # the same masks as the check drew
    with amp_backends.detect_nonfinite(model) as found:  # and the training step's watch
        loss = _fp16_loss(model, x)
        grads = _grads(loss, list(model.parameters()), 2.0**16)
    assert torch.isfinite(loss) and _nonfinite(grads) == 0 and str(found) == "no inf/NaN in the step"
    assert report.first_nonfinite_forward is None and report.first_nonfinite_backward is None
    assert not report.beyond_scaling and report.safe_scales is not None


class GarbageDropout(nn.Module):
    """Dropout as torch's CPU kernel does it (empty_like, bernoulli_, div_, mul), with the uninitialised
    mask holding NaN: written where the watch cannot see it, so the run is deterministic."""

    def __init__(self, read_garbage: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.read_garbage = read_garbage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        noise = torch.empty_like(h)
        with torch._C._DisableTorchDispatch():
            noise.fill_(float("nan"))  # what the allocation happened to hold
        if self.read_garbage:
            return h + noise  # computes with it: counted here
        noise.bernoulli_(0.5).div_(0.5)
        return h * noise


def test_uninitialised_memory_counts_only_when_something_computes_with_it():
    x = torch.randn(4, 8)
    with amp_backends.detect_nonfinite(GarbageDropout(read_garbage=False)) as overwritten:
        GarbageDropout(read_garbage=False)(x).sum().backward()
    assert str(overwritten) == "no inf/NaN in the step", "empty_like holds NaN, bernoulli_ overwrote it"
    model = GarbageDropout(read_garbage=True)
    with amp_backends.detect_nonfinite(model) as read:
        out = model(x)
    assert (read.forward.op, read.forward.count) == ("add", int(torch.isnan(out).sum())) and out.isnan().all()


def test_a_tiny_transformers_gpt2_in_train_mode_is_no_overflow():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(4)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (2, 12))
    rng = torch.get_rng_state()
    report = check_model(model, {"input_ids": ids}, "cpu", FP16, loss_fn=lambda out: out.logits.float().mean())
    torch.set_rng_state(rng)
    with torch.autocast("cpu", dtype=FP16):
        loss = model(input_ids=ids).logits.float().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and _nonfinite(_grads(loss, params, 2.0**16)) == 0
    assert report.first_nonfinite_forward is None and not report.beyond_scaling, report.summary


# -- 11: in-place ops ------------------------------------------------------------------------------
class Residual(nn.Module):
    """torchvision's `out += identity`, in float16: each branch is finite, their sum is not."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.branch = nn.Linear(8, 8)
        self.how = how
        with torch.no_grad():
            self.branch.weight.fill_(1.0)
            self.branch.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.branch(x)
        if self.how == "add_":
            out += self.branch(x)
        elif self.how == "mul_":
            out.mul_(2.0)
        else:  # copy_: a float32 value written into a float16 buffer
            out = torch.zeros_like(out).copy_(out.float() * 2)
        return out


@pytest.mark.parametrize("how", ["add_", "mul_", "copy_"])
def test_an_overflow_made_in_place_is_found(how):
    model, x = Residual(how), torch.full((2, 8), 5000.0)
    with torch.autocast("cpu", dtype=FP16):
        branch = model.branch(x)
        out = model(x)
    assert torch.isfinite(branch).all() and out.dtype == FP16
    expected = int(torch.isinf(out).sum())
    assert expected == 16
    with amp_backends.detect_nonfinite(model) as found:
        with torch.autocast("cpu", dtype=FP16):
            model(x).float().sum().backward()
    assert (found.forward.op, found.forward.module, found.forward.count) == (how, "", expected), str(found)
    report = check_model(model, x, "cpu", FP16)
    assert report.first_nonfinite_forward.op == how and report.beyond_scaling and report.loss_finite is False


# -- 12: scales below 1 ----------------------------------------------------------------------------
class Loud(nn.Module):
    """Its weight gradient's column j is 4 * 2**(12 + j) times the scale (j = 0..7): float16 overflows at
    every scale from 2**-5 up (scale 1 included), not at 2**-6 and below, where the scaler trains."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).float().sum() * 2.0**12


def _scalar(out: torch.Tensor) -> torch.Tensor:
    return out


@pytest.mark.filterwarnings("ignore:GradScaler. the loss scale fell")
def test_scales_below_1_are_tried_and_the_verdict_follows():
    model, x = Loud(), (2.0 ** torch.arange(8.0)).expand(4, 8).contiguous()
    report = check_model(model, x, "cpu", FP16, loss_fn=_scalar)
    hand = _by_hand(model, x, _scalar, _fp32_grads(model, x, _scalar))
    assert hand[1.0][0] > 0 and hand[2.0**-6][0] == 0, "overflows at scale 1, not at 2**-6"
    assert report.scales == hand
    assert not report.beyond_scaling and report.best_scales == _best(hand)
    assert report.safe_scales == (2.0**-24, 2.0**-6) and "best loss scales 2**-24..2**-6" in report.summary
    scaler = amp_backends.GradScaler("cpu", init_scale=2.0**16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-12)
    before = model.lin.weight.detach().clone()
    for _ in range(24):
        opt.zero_grad()
        scaler.scale(_fp16_loss(model, x, _scalar)).backward()
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 2.0**-6 and not torch.equal(model.lin.weight, before), "backed off there and stepped"


def test_a_model_beyond_scaling_overflows_at_every_scale():
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # a gradient of 2**60 into the float16 matmul: inf at any scale >= 2**-24, finite in float32
            # (a model float32 cannot train either, sqrt at 0, is not float16's: test_stats_inspector_hostile)
            return self.lin(x).float().sum() * 2.0**60

    model, x = Root(), torch.randn(2, 4)
    report = check_model(model, x, "cpu", FP16)
    loss = _fp16_loss(model, x)
    assert torch.isfinite(loss) and all(_nonfinite(_grads(loss, list(model.parameters()), s)) for s in SCALES[::6])
    assert report.beyond_scaling and report.safe_scales is None and report.loss_finite
    assert all(bad for bad, _ in report.scales.values()) and len(report.scales) == 55
    assert "inf/NaN at every scale from 2**-24 to 2**30" in report.summary


# -- 17: figures that do not move monotonically with the scale --------------------------------------
class DropNonfinite(torch.autograd.Function):
    """Passes the gradient on with inf/NaN replaced by 0: what a layer guarding its backward does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # autograd.Function's forward, typed by torch as Any
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]  # autograd.Function's backward, typed by torch as Any
        return torch.where(torch.isfinite(g), g, torch.zeros_like(g))


class Guarded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        with torch.no_grad():
            self.second.weight.fill_(2.0**8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(DropNonfinite.apply(self.first(x))).float().sum() * 2.0**-12


def test_every_scale_is_measured_and_the_best_chosen_by_the_figures():
    torch.manual_seed(6)
    model, x = Guarded(), torch.randn(4, 8) * 2.0**-6
    report = check_model(model, x, "cpu", FP16, loss_fn=_scalar)
    hand = _by_hand(model, x, _scalar, _fp32_grads(model, x, _scalar))
    # not monotonic: overflow at 2**15 but not at 2**17; nothing lost at 2**0, values lost at 2**20
    assert hand[2.0**15][0] > 0 and hand[2.0**17][0] == 0
    assert hand[1.0] == (0, 0) and hand[2.0**20][1] > 0 and hand[2.0**-20][1] > hand[2.0**-9][1] > 0
    assert report.scales == hand and report.backwards_run == 55
    assert report.best_scales == _best(hand)
    lo, hi = report.safe_scales
    assert all(hand[s] == (0, 0) for s in SCALES if lo <= s <= hi) and (lo, hi) == (2.0**-8, 2.0**14)


# -- 18: fp8 layers in a float16 check ---------------------------------------------------------------
def _lost_masks(low: list[torch.Tensor], ref: list[torch.Tensor]) -> list[torch.Tensor]:
    return [(a == 0) & (b != 0) for a, b in zip(low, ref)]


def test_values_fp8_loses_are_told_from_float16s_by_the_same_model_without_fp8():
    """One Linear trained in fp8 (emulated): a feature 10**-6 times the others is 0 after fp8's tensorwise
    cast, so that column of its weight gradient is 0 at every loss scale. At each scale the fp8 model is
    run against the same model without fp8 (a copy made before the policy, under the same autocast): a
    value lost by both is float16's, a value only the fp8 model loses is fp8's."""
    import copy

    pytest.importorskip("torchao")
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    x = torch.randn(8, 32)
    x[:, 0] = 1e-6

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.float().pow(2).mean() * 2.0**-10

    plain = _fp32_grads(model, x, loss_fn)  # float32, before any fp8
    without = copy.deepcopy(model)  # the same model without fp8
    policy = amp_backends.precision_policy(model, fp32=(), fp8=["0"], emulate=True, backend="cpu")
    try:
        assert list(policy.fp8) == ["0"]
        state, rng = {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()
        report = check_model(model, x, "cpu", FP16, loss_fn=loss_fn)
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items()) and torch.equal(
            torch.get_rng_state(), rng) and all(p.grad is None for p in model.parameters()), "left as it was"
        assert type(model[0]).__name__ == "Fp8Linear", "the model keeps its fp8 layer"
        with_fp8, no_fp8 = _fp16_loss(model, x, loss_fn), _fp16_loss(without, x, loss_fn)
        hand, hand_fp8, at = {}, {}, {}
        for s in SCALES:
            mine = _grads(with_fp8, list(model.parameters()), s)
            theirs = _grads(no_fp8, list(without.parameters()), s)
            lost, kept = _lost_masks(mine, plain), _lost_masks(theirs, plain)
            hand[s] = (_nonfinite(mine), sum(int((m & k).sum()) for m, k in zip(lost, kept)))
            hand_fp8[s] = sum(int((m & ~k).sum()) for m, k in zip(lost, kept))
            at[s] = (lost, kept)
    finally:
        policy.remove()
    assert report.scales == hand and report.scales_lost_fp8 == hand_fp8
    assert report.backwards_run == 55 + 55, "each scale on the fp8 model and on the model without it"
    lost, kept = at[2.0**16]
    assert report.grads_underflow == hand[2.0**16][1] and report.grads_lost_fp8 == hand_fp8[2.0**16]
    assert sum(int(m.sum()) for m in lost) == report.grads_underflow + report.grads_lost_fp8
    clean = [s for s in SCALES if not hand[s][0]]
    assert all(int(at[s][0][0][:, 0].sum()) == 32 for s in clean) and not kept[0][:, 0].any(), \
        "column 0 of the fp8 layer's weight gradient: lost at every scale; the model without fp8 keeps it at 2**16"
    assert report.best_scales == _best(hand) and report.safe_scales[0] == _best(hand)[0]
    rows = {r.name: r for r in report.rows}
    assert rows["0"].grads_lost_fp8 == sum(int((m & ~k).sum()) for m, k in zip(lost[:2], kept[:2])) >= 32
    assert rows["0"].grads_underflow == sum(int((m & k).sum()) for m, k in zip(lost[:2], kept[:2]))
    assert f"{report.grads_lost_fp8} gradient values lost to the fp8 layers at scale 65536, not to float16" \
        in report.summary


def test_a_value_fp8_loses_at_every_scale_is_not_blamed_on_float16():
    """The issue's case: the fp8 model in float16 loses a value at 2**16 that the float32 run keeping the fp8
    layer in fp8 keeps (so a reference of that kind blamed float16), and that the same model without fp8
    keeps at 2**16. It is fp8's: float16's figure there is what the model without fp8 loses too."""
    import copy

    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    x = torch.randn(8, 32)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return out.float().pow(2).mean() * 2.0**-10

    plain = _fp32_grads(model, x, loss_fn)
    without = copy.deepcopy(model)
    policy = amp_backends.precision_policy(model, fp32=(), fp8=["0"], emulate=True, backend="cpu")
    try:
        report = check_model(model, x, "cpu", FP16, loss_fn=loss_fn)
        with torch.autocast("cpu", enabled=False):
            in_fp8 = _fp32_grads(model, x, loss_fn)  # float32 but for the fp8 layer
        mine = _grads(_fp16_loss(model, x, loss_fn), list(model.parameters()), 2.0**16)
    finally:
        policy.remove()
    theirs = _grads(_fp16_loss(without, x, loss_fn), list(without.parameters()), 2.0**16)
    assert _lost(mine, in_fp8) >= 1 and _lost(in_fp8, plain) == 0, "what the older reference blamed on float16"
    assert _lost(theirs, plain) == 0, "the same model without fp8 loses nothing at 2**16"
    assert report.grads_underflow == 0 and report.scales[2.0**16] == (0, 0)
    assert report.grads_lost_fp8 == _lost(mine, plain) >= 1
    assert "lost to float16 at scale" not in report.summary and "not to float16" in report.summary


class BandDrop(torch.autograd.Function):
    """Passes the gradient on with the values of magnitude in [1/2, 2) replaced by 0: a backward whose
    losses depend on the scale in a band, not monotonically."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        band = (g.abs() >= 0.5) & (g.abs() < 2)
        return torch.where(band, torch.zeros_like(g), g)


class Banded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the output's gradient is (2**-10, 2**-3) times the scale: its first column is in the band at
        # 2**9 and 2**10 only, its second at 2**2 and 2**3
        return (BandDrop.apply(self.lin(x)).float() * torch.tensor([2.0**-10, 2.0**-3])).sum()


def test_best_scales_apart_are_each_measured_and_the_gaps_said():
    """The issue's case: the fewest values are lost at 2**8 and from 2**11 up, not at 2**9 and 2**10.
    Every best scale is named, each range stated is measured at every power of two in it, and what the
    scales between the ranges lose is said."""
    from amp_backends.inspector.scales import choose

    figures = {1.0: (0, 2), 2.0: (0, 0), 4.0: (0, 0), 8.0: (3, 0), 16.0: (0, 0), 32.0: (0, 5)}
    assert choose(figures) == ([2.0, 4.0, 16.0], (2.0, 4.0))
    assert choose({1.0: (1, 0), 2.0: (4, 0)}) == ([], None), "every scale overflows"
    assert choose({1.0: (0, 0), 4.0: (0, 0)}) == ([1.0, 4.0], (4.0, 4.0)), "as long: the higher"
    model, x = Banded(), torch.rand(3, 4) + 0.5
    report = check_model(model, x, "cpu", FP16, loss_fn=_scalar)
    hand = _by_hand(model, x, _scalar, _fp32_grads(model, x, _scalar))
    assert hand[2.0**8] == (0, 0) and hand[2.0**9] == hand[2.0**10] == (0, 5) and hand[2.0**11] == (0, 0)
    assert report.scales == hand and report.best_scales == _best(hand)
    best = report.best_scales
    assert 2.0**8 in best and 2.0**11 in best and 2.0**9 not in best and 2.0**10 not in best
    lo, hi = report.safe_scales
    assert all(s in best for s in SCALES if lo <= s <= hi), "every power of two in the range stated is measured best"
    runs, k = [], 0
    while k < len(best):  # the runs of consecutive powers of two, by hand
        j = k
        while j + 1 < len(best) and best[j + 1] == best[j] * 2:
            j += 1
        runs.append((best[k], best[j]))
        k = j + 1
    named = ", ".join(f"2**{int(math.log2(a))}" + ("" if a == b else f"..2**{int(math.log2(b))}") for a, b in runs)
    assert f"best loss scales {named} (0 values lost to float16 at each; between them, measured: " in report.summary
    assert "2**9..2**10 lose 5" in report.summary and len(runs) == 3, "and 2**2..2**3, the second column's band"
