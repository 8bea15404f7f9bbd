"""The lean mode's LM-head lever and its low-precision saves, against plain torch doing the same by hand:
the fused linear-cross-entropy (gradients made in the forward) against ``F.cross_entropy`` of the whole
float32 logits, its matmuls and live logits counted directly; lazy logits under every use that could
read stale or edited state; second-order gradients through the low-precision saves."""

from __future__ import annotations

import copy
import json
import math
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import amp_backends
from amp_backends.memory import chunked_loss, saves
from amp_backends.memory.chunked_loss import LazyHeadError, LazyLogits, head_lever_refusal, lazy_head, undo_lazy_head
from amp_backends.memory.fused_loss import block_bytes, chunk_rows, linear_cross_entropy
from amp_backends.memory.saves import _Fp32SavingLow, _layer_norm

HERE = Path(__file__).resolve().parents[1]  # tests/: the workers
N, H, V = 40, 16, 50  # rows, width, vocabulary: tiny, several blocks at rows=8


@pytest.fixture(autouse=True)
def _warn_afresh():
    """Lazy logits warn once per op and process: each test sees its own first warnings."""
    chunked_loss._WARNED.clear()


def _ulp32(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(abs(x))) - 23)


def _case(seed: int = 0, bias: bool = True, weighted: bool = False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.3).requires_grad_(True)
    b = torch.randn(V, generator=g).requires_grad_(True) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    y[::7] = -100
    cw = torch.rand(V, generator=g) + 0.5 if weighted else None
    return h, w, b, y, cw


def _leaves(h, w, b):
    return [t for t in (h, w, b) if t is not None]


# -- the fused loss against F.cross_entropy of the whole float32 logits ------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing,weighted", [(0.0, False), (0.1, False), (0.0, True), (0.2, True)])
def test_the_fused_loss_is_cross_entropy_of_the_whole_float32_logits(dtype, reduction, smoothing, weighted):
    """Loss within 4 float32 ulps; in float32 the gradients within 2e-6 of the largest (a few float32 ulps,
    the sums' order); under bf16/fp16 autocast within 2 of the dtype's eps of the plain path's largest
    gradient, and about as close to float64 as the plain path (normwise error at most 2x its over these few rows and
    classes: measured up to 1.7x on the 50-class bias, 1.11x with 200 classes and 64 rows)."""
    h, w, b, y, cw = _case(weighted=weighted)
    kw = dict(weight=cw, label_smoothing=smoothing, reduction=reduction, ignore_index=-100)
    auto = dtype != torch.float32
    with torch.autocast("cpu", dtype=dtype if auto else torch.bfloat16, enabled=auto):
        plain = F.cross_entropy(F.linear(h, w, b).float(), y, **kw)
    pg = torch.autograd.grad(plain, _leaves(h, w, b))
    with torch.autocast("cpu", dtype=dtype if auto else torch.bfloat16, enabled=auto):
        ours = linear_cross_entropy(h, w, y, b, label_smoothing=smoothing, reduction=reduction, class_weight=cw, rows=8)
    og = torch.autograd.grad(ours, _leaves(h, w, b))
    assert ours.dtype == plain.dtype == torch.float32
    assert abs(ours.item() - plain.item()) <= 4 * _ulp32(plain.item())
    exact = torch.autograd.grad(F.cross_entropy(F.linear(h.double(), w.double(), b.double()), y,
                                                weight=None if cw is None else cw.double(), label_smoothing=smoothing,
                                                reduction=reduction), _leaves(h, w, b))
    for o, p, e in zip(og, pg, exact):
        assert o.dtype == p.dtype and o.shape == p.shape
        if not auto:
            assert (o - p).abs().max() <= 2e-6 * p.abs().max()
        else:
            assert (o - p).abs().max() <= 2 * torch.finfo(dtype).eps * p.abs().max()
            assert (o.double() - e).norm() <= 2 * (p.double() - e).norm()


def test_the_block_size_does_not_change_the_loss_beyond_a_float32_sum():
    h, w, b, y, _ = _case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses = [linear_cross_entropy(h, w, y, b, rows=r) for r in (1, 7, N, 1000)]
    grads = [torch.autograd.grad(loss, (h,))[0] for loss in losses]
    assert all(abs(x.item() - losses[0].item()) <= 4 * _ulp32(losses[0].item()) for x in losses)
    assert all(torch.equal(g, grads[0]) for g in grads), "each row's input gradient is its own"


def test_float64_stays_float64():
    h, w, b, y, _ = _case()
    h, w, b = (t.detach().double().requires_grad_(True) for t in (h, w, b))
    plain = F.cross_entropy(F.linear(h, w, b), y, label_smoothing=0.1)
    ours = linear_cross_entropy(h, w, y, b, label_smoothing=0.1, rows=8)
    assert ours.dtype == torch.float64 and abs(ours.item() - plain.item()) <= 1e-13
    for o, p in zip(torch.autograd.grad(ours, (h, w, b)), torch.autograd.grad(plain, (h, w, b))):
        assert o.dtype == torch.float64 and (o - p).abs().max() <= 1e-13


def test_an_all_ignored_mean_is_torchs_nan_with_zero_gradients():
    h, w, b, y, _ = _case()
    y = torch.full_like(y, -100)
    plain = F.cross_entropy(F.linear(h, w, b), y)
    ours = linear_cross_entropy(h, w, y, b, rows=8)
    assert math.isnan(plain.item()) and math.isnan(ours.item())
    for o, p in zip(torch.autograd.grad(ours, (h, w, b)), torch.autograd.grad(plain, (h, w, b))):
        assert torch.equal(o, p)


def test_per_row_losses_and_probability_targets_are_refused_with_the_way_out():
    h, w, b, y, _ = _case()
    with pytest.raises(ValueError, match="reduction='none'"):
        linear_cross_entropy(h, w, y, reduction="none")
    with pytest.raises(ValueError, match="class indices"):
        linear_cross_entropy(h, w, torch.rand(N, V))
    with pytest.raises(ValueError, match="one weight per class"):
        linear_cross_entropy(h, w, y, class_weight=torch.ones(3))
    with pytest.raises(ValueError, match="rows per block"):
        linear_cross_entropy(h, w, y, rows=-2)


def test_the_incoming_gradient_scales_the_stored_ones_and_a_second_backward_is_refused():
    h, w, b, y, _ = _case()
    plain = F.cross_entropy(F.linear(h, w, b), y)
    ours = linear_cross_entropy(h, w, y, b, rows=8)
    for scale in (1.0, 3.0, 65536.0):
        got = torch.autograd.grad(ours * scale, (h, w, b), retain_graph=True)  # retained: the stored grads stay
        ref = torch.autograd.grad(plain * scale, (h, w, b), retain_graph=True)
        assert all((o - r).abs().max() <= 2e-6 * r.abs().max() for o, r in zip(got, ref))
    (gh,) = torch.autograd.grad(ours, (h,), create_graph=True)  # first order under create_graph still works
    assert torch.allclose(gh, torch.autograd.grad(plain, (h,))[0], rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="no second derivative"):
        gh.pow(2).sum().backward()


def test_float16_gradients_under_a_loss_scale_keep_what_the_scale_keeps():
    """A float16 head with small inputs: the weight's gradient before the scale is below float16's normal
    range. The plain path scales before its float16 matmul; the fused loss holds its gradients in float32
    until the backward brings the scale: its scaled float16 gradient is the plain one's to 2 eps of the
    largest, with no more zeros."""
    h, w, b, y, _ = _case()
    h16 = (h.detach() * 1e-5).half().requires_grad_(True)
    w16, b16 = w.detach().half().requires_grad_(True), b.detach().half().requires_grad_(True)
    scale = 65536.0
    plain = torch.autograd.grad(F.cross_entropy(F.linear(h16, w16, b16).float(), y) * scale, (h16, w16, b16))
    ours = torch.autograd.grad(linear_cross_entropy(h16, w16, y, b16, rows=8) * scale, (h16, w16, b16))
    unscaled = torch.autograd.grad(F.cross_entropy(F.linear(h16, w16, b16).float(), y), (w16,))[0]
    assert (unscaled == 0).sum() > (plain[1] == 0).sum(), "the case: float16 loses these gradients unscaled"
    for o, p in zip(ours, plain):
        assert o.dtype == torch.float16
        assert (o.float() - p.float()).abs().max() <= 2 * torch.finfo(torch.float16).eps * p.float().abs().max()
        assert (o == 0).sum() <= (p == 0).sum()


def test_float16_gradients_of_large_hidden_states_do_not_overflow_before_the_mean_divides():
    """Hidden states of ~10,000: the plain float16 head divides its logit gradient by the 40 rows before its
    weight-gradient matmul and stays in range; the fused loss divides after its matmuls, and a block of 8
    rows' float16 product alone overflows. It multiplies each block's logit gradient by a power of two that
    keeps its float16 products in range: its gradients are finite where the plain ones are, and within 4
    float16 eps (of the largest) of float64's."""
    h, w, b, y, _ = _case()
    h16 = (h.detach() * 1000.0 + 10000.0).half().requires_grad_(True)
    w16, b16 = w.detach().half().requires_grad_(True), b.detach().half().requires_grad_(True)
    y = torch.zeros_like(y)  # every row the same class: the weight's gradient sums, with no cancellation
    block = torch.autograd.grad(F.cross_entropy(F.linear(h16[:8], w16, b16).float(), y[:8], reduction="sum"), (w16,))
    assert not block[0].isfinite().all(), "the case: one block's float16 product before the mean overflows"
    plain = torch.autograd.grad(F.cross_entropy(F.linear(h16, w16, b16).float(), y), (h16, w16, b16))
    ours = torch.autograd.grad(linear_cross_entropy(h16, w16, y, b16, rows=8), (h16, w16, b16))
    exact = torch.autograd.grad(F.cross_entropy(F.linear(h16.double(), w16.double(), b16.double()), y),
                                (h16, w16, b16))
    for o, p, e in zip(ours, plain, exact):
        assert p.isfinite().all() and o.isfinite().all()
        assert (o.double() - e).abs().max() <= 4 * torch.finfo(torch.float16).eps * e.abs().max()


def test_without_gradients_the_forward_does_no_gradient_work():
    h, w, b, y, _ = _case()
    with torch.no_grad(), _Count() as count:
        ours = linear_cross_entropy(h, w, y, b, rows=8)
    assert not ours.requires_grad and len(count.matmuls) == math.ceil(N / 8), "the logits' matmul only"
    assert abs(ours.item() - F.cross_entropy(F.linear(h, w, b), y).item()) <= 4 * _ulp32(ours.item())


# -- matmuls and live logits, counted directly -------------------------------------------------------
class _Count(TorchDispatchMode):
    """Every matmul dispatched (name, m*n*k multiply-adds), and the peak bytes of live (rows, V) tensors
    (new storages, not views: the head's weight seen transposed is not logits)."""

    MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "addmv", "mv", "dot"}

    def __init__(self, vocab: int = V) -> None:
        super().__init__()
        self.vocab, self.matmuls, self.live, self.peak = vocab, [], 0, 0
        self.operands: set[torch.dtype] = set()  # the matmuls' operand dtypes
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__.rstrip("_")
        if name in self.MATMULS:
            a, c = args[-2], args[-1]
            self.matmuls.append((name, a.shape[0] * a.shape[1] * c.shape[1]))
            self.operands.update((a.dtype, c.dtype))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[1] == self.vocab and not func.is_view:
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self._seen:
                    continue
                self._seen.add(key)
                size = storage.nbytes()
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_fused_loss_does_the_plain_heads_matmuls_and_holds_one_block_of_logits(dtype):
    """Forward and backward: the plain head does 3 matmuls over all rows; the fused loss 3 per block, the
    same multiply-adds in all, every one on operands of the autocast dtype as the plain head's (under
    float16 too: a float32 matmul runs without a GPU's tensor cores); the live (rows, V) tensors peak at
    one block's working set (V * (4 + 2 * itemsize) bytes a row), where the plain path holds all rows'
    float32 logits."""
    h, w, b, y, _ = _case()
    rows = 8
    auto = dtype != torch.float32
    with _Count() as plain:
        with torch.autocast("cpu", dtype=dtype if auto else torch.bfloat16, enabled=auto):
            loss = F.cross_entropy(F.linear(h, w, b).float(), y)
        loss.backward()
    with _Count() as ours:
        with torch.autocast("cpu", dtype=dtype if auto else torch.bfloat16, enabled=auto):
            loss = linear_cross_entropy(h, w, y, b, rows=rows)
        loss.backward()
    blocks = math.ceil(N / rows)
    assert len(plain.matmuls) == 3 and len(ours.matmuls) == 3 * blocks
    assert sum(m for _, m in ours.matmuls) == sum(m for _, m in plain.matmuls) == 3 * N * H * V
    assert ours.operands == plain.operands == {dtype}
    itemsize = 2 if auto else 4
    assert ours.peak <= rows * V * (4 + 2 * itemsize), (ours.peak, rows * V)
    assert plain.peak >= N * V * 4


def test_the_block_size_follows_the_budget_and_the_vocabulary():
    assert block_bytes("cpu") == 64 * 2**20
    assert chunk_rows(50257, "cpu", torch.bfloat16) == 64 * 2**20 // (50257 * 8) == 166
    assert chunk_rows(50257, "cpu", torch.float32) == 64 * 2**20 // (50257 * 12)
    assert chunk_rows(10**9) == 1


# -- lazy logits: every hostile use against plain torch doing it by hand -------------------------------
class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(H, H), nn.Linear(H, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _pair():
    torch.manual_seed(0)
    plain = _LM()
    lazy = copy.deepcopy(plain)
    lazy_head(lazy.head)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, V, (10,), generator=torch.Generator().manual_seed(2))
    return plain, lazy, x, y


def test_in_place_edits_of_lazy_logits_are_refused_and_out_of_place_ones_are_exact():
    plain, lazy, x, y = _pair()
    banned = torch.zeros(V, dtype=torch.bool)
    banned[3] = True
    edits = [lambda t: t.__setitem__((..., 3), float("-inf")), lambda t: t.masked_fill_(banned, float("-inf")),
             lambda t: t.div_(0.7), lambda t: t.add_(1.0), lambda t: t.__itruediv__(0.7), lambda t: t.zero_(),
             lambda t: torch.add(torch.ones(2, 5, V), 1.0, out=t)]
    for edit in edits:
        logits = lazy(x)
        with pytest.raises(LazyHeadError, match="in place|out="):
            edit(logits)
    with pytest.warns(RuntimeWarning, match="computed whole"):
        ours = F.cross_entropy((lazy(x).masked_fill(banned, float("-inf")) / 0.7).reshape(-1, V), y)
    ref = F.cross_entropy((plain(x).masked_fill(banned, float("-inf")) / 0.7).reshape(-1, V), y)
    ours.backward()
    ref.backward()
    assert torch.equal(ours, ref)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(lazy.parameters(), plain.parameters()))


def test_logits_read_after_the_weights_or_input_changed_are_refused():
    plain, lazy, x, y = _pair()
    opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    logits, ref = lazy(x), plain(x)
    F.cross_entropy(logits.reshape(-1, V), y).backward()
    F.cross_entropy(ref.reshape(-1, V), y).backward()
    with pytest.warns(RuntimeWarning):
        assert torch.equal(logits.argmax(-1), ref.argmax(-1)), "read before the step: the forward's logits"
    opt.step()
    ref_opt.step()
    with pytest.raises(LazyHeadError, match=r"before optimizer.step\(\)"):
        logits.argmax(-1)
    with pytest.raises(LazyHeadError, match="weight or bias changed"):
        F.cross_entropy(logits.reshape(-1, V), y)
    logits = lazy(x)
    lazy.load_state_dict(plain.state_dict())
    with pytest.raises(LazyHeadError, match="weight or bias changed"):
        logits.softmax(-1)
    logits = lazy(x)
    lazy.head.weight.data = lazy.head.weight.data.clone()  # a new storage, version untouched
    with pytest.raises(LazyHeadError, match="weight or bias changed"):
        logits.max()
    hidden = torch.randn(3, H)
    logits = lazy.head(hidden)
    hidden.mul_(2)
    with pytest.raises(LazyHeadError, match="input"):
        F.cross_entropy(logits, y[:3])


def test_flatten_reshape_and_no_grad_follow_torch():
    plain, lazy, x, y = _pair()
    logits, ref = lazy(x), plain(x)
    with pytest.warns(RuntimeWarning):
        flat = logits.flatten()
    assert flat.shape == ref.flatten().shape == (2 * 5 * V,) and torch.equal(flat, ref.flatten())
    for keep in (logits.flatten(0, 1), logits.flatten(0, -2), logits.reshape(-1, V), logits.view(10, V),
                 torch.reshape(logits, (5, 2, V)), logits.flatten(-1)):
        assert isinstance(keep, LazyLogits), "the vocabulary kept last: still lazy"
    assert logits.flatten(0, 1).shape == ref.flatten(0, 1).shape
    with pytest.warns(RuntimeWarning):
        r = logits.reshape(-1)
    assert r.shape == ref.reshape(-1).shape and torch.equal(r, ref.reshape(-1))
    with torch.no_grad():
        quiet, ref_quiet = lazy(x), plain(x)
    assert quiet.requires_grad is ref_quiet.requires_grad is False
    loss = F.cross_entropy(quiet.reshape(-1, V), y)
    assert loss.requires_grad is F.cross_entropy(ref_quiet.reshape(-1, V), y).requires_grad is False
    assert abs(loss.item() - F.cross_entropy(ref_quiet.reshape(-1, V), y).item()) <= 4 * _ulp32(loss.item())
    assert lazy(x).requires_grad and plain(x).requires_grad


def test_a_compiled_training_step_runs_with_the_lazy_head_as_plain_torch():
    """The whole step compiled (model, loss, backward): the lazy head returns plain logits there, so the
    losses and weights are plain torch's, step for step."""
    results = []
    for lever in (False, True):
        torch.manual_seed(0)
        model = _LM()
        if lever:
            lazy_head(model.head)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        @torch.compile(backend="aot_eager")
        def step(x, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).reshape(-1, V).float(), y)
            loss.backward()
            return loss

        x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(1))
        y = torch.randint(0, V, (10,), generator=torch.Generator().manual_seed(2))
        losses = []
        for _ in range(3):
            opt.zero_grad()
            losses.append(step(x, y).item())
            opt.step()
        results.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def test_heads_whose_gradients_others_watch_are_refused_before_training():
    _, lazy, x, _ = _pair()
    undo_lazy_head(lazy.head)
    assert head_lever_refusal(lazy, lazy.head) is None
    stats = amp_backends.quant_stats(lazy, layers=["head"])
    assert "quant_stats" in head_lever_refusal(lazy, lazy.head)
    with pytest.raises(LazyHeadError, match="quant_stats"):
        lazy_head(lazy.head)
    assert "forward" not in lazy.head.__dict__, "nothing changed"
    stats.remove()
    lazy_head(lazy.head)
    stats = amp_backends.quant_stats(lazy, layers=["head"])  # watching a head already lazy: its forward refuses
    with pytest.raises(LazyHeadError, match="quant_stats"):
        lazy(x)
    stats.remove()
    undo_lazy_head(lazy.head)
    policy = amp_backends.precision_policy(lazy, fp32=["head"])
    assert "precision policy" in head_lever_refusal(lazy, lazy.head)
    with pytest.raises(LazyHeadError, match="precision policy"):
        lazy_head(lazy.head)
    policy.remove()

    class VendorFp8(nn.Linear):
        is_fp8 = True

    with pytest.raises(LazyHeadError, match="fp8"):
        lazy_head(VendorFp8(H, V))


def test_ddp_and_fsdp2_on_two_ranks_refuse_the_lazy_head_and_ddp_takes_the_fused_loss_inside_its_forward(tmp_path):
    from torchrun import TORCH_MINOR as _TORCH, torchrun

    fsdp2 = _TORCH >= (2, 6)  # fully_shard on CPU (gloo) needs torch 2.6+ (tests/distributed/test_distributed.py)
    proc = torchrun(HERE / "lean_head_dist_worker.py", "--out", str(tmp_path), *(["--fsdp2"] if fsdp2 else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["world"] == 2
        assert "torch.distributed runs 2 processes" in r["refusal"] and "lm_head=None" in r["refusal"]
        assert r["forward"] == r["refusal"], "the forward refuses with the same words"
        if fsdp2:
            assert "DTensor (FSDP2)" in r["fsdp2_refusal"] and "torch.distributed runs 2" in r["fsdp2_forward"]
        assert r["fused_vs_plain"] <= 1e-6 and r["head_grad_same_on_ranks"], "the way out: DDP reduces the head"


def test_transformers_gpt2_with_its_own_loss_runs_the_fused_loss_untouched():
    """GPT2LMHeadModel(labels=) as users train it (its loss: .float(), view(-1, V), F.cross_entropy with
    ignore_index and padded labels): with the head lever nothing is computed whole (a warning would be an
    error here), and the loss and gradients are plain torch's to the fused loss's tolerances."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=H, n_layer=1, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(cfg)
    lazy = copy.deepcopy(plain)
    lazy_head(lazy.lm_head)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = lazy(ids, labels=ids).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = plain(ids, labels=ids).loss
    ours.backward()
    ref.backward()
    assert abs(ours.item() - ref.item()) <= 4 * _ulp32(ref.item())
    for a, b in zip(lazy.parameters(), plain.parameters()):
        assert (a.grad - b.grad).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * b.grad.abs().max()


# -- second order through the low-precision saves --------------------------------------------------------
@pytest.mark.parametrize("kind", ["layer_norm", "group_norm", "softmax"])
def test_a_gradient_penalty_through_the_low_precision_saves_is_autocasts_own(kind, monkeypatch):
    """CUDA's autocast answer simulated (the op runs in float32 on an upcast input); the reference is that
    path itself, torch's own double backward. A penalty on the input's gradient reaches the norm's weight
    and bias (the term the first-order-only backward lost: 0)."""
    monkeypatch.setattr(saves, "autocast_runs_in_fp32", lambda *args: True)
    torch.manual_seed(0)
    module = {"layer_norm": nn.LayerNorm(8), "group_norm": nn.GroupNorm(2, 8), "softmax": nn.Softmax(-1)}[kind]
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    reference = copy.deepcopy(module)
    handle = saves.low_precision_saves(module)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(4, 8, generator=g).to(torch.bfloat16)
    upstream = torch.randn(4, 8, generator=g)
    results = []
    for net, lever in ((module, True), (reference, False)):
        x = x0.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=lever):
            out = net(x) if lever else net(x.float())
        assert out.dtype == torch.float32
        (gx,) = torch.autograd.grad((out * upstream).sum(), x, create_graph=True)
        penalty = gx.float().pow(2).sum()
        leaves = [x, *net.parameters()]
        results.append(torch.autograd.grad(penalty, leaves, allow_unused=True))
    handle.remove()
    ours, ref = results
    for a, b in zip(ours, ref):
        assert (a is None and b is None) or torch.equal(a, b)
    if kind != "softmax":
        assert ours[1].abs().sum() > 0, "the second-order term reaches the norm's weight"


def test_the_saves_double_backward_is_the_upcast_ops_own_on_every_input():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, generator=g).to(torch.float16).requires_grad_(True)
    w, b = torch.randn(4, generator=g).requires_grad_(True), torch.randn(4, generator=g).requires_grad_(True)
    up = torch.randn(6, 4, generator=g)
    got = []
    for out in (_Fp32SavingLow.apply(_layer_norm, x, w, b, (4,), 1e-5), _layer_norm(x.float(), w, b, (4,), 1e-5)):
        gx, gw = torch.autograd.grad((out * up).sum(), (x, w), create_graph=True)
        got.append(torch.autograd.grad(gx.float().pow(2).sum() + gw.pow(3).sum(), (x, w, b), allow_unused=True))
    assert got[0][2] is got[1][2] is None, "the bias reaches neither gradient"
    assert all(torch.equal(a, c) for a, c in zip(got[0][:2], got[1][:2]))


# -- hostile uses of lazy logits: each either computes what plain logits would, or is refused -----------
class _Half(torch.autograd.Function):
    """Identity forward, the gradient halved (a gradient-reversal layer's shape)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return 0.5 * g


def test_logits_through_an_autograd_function_are_refused_at_the_backward_instead_of_losing_the_gradient():
    """A custom Function, or a full backward hook on the whole model, between the logits and the loss: the
    Function would hand its gradient to logits that never pass it on (the head and everything below it
    would get none). The backward raises instead, saying why; the plain model trains."""
    plain, lazy, x, y = _pair()
    F.cross_entropy(_Half.apply(plain(x)).reshape(-1, V), y).backward()
    assert all(p.grad is not None for p in plain.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        loss = F.cross_entropy(_Half.apply(lazy(x)).reshape(-1, V), y)
    with pytest.raises(LazyHeadError, match="autograd Function"):
        loss.backward()
    assert all(p.grad is None for p in lazy.parameters()), "nothing half-trained"

    plain, lazy, x, y = _pair()
    for model in (plain, lazy):
        model.register_full_backward_hook(lambda module, grad_in, grad_out: None)
    F.cross_entropy(plain(x).reshape(-1, V), y).backward()
    assert all(p.grad is not None for p in plain.parameters())
    with pytest.raises(LazyHeadError, match="autograd Function"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        F.cross_entropy(lazy(x).reshape(-1, V), y).backward()


def test_a_reentrant_checkpoint_of_the_head_is_refused_and_a_backward_hook_on_it_gets_plain_logits():
    """torch.utils.checkpoint(head, h, use_reentrant=True) runs the head without grad inside an autograd
    Function: refused at the loss (the head's gradient would be lost), with the head's loss alone or
    beside another. A full backward hook on the head itself is handed the logits' gradient, which lazy
    logits never make: the head returns plain logits there (a warning says the lever stood aside), and
    the hook sees what it sees without the lever, bitwise."""
    from torch.utils.checkpoint import checkpoint

    plain, lazy, x, y = _pair()
    for extra in (False, True):
        h = torch.tanh(lazy.body(x))
        logits = checkpoint(lazy.head, h, use_reentrant=True)
        with pytest.raises(LazyHeadError, match="autograd Function returned them"):
            F.cross_entropy(logits.reshape(-1, V), y) + (h.square().mean() if extra else 0.0)

    plain, lazy, x, y = _pair()
    seen: dict[str, list[torch.Tensor]] = {"plain": [], "lazy": []}
    for name, model in (("plain", plain), ("lazy", lazy)):
        model.head.register_full_backward_hook(lambda m, gi, go, name=name: seen[name].append(go[0].clone()))
    with pytest.warns(amp_backends.PerformanceWarning, match="backward hook"):
        logits = lazy(x)
    assert type(logits) is torch.Tensor
    for model, out in ((plain, plain(x)), (lazy, logits)):
        F.cross_entropy(out.reshape(-1, V), y).backward()
    assert len(seen["lazy"]) == len(seen["plain"]) == 1 and torch.equal(seen["lazy"][0], seen["plain"][0])
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(lazy.parameters(), plain.parameters()))


def test_gradient_hooks_retain_grad_and_autograd_grad_on_lazy_logits_are_refused():
    """Each would see a gradient lazy logits never have (the plain ones' hook would change or read it)."""
    _, lazy, x, y = _pair()
    for use in (lambda t: t.register_hook(lambda g: g.clamp(-0.01, 0.01)), lambda t: t.retain_grad(),
                lambda t: t.register_post_accumulate_grad_hook(lambda t: None),
                lambda t: torch.autograd.grad(F.cross_entropy(t.reshape(-1, V), y), t),
                lambda t: torch.autograd.grad(F.cross_entropy(t.reshape(-1, V), y), [t, lazy.head.weight])):
        with pytest.raises(LazyHeadError, match="never made"):
            use(lazy(x))


def test_a_compiled_loss_function_handed_lazy_logits_is_the_eager_loss():
    """The user's loss function compiled on its own, given lazy logits: torch.compile does not trace into
    them (a graph break), so it returns the loss, equal to the plain model's, with its gradients."""
    plain, lazy, x, y = _pair()

    @torch.compile(backend="eager")
    def loss_fn(logits, labels):  # type: ignore[no-untyped-def]
        return F.cross_entropy(logits.view(-1, V).float(), labels)

    ref, ours = loss_fn(plain(x), y), loss_fn(lazy(x), y)
    assert ours.shape == ref.shape == () and abs(ours.item() - ref.item()) <= 4 * _ulp32(ref.item())
    ref.backward()
    ours.backward()
    for a, b in zip(lazy.parameters(), plain.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-7)


def test_freshness_is_read_from_the_heads_input_when_a_reshape_copies_it():
    """Sequence-first hidden states (a transposed view): reshaping the logits copies the head's input,
    whose version counter starts again. An edit of the input after the head is still refused, and an
    edit made before the head (so before the logits) is not."""
    plain, lazy, _, _ = _pair()
    y = torch.randint(0, V, (8,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        h = torch.randn(2, 4, H, generator=torch.Generator().manual_seed(1)).transpose(0, 1)
        logits = lazy.head(h)
        h.mul_(3.0)
        with pytest.raises(LazyHeadError, match="input"):
            F.cross_entropy(logits.reshape(-1, V), y)
    base = torch.randn(2, 4, H, generator=torch.Generator().manual_seed(1))
    base += 1.0  # its version moves before the forward
    ours = F.cross_entropy(lazy.head(base.transpose(0, 1)).reshape(-1, V), y)
    ref = F.cross_entropy(plain.head(base.transpose(0, 1)).reshape(-1, V), y)
    assert abs(ours.item() - ref.item()) <= 4 * _ulp32(ref.item())


def test_inference_mode_and_torch_func_run_the_plain_head_bitwise():
    """Under inference_mode (tensors without version counters) and inside torch.func's transforms
    (wrappers without storage) the head returns plain logits: the plain model's results, bitwise."""
    plain, lazy, x, y = _pair()
    with torch.inference_mode():
        ours, ref = lazy(x), plain(x)
    assert type(ours) is torch.Tensor and torch.equal(ours, ref)

    def loss_of(model):  # type: ignore[no-untyped-def]
        params = dict(model.named_parameters())
        return lambda p: F.cross_entropy(torch.func.functional_call(model, p, (x,)).reshape(-1, V), y), params

    (f_ours, p_ours), (f_ref, p_ref) = loss_of(lazy), loss_of(plain)
    g_ours, g_ref = torch.func.grad(f_ours)(p_ours), torch.func.grad(f_ref)(p_ref)
    assert all(torch.equal(g_ours[k], g_ref[k]) for k in g_ref)


def test_lists_of_lazy_logits_tensor_properties_and_requires_grad_follow_plain_logits():
    """torch.cat and torch.stack of lazy logits, .mT, .T and .data compute them whole (equal to the
    plain ones); requires_grad_() as they are changes nothing, and the opposite is refused."""
    plain, lazy, x, _ = _pair()
    ours, ref = lazy(x), plain(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pairs = [(torch.cat([ours, ours]), torch.cat([ref, ref])), (torch.stack([ours]), torch.stack([ref])),
                 (ours.mT, ref.mT), (ours.reshape(-1, V).T, ref.reshape(-1, V).T), (ours.data, ref.data)]
    for a, b in pairs:
        assert type(a) is torch.Tensor and a.shape == b.shape and torch.equal(a, b)
    assert ours.requires_grad_() is ours and ours.requires_grad
    with pytest.raises(LazyHeadError, match="requires_grad_"):
        ours.requires_grad_(False)


def test_targets_and_class_weights_torch_refuses_or_makes_nan_are_torchs():
    """Class weights that are 0 on every target: torch's mean is nan and so are its gradients (a loss
    scaler skips the step), with smoothing too; the fused loss's as well. int32 targets and a class
    weight that requires grad go to torch's own loss, which says what it does with them."""
    h, w, b, y, _ = _case()
    y = y.clamp(min=0) % 10
    cw = torch.zeros(V)
    cw[10:] = 1.0
    for smoothing in (0.0, 0.1):
        ref = F.cross_entropy(F.linear(h, w, b), y, weight=cw, label_smoothing=smoothing)
        ours = linear_cross_entropy(h, w, y, b, class_weight=cw, label_smoothing=smoothing, rows=8)
        assert math.isnan(ref.item()) and math.isnan(ours.item())
        for o, p in zip(torch.autograd.grad(ours, (h, w, b)), torch.autograd.grad(ref, (h, w, b))):
            assert torch.isnan(p).all() and torch.isnan(o).all()
    plain, lazy, x, y = _pair()
    for kwargs in ({"target": y.int()}, {"target": y, "weight": torch.ones(V, requires_grad=True)}):
        outcomes = []
        for model in (plain, lazy):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    loss = F.cross_entropy(model(x).reshape(-1, V), **kwargs)
                    loss.backward()
                outcomes.append(("ok", loss.item()))
            except Exception as exc:  # noqa: BLE001  # torch's own error, whatever it is: the same on both
                outcomes.append((type(exc).__name__, str(exc)[:60]))
        assert outcomes[0] == outcomes[1], outcomes
