"""The memory ledger against independent counts, and memory-lean mixed precision against plain autocast,
torch's own optimizer and the float32 model."""

from __future__ import annotations

import copy
import gc
import importlib.util
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amp_backends
from amp_backends import torch_private
from amp_backends.memory.chunked_loss import LazyLogits, linear_cross_entropy
from amp_backends.memory.fake import measure
from amp_backends.memory.lean import LeanError, memory_lean
from amp_backends.memory.ledger import Ledger
from amp_backends.memory.master import MasterWeights
from amp_backends.memory.saves import _Fp32SavingLow, _group_norm, _layer_norm, _log_softmax, _softmax

TORCHAO = importlib.util.find_spec("torchao") is not None and torch.__version__ >= "2.5"


def _mlp(width=128):
    return nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.LayerNorm(width), nn.Linear(width, 10))


def _allocator_peak_of_second_step(amp: bool, batch: int):
    """The ledger of a step and the CPU allocator's own count of the same step (torch's profiler with
    profile_memory: every allocation and free the allocator makes, whatever the dispatcher sees): its peak
    of the memory that outlives the op allocating it, its peak of everything, and the most one op call
    took as its own workspace (allocated and freed inside that call: oneDNN's scratch pads for a bf16
    matmul, whose size depends on the CPU's kernels, AMX's larger than AVX-512's; no op returns them)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))

        def step(ledger: Ledger) -> None:
            opt.zero_grad(set_to_none=True)
            with ledger.phase("forward"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(model(x).float(), y)
            with ledger.phase("backward"):
                loss.backward()
            with ledger.phase("optimizer"):
                opt.step()

        step(Ledger())
        gc.collect()
        params = list(model.parameters())
        state = [v for s in opt.state.values() for v in s.values()]
        ledger = Ledger()
        ledger.register([x, y, *state, *[p.grad for p in params]], params=params)
        with record_function("second step"):
            pass
        with ledger:
            step(ledger)
    report = ledger.report(params=params, grads=[p.grad for p in params], optimizer=state)
    return ledger, report, _allocator_peaks(prof, "second step"), params, state


def _allocator_peaks(prof, marker: str | None = None) -> tuple[int, int, int]:
    """From a profile with ``profile_memory``: the allocator's peak of the memory that outlives the op
    allocating it, its peak of everything, and the most one op call took as its own workspace, after
    the ``record_function`` named ``marker`` (or over the whole profile)."""
    from torch._C._profiler import _EventType

    events, start = [], None if marker is not None else -1
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation:
            events.append(e)
        if e.name == marker:
            start = e.start_time_ns
        stack.extend(e.children)
    events.sort(key=lambda e: e.start_time_ns)
    made: dict[int, object] = {}
    workspace: set[int] = set()  # the ids of the allocation and free events of an op call's own workspace
    by_call: dict[int, int] = {}
    for e in events:
        if e.extra_fields.alloc_size > 0:
            made[e.extra_fields.ptr] = e
            continue
        allocated = made.pop(e.extra_fields.ptr, None)
        op = None if allocated is None else allocated.parent
        if op is not None and op.name.startswith("aten::") and e.parent is not None and e.parent.id == op.id:
            workspace.update((allocated.id, e.id))
            by_call[op.id] = by_call.get(op.id, 0) + allocated.extra_fields.alloc_size
    level = level_all = peak = peak_all = 0
    for e in events:
        size = e.extra_fields.alloc_size
        level_all += size
        if e.id not in workspace:
            level += size
        if e.start_time_ns > start:
            peak, peak_all = max(peak, level), max(peak_all, level_all)
    return peak, peak_all, max(by_call.values(), default=0)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch", [32, 2048])
def test_the_ledger_peak_is_the_allocators_and_its_parts_the_tensors_counted_directly(amp, batch):
    ledger, report, (allocator_peak, with_workspace, workspace), params, state = _allocator_peak_of_second_step(
        amp, batch)
    # the allocator also makes a few scalar tensors no op returns (Python numbers wrapped by the optimizer's
    # arithmetic): tens of bytes
    assert 0 <= allocator_peak - report.peak <= 64, (report.peak, allocator_peak)
    # an op's own workspace (oneDNN's bf16 scratch pads) is no tensor: the ledger counts the tensors, and the
    # allocator's whole peak exceeds it by at most one op call's workspace (one op runs at a time)
    assert 0 <= with_workspace - report.peak <= workspace + 64, (report.peak, with_workspace, workspace)
    assert report.peak == ledger.peak == sum(report.parts.values())
    assert report.parts["parameters"] == sum(p.numel() * p.element_size() for p in params)
    assert report.parts["optimizer"] == sum(t.numel() * t.element_size() for t in state)
    if report.phase == "optimizer":  # the gradients are all alive then
        assert report.parts["gradients"] == sum(p.grad.numel() * p.grad.element_size() for p in params)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
@pytest.mark.parametrize("name", ["hf-gpt2", "hf-bert"])
def test_transformers_models_ledger_is_the_cpu_allocators_in_every_mode(name):
    """Transformers' GPT2LMHeadModel (its own loss through labels=) and BertForSequenceClassification, as
    the bench builds them (small size, dropout 0.1), one real training step in each mode the memory
    bench counts: the ledger's peak against the CPU allocator's own (torch's profiler; the whole run,
    so the ledger's last step must be where the allocator peaked), to the few bytes of scalars the
    optimizer wraps, but for the workspace one op call takes and frees inside itself (oneDNN's scratch
    for a bf16 matmul, which no op returns and whose size depends on the CPU's kernels); and the same
    step counted on fake tensors gives the same peak but for a fake kernel's dtypes (the saved
    statistics of a bf16 layer_norm)."""
    from torch.profiler import ProfilerActivity, profile

    from amp_backends.cli.bench_memory import setup_for

    be = amp_backends.get("cpu")
    modes = ["fp32", "amp-bfloat16", "lean-bf16"]
    if torch.__version__ >= "2.5":
        modes.append("lean-bf16-rc")
    for mode in modes:
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            report = measure(setup_for(be, name, "small", 16, mode, fake=False), fake=False)
        allocator, with_workspace, workspace = _allocator_peaks(prof)
        # beyond the scalars: under recomputation the checkpoint keeps the CPU generator's state for each block
        # (torch.get_rng_state(), made by the generator, no op), 2 blocks here
        unseen = 256 + (2 * torch.get_rng_state().numel() if mode.endswith("-rc") else 0)
        assert 0 <= allocator - report.peak <= unseen, (mode, report.peak, allocator)
        assert 0 <= with_workspace - report.peak <= workspace + unseen, (mode, report.peak, with_workspace, workspace)
        fake = measure(setup_for(be, name, "small", 16, mode, fake=True), fake=True)
        # each bf16 layer_norm's mean and rstd: float32 from the CPU kernel, bf16 from the fake one (2 bytes a row
        # each; GPT-2 here: 5 norms x 1,024 rows, 20 KiB of a 99 MiB peak)
        assert abs(fake.peak - report.peak) <= report.peak / 2000, (mode, fake.peak, report.peak)


def _saved_storages(root) -> dict[int, tuple[int, torch.dtype]]:
    """Every tensor the autograd graph under ``root`` saved (its nodes' ``_saved_*`` attributes), by storage."""
    found: dict[int, tuple[int, torch.dtype]] = {}
    # the nodes seen are kept alive: an older torch makes a new Python object for a node on each access, and
    # a freed one's id may come back for another node
    seen: dict[int, object] = {}
    stack = [root.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor):
                        found[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype)
        stack.extend(n for n, _ in node.next_functions)
    return found


def test_activations_are_what_autograd_saves_counted_by_storage():
    """After the forward every saved tensor is alive: the ledger's activations plus autocast's weight
    copies equal the distinct storages the autograd graph's nodes hold (read from the graph itself)."""
    torch.manual_seed(0)
    model, x = _mlp(256), torch.randn(4096, 64)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ledger = Ledger()
    ledger.register([x], params=model.parameters())
    with ledger, ledger.phase("forward"), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x).float().sum()
    report = ledger.report(params=model.parameters())
    graph = {k: v for k, v in _saved_storages(out).items() if k not in params and k != x.untyped_storage().data_ptr()}
    by_dtype: dict[str, int] = {}
    for nbytes, dtype in graph.values():
        by_dtype[str(dtype).replace("torch.", "")] = by_dtype.get(str(dtype).replace("torch.", ""), 0) + nbytes
    linears = [m for m in model if isinstance(m, nn.Linear)]
    weights, biases = (sum(getattr(m, n).numel() * 2 for m in linears) for n in ("weight", "bias"))
    assert report.parts["weight_copies"] == weights + biases, "each parameter's bf16 copy, once (autocast's cache)"
    # a Linear saves its weight's copy where the input's gradient is wanted (not the first layer's here), never the
    # bias's: those stay in autocast's cache, counted as weight copies
    sizes = {m.weight.numel() * 2 for m in linears}
    saved_copies = sum(n for n, d in graph.values() if d == torch.bfloat16 and n in sizes)
    assert 0 < saved_copies < weights
    assert sum(by_dtype.values()) - saved_copies == report.parts["activations"], (by_dtype, report)
    assert by_dtype["float32"] == report.activations_by_dtype["float32"]


@pytest.mark.skipif(torch.__version__ < "2.5", reason="selective recomputation needs torch >= 2.5")
def test_under_selective_recomputation_activations_are_what_the_checkpoint_keeps():
    """Inside blocks under selective recomputation torch's checkpoint takes autograd's saved-tensor hooks
    over and keeps the outputs of the ops its policy saves (the matmuls here) in a cache of its own: the
    ledger counts those as activations, as it counts what autograd saves. Counted directly: each block's
    input (the checkpoint keeps it) and each Linear's output (its addmm's), one storage each, are the
    activations at the forward's end; nothing of them is "other"."""
    from amp_backends.memory.recompute import selective_recompute

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64)) for _ in range(3)]
    model = nn.Sequential(*blocks).train()
    handle = selective_recompute(model, blocks=blocks)
    kept: dict[int, int] = {}
    phase = {"forward": True}

    def hold(module, args, out):  # the forward's own calls only, not the recomputation's in backward
        if phase["forward"]:
            for t in (*args, out) if isinstance(module, nn.Sequential) else (out,):
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    hooks = [m.register_forward_hook(hold) for b in blocks for m in (b, b[0], b[3])]
    x = torch.randn(512, 64, requires_grad=True)
    ledger = Ledger()
    ledger.register([x], params=model.parameters())
    with ledger:
        with ledger.phase("forward"):
            out = model(x)
            loss = out.float().pow(2).mean()
        ledger.restart_peak()
        report = ledger.report(params=model.parameters())  # what is live at the forward's end
        phase["forward"] = False
        with ledger.phase("backward"):
            loss.backward()
    for h in hooks:
        h.remove()
    handle.remove()
    del kept[out.untyped_storage().data_ptr()]  # the last block's output is the loss's input, saved by pow
    kept_bytes = sum(kept.values())
    assert report.parts["activations"] >= kept_bytes > 0
    # beside them autograd saves only pow's input (the model's output) and the mean's scalars: a few bytes more
    assert report.parts["activations"] - kept_bytes <= out.numel() * 4 + 64, (report.parts, kept_bytes)
    assert report.parts["other"] <= 64, "the kept outputs are not counted as other"


def test_a_fake_step_counts_what_a_real_one_allocates():
    """The same bench model's step on fake tensors (no arithmetic) and on real ones: the same peak and parts."""
    from amp_backends.cli.bench_memory import setup_for

    be = amp_backends.get("cpu")
    for mode in ("fp32", "amp-bfloat16", "lean-bf16"):
        fake = measure(setup_for(be, "gpt2-small", "small", 2, mode, fake=True), fake=True)
        real = measure(setup_for(be, "gpt2-small", "small", 2, mode, fake=False), fake=False)
        # exact, but where a fake kernel's output dtype differs from the CPU kernel's (layer_norm's saved
        # statistics of a bfloat16 input: a few KiB)
        assert abs(fake.peak - real.peak) <= 4096, (mode, fake, real)
        assert all(abs(fake.parts[k] - real.parts[k]) <= 4096 for k in fake.parts), (mode, fake, real)


def test_a_full_size_ledger_runs_without_arithmetic_and_lean_meets_the_write_ups_savings():
    """GPT-2 small, BERT-base, ResNet-50 at full size and the bench's batch sizes: counted on fake tensors
    in seconds; the lean modes save what the mixed-precision write-ups report (-51%, -47%, -45%)."""
    from amp_backends.cli.bench_memory import memory_rows

    rows = memory_rows(amp_backends.get("cpu"), ["gpt2-small", "bert-base", "resnet50"],
                       modes=("amp-bfloat16", "lean-bf16", "lean-bf16-sr"))
    saving = {(r["model"], r["mode"]): r["saving_vs_fp32"] for r in rows if r["memory"] is not None}
    assert saving[("gpt2-small", "lean-bf16")] >= 0.51 and saving[("resnet50", "lean-bf16")] >= 0.45
    assert saving[("gpt2-small", "amp-bfloat16")] < 0.25, "plain autocast keeps the float32 logits"
    if TORCHAO:
        assert saving[("gpt2-small", "lean-bf16-sr")] >= 0.51
        assert saving[("bert-base", "lean-bf16-sr")] >= 0.47
        assert saving[("resnet50", "lean-bf16-sr")] >= 0.45
    gpt2 = next(r for r in rows if r["model"] == "gpt2-small" and r["mode"] == "fp32")["memory"]
    assert gpt2["parameters"] == 124_439_808 * 4 and gpt2["optimizer"] == 2 * 124_439_808 * 4 + 148 * 4


# -- the LM head and loss in blocks -------------------------------------------------------------------
def _ulp32(x: float) -> float:
    """The spacing of float32 numbers at ``x``."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 23)


def _head_case(rows=300, width=64, vocab=1000):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, width, generator=g).requires_grad_(True)
    w = (torch.randn(vocab, width, generator=g) * 0.1).requires_grad_(True)
    y = torch.randint(0, vocab, (rows,), generator=g)
    return h, w, y


@pytest.mark.parametrize("rows", [300, 128, 77])
def test_the_loss_in_blocks_equals_the_plain_loss_and_its_input_gradient(rows):
    """The fused loss (gradients made in the forward, the mean's division applied in float32 after the
    matmuls) against the plain bf16 path: the loss to a float32 sum's last bits; the input's gradient within
    2 bf16 eps of the largest and about as close to float64; the weight's gradient, summed in float32, at
    least as close to float64 as the plain path's bf16-rounded one. (The loss recomputed in backward gave a
    bitwise input gradient; tests/memory/test_lean_loss.py holds the fused loss to torch's in every setting.)"""
    h, w, y = _head_case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h, w)
    plain = F.cross_entropy(logits.float(), y)
    ph, pw = torch.autograd.grad(plain, (h, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(h, w, y, rows=rows)
    oh, ow = torch.autograd.grad(ours, (h, w))
    assert abs(ours.item() - plain.item()) <= 2 * _ulp32(plain.item()), "the same loss to a float32 sum's last bits"
    exact_h, exact = torch.autograd.grad(F.cross_entropy(F.linear(h.double(), w.double()), y), (h, w))
    assert (oh - ph).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * ph.abs().max()
    assert (oh.double() - exact_h).norm() <= 2 * (ph.double() - exact_h).norm()
    assert (ow.double() - exact).abs().max() <= (pw.double() - exact).abs().max() * 1.01, \
        "the weight's gradient, summed in float32, is at least as close as the plain path's bf16-rounded one"


def test_a_lazy_head_keeps_the_models_code_and_materializes_only_when_asked():
    h, w, y = _head_case()
    head = nn.Linear(64, 1000, bias=False)
    head.weight.data.copy_(w.detach())
    reference = copy.deepcopy(head)
    amp_backends.memory.chunked_loss.lazy_head(head)
    hidden = h.detach().view(3, 100, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lazy = head(hidden)
        plain = reference(hidden)
    assert isinstance(lazy, LazyLogits) and lazy.shape == plain.shape and lazy.dtype == plain.dtype
    loss = F.cross_entropy(lazy.reshape(-1, 1000).float(), y)
    ref = F.cross_entropy(plain.reshape(-1, 1000).float(), y)
    loss.backward()
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 2 * _ulp32(ref.item())
    assert torch.allclose(head.weight.grad, reference.weight.grad, rtol=0, atol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lazy = head(hidden)
    with pytest.warns(RuntimeWarning, match="computed whole"):
        probs = lazy.softmax(-1)
    assert torch.equal(probs, plain.softmax(-1)), "anything else gets the very logits"


# -- low-precision saves ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["layer_norm", "group_norm", "softmax", "log_softmax"])
def test_a_float32_op_saving_its_low_precision_input_is_bitwise_the_upcast_one(op, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, 4, generator=g).to(dtype).requires_grad_(True)
    weight = torch.randn(8, generator=g).requires_grad_(True)
    bias = torch.randn(8, generator=g).requires_grad_(True)
    fn, params = {"layer_norm": (_layer_norm, (weight[:4], bias[:4], (4,), 1e-5)),
                  "group_norm": (_group_norm, (weight, bias, 2, 1e-5)),
                  "softmax": (_softmax, (-1,)), "log_softmax": (_log_softmax, (-1,))}[op]
    grad = torch.randn(6, 8, 4, generator=g)
    ref = fn(x.float(), *params)  # what a device's autocast does: upcast, compute, save the float32 copy
    ours = _Fp32SavingLow.apply(fn, x, *params)
    leaves = [x, *[p for p in params if isinstance(p, torch.Tensor)]]
    assert torch.equal(ref, ours)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(ref, leaves, grad),
                                                  torch.autograd.grad(ours, leaves, grad)))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _Fp32SavingLow.apply(fn, x, *params)
    assert all(t.dtype != torch.float32 or t.numel() <= 8 for t in saved), "the input is kept in its own dtype"


def test_on_a_cpu_low_precision_saves_change_nothing():
    """CPU autocast runs layer_norm and softmax in the input's dtype already: the lever stands aside."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Softmax(-1))
    ref = copy.deepcopy(model)
    handle = amp_backends.memory.saves.low_precision_saves(model)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(x), ref(x))
    handle.remove()
    assert "forward" not in model[1].__dict__


# -- master weights --------------------------------------------------------------------------------
def test_master_weights_are_torchs_own_update_on_the_float32_gradients():
    """Each step's masters equal torch's AdamW run on float32 copies with the same (bf16, upcast)
    gradients: bitwise. The model's weights are the masters rounded."""
    torch.manual_seed(0)
    model = _mlp()
    ref = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    lean = memory_lean(model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), backend="cpu",
                       weights=torch.bfloat16)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    for _ in range(4):
        lean.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(model(x).float(), y).backward()
        for p, r in zip(model.parameters(), ref):
            r.grad = p.grad.float()
        lean.optimizer.step()
        ref_opt.step()
        masters = [lean._masters.get(p, p) for p in model.parameters()]
        assert all(torch.equal(m, r) for m, r in zip(masters, ref))
        assert all(torch.equal(p, r.to(p.dtype)) for p, r in zip(model.parameters(), ref))
    assert model[2].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16, "norms stay float32"


def _saved(state):
    """``state`` through a file, as a checkpoint goes (torch's load_state_dict keeps the tensors it is given)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_float16_master_weights_under_the_loss_scale_are_torchs_update_on_the_unscaled_gradients():
    """float16 weights, a GradScaler: the scaler checks the float16 gradients and the step divides in float32
    on the masters' gradients; every step equals torch's AdamW on float32 copies with those gradients
    unscaled in float32 (bitwise), an overflowing step moves nothing, and clipping works."""
    torch.manual_seed(0)
    model = _mlp()
    ref = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2)
    lean = memory_lean(model, torch.optim.AdamW(model.parameters(), lr=1e-2), backend="cpu", weights=torch.float16)
    scaler = amp_backends.get("cpu").grad_scaler("float16", init_scale=2.0**10)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    for step in range(4):
        lean.optimizer.zero_grad()
        scale = scaler.get_scale()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x).float(), y) * (math.inf if step == 2 else 1.0)
        scaler.scale(loss).backward()
        inv = torch.full((), scale).double().reciprocal().float()
        grads = [p.grad.float() * inv for p in model.parameters()]
        before = [lean._masters.get(p, p).clone() for p in model.parameters()]
        scaler.step(lean.optimizer)
        scaler.update()
        if step == 2:
            assert scaler.last_step_skipped and all(torch.equal(b, lean._masters.get(p, p))
                                                   for b, p in zip(before, model.parameters()))
            continue
        for r, g in zip(ref, grads):
            r.grad = g
        ref_opt.step()
        assert all(torch.equal(lean._masters.get(p, p), r) for p, r in zip(model.parameters(), ref)), step
        assert all(p.grad is not None and p.grad.dtype == p.dtype for p in model.parameters()), "grads untouched"
    lean.optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        scaler.scale(F.cross_entropy(model(x).float(), y)).backward()
    assert math.isfinite(scaler.clip_grad_norm_(lean.optimizer, 0.1).item())
    scaler.step(lean.optimizer)
    assert not scaler.last_step_skipped


def test_a_lean_checkpoint_loads_into_the_float32_model_and_back():
    torch.manual_seed(0)
    model = _mlp()
    lean = memory_lean(model, torch.optim.AdamW(model.parameters(), lr=1e-2), backend="cpu", weights=torch.bfloat16)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    for _ in range(2):
        lean.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(model(x).float(), y).backward()
        lean.optimizer.step()
    plain = _mlp()
    plain.load_state_dict(_saved(lean.state_dict()))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_opt.load_state_dict(_saved(lean.optimizer.state_dict()))
    assert all(v.dtype == torch.float32 for v in lean.state_dict().values())
    again = _mlp()
    back = memory_lean(again, torch.optim.AdamW(again.parameters(), lr=1e-2), backend="cpu", weights=torch.bfloat16)
    back.load_state_dict(_saved(plain.state_dict()))
    back.optimizer.load_state_dict(_saved(plain_opt.state_dict()))
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), lean.state_dict().values()))
    for opt in (lean.optimizer, back.optimizer):
        opt.zero_grad()
    for m in (model, again):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(m(x).float(), y).backward()
    lean.optimizer.step()
    back.optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters())), "training resumes bitwise"


def test_remove_gives_a_float32_model_with_the_trained_values_and_its_optimizer():
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lean = memory_lean(model, opt, backend="cpu", weights=torch.bfloat16)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    lean.optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.cross_entropy(model(x).float(), y).backward()
    lean.optimizer.step()
    trained = [lean._masters.get(p, p).clone() for p in model.parameters()]
    assert lean.remove() is opt
    assert all(p.dtype == torch.float32 and torch.equal(p, t) for p, t in zip(model.parameters(), trained))
    assert all(p in opt.state for p in model.parameters()), "its state follows the parameters"


def test_bad_lean_settings_are_refused_with_nothing_changed():
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters())
    cases = [
        (dict(weights=torch.bfloat16, master=False), "stochastically"),
        (dict(weights=torch.bfloat16, lm_head="0"), None),
        (dict(lm_head="1"), "nn.Linear"),
        (dict(lm_head="nope"), "no such module"),
        (dict(weights=torch.bfloat16, optimizer=None), "pass the optimizer"),
    ]
    for kwargs, match in cases:
        optimizer = kwargs.pop("optimizer", opt)
        if match is None:
            continue
        with pytest.raises((LeanError, TypeError), match=match):
            memory_lean(model, optimizer, backend="cpu", **kwargs)
        assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in model.state_dict().items())
        assert "forward" not in model[3].__dict__
    other = torch.optim.AdamW(_mlp().parameters())
    with pytest.raises(LeanError, match="not the model's"):
        memory_lean(model, other, backend="cpu", weights=torch.bfloat16)


class _TinyLM(nn.Module):
    """A two-layer causal LM with a tied head, small enough for an emulated-bf16 CPU."""

    def __init__(self, vocab: int = 256, width: int = 32) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1])
        return self.head(self.norm(self.blocks(self.tokens(ids), mask=mask, is_causal=True)))


def _lm_losses(mode: str, steps: int = 80) -> list[float]:
    torch.manual_seed(0)
    model = _TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if mode == "lean":
        opt = memory_lean(model, opt, backend="cpu", weights=torch.bfloat16, lm_head="head").optimizer
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (64, 17), generator=g)
    losses = []
    for i in range(steps):
        batch = data[(i * 8) % 64:(i * 8) % 64 + 8]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "fp32"):
            logits = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, 256).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_lean_loop_trains_as_amp_and_fp32_do():
    """A tiny causal LM, 80 AdamW steps over 8 batches: the lean loss curve (bf16 weights, float32
    masters, the head's loss in blocks) stays within 1% of plain AMP's and of float32's at every tenth step
    (measured: within 0.05%; AMP and float32 differ from each other by as much), and it learns."""
    curves = {mode: _lm_losses(mode) for mode in ("fp32", "amp", "lean")}
    for i in range(9, 80, 10):
        for other in ("amp", "fp32"):
            assert abs(curves["lean"][i] - curves[other][i]) <= 0.01 * curves[other][i], (i, other, curves)
    assert curves["lean"][-1] < 0.8 * curves["lean"][0]


def test_scaler_clip_accumulation_and_the_arena_work_on_a_lean_optimizer():
    torch.manual_seed(0)
    model = _mlp()
    lean = memory_lean(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="cpu", weights=torch.bfloat16)
    ref_model = copy.deepcopy(model)
    amp_backends.flat_grads(lean.optimizer)
    scaler = amp_backends.get("cpu").grad_scaler("bfloat16", check_finite=True)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    for _ in range(2):
        lean.optimizer.zero_grad()
        for half in (x[:8], x[8:]):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                scaler.scale(F.cross_entropy(model(half).float(), y[:8]) / 2).backward()
        norm = scaler.clip_grad_norm_(lean.optimizer, 0.5)
        scaler.step(lean.optimizer)
        scaler.update()
        assert math.isfinite(norm.item()) and not scaler.last_step_skipped
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters())), "it trained"
    assert isinstance(lean.optimizer, MasterWeights)


def test_an_lr_scheduler_and_torch_compile_work_with_the_lean_mode():
    """The lean optimizer's groups are the wrapped optimizer's own (a scheduler's lr reaches the masters'
    update); a compiled model (eager backend) with the lazy head trains as the eager one: inside the
    compiled graph the head returns plain logits, so the losses agree to float32 rounding (the fused loss
    and the plain one differ in the sums' order), not bitwise."""
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = _TinyLM()
        lean = memory_lean(model, torch.optim.AdamW(model.parameters(), lr=3e-3), backend="cpu",
                           weights=torch.bfloat16, lm_head="head")
        sched = torch.optim.lr_scheduler.StepLR(lean.optimizer, step_size=2, gamma=0.1)
        net = torch.compile(model, backend="eager") if compiled else model
        data = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(4):
            lean.optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(net(data[:, :-1]).reshape(-1, 256).float(), data[:, 1:].reshape(-1))
            loss.backward()
            lean.optimizer.step()
            sched.step()
            out.append(loss.item())
        losses[compiled] = out
        assert lean.optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(3e-5)
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


# -- the ledger per module (check_model) ---------------------------------------------------------------------
def test_check_model_says_what_each_module_holds_for_backward_counted_by_hand():
    """Each module's saves after a bf16 forward on the CPU, against the sizes autograd's formulas give for
    this model (each Linear saves its bf16 input, the second also its weight's copy since its input needs a
    gradient; GELU its input; LayerNorm, which the CPU's autocast leaves in the input's dtype, its input and
    two statistics per row); under memory_lean the weights are bf16 and no copy is made, and the LayerNorm's
    input, the GELU's output, is recomputed from the GELU's input (where this torch lets it be)."""
    batch = 32
    model = _mlp(256)
    report = amp_backends.check_model(model, torch.randn(batch, 64), "cpu", torch.bfloat16)
    rows = {r.name: r for r in report.rows}
    ones = torch.ones(256)  # the statistics' dtype as this torch's kernel makes it (float32 weights, bf16 input)
    stats = torch.ops.aten.native_layer_norm(torch.zeros(2, 256, dtype=torch.bfloat16), (256,), ones, ones, 1e-5)[1]
    stat_dtype = str(stats.dtype).replace("torch.", "")
    expected_ln = {"bfloat16": batch * 256 * 2}
    expected_ln[stat_dtype] = expected_ln.get(stat_dtype, 0) + 2 * batch * stats.element_size()
    assert rows["0"].saved == {"bfloat16": batch * 64 * 2} and rows["0"].weight_copies == 0
    assert rows["1"].saved == {"bfloat16": batch * 256 * 2} and rows["1"].weight_copies == 0
    assert rows["2"].saved == expected_ln and rows["2"].weight_copies == 0
    assert rows["3"].saved == {"bfloat16": batch * 256 * 2} and rows["3"].weight_copies == 256 * 10 * 2
    assert rows["3"].lean_held == batch * 256 * 2, "lean: the weight is bf16 itself, no copy held"
    recomputed = batch * 256 * 2 if torch_private.top_saved_tensors_hooks is not None else 0
    assert all(rows[n].lean_held == rows[n].held for n in ("0", "1"))
    assert rows["2"].lean_held == rows["2"].held - recomputed
    assert report.held == sum(r.held for r in report.rows) and report.weight_copies == 256 * 10 * 2
    assert report.lean_held == report.held - 256 * 10 * 2 - recomputed
    assert f"most by 3 ({(batch * 256 * 2 + 256 * 10 * 2) / 1024:.1f} KiB, mostly bfloat16)" in report.summary
    data = report.to_dict()
    assert data["held"] == report.held and {r["name"]: r["held"] for r in data["rows"]}["3"] == rows["3"].held
    assert all(not p.grad_fn and p.dtype == torch.float32 for p in model.parameters()), "the model is untouched"


def test_check_model_memory_can_be_skipped_and_says_why_lean_was_not_measured():
    model = _mlp(32)
    quiet = amp_backends.check_model(model, torch.randn(4, 64), "cpu", torch.bfloat16, memory=False)
    assert quiet.held == 0 and quiet.lean_held is None and "held for backward" not in quiet.summary

    class Uncopyable(nn.Sequential):
        def __deepcopy__(self, memo):
            raise RuntimeError("holds a live handle")

    report = amp_backends.check_model(Uncopyable(*_mlp(32)), torch.randn(4, 64), "cpu", torch.bfloat16)
    assert report.held > 0 and report.lean_held is None
    assert any("could not be copied to measure memory_lean" in n and "holds a live handle" in n for n in report.notes)


def test_a_layer_lean_weights_cannot_run_stays_float32_and_check_model_counts_it():
    """A parameter used by an op outside autocast's lists (mv on the CPU) would meet a float32 vector in
    bf16 and fail: memory_lean keeps a layer it does not know to take low-precision weights in float32
    (saying why), so the lean forward runs and the report counts it; the model is left as it was."""
    class Vec(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(12, 10))

        def forward(self, v: torch.Tensor) -> torch.Tensor:
            return torch.mv(self.w, v).sum()

    model = Vec()
    before = model.w.detach().clone()
    report = amp_backends.check_model(model, torch.randn(10), "cpu", torch.bfloat16, loss_fn=lambda out: out)
    assert report.held > 0 and report.lean_held is not None
    assert model.w.dtype == torch.float32 and torch.equal(model.w, before)
    lean = memory_lean(model, torch.optim.SGD(model.parameters(), lr=0.1), backend="cpu", weights=torch.bfloat16)
    assert model.w.dtype == torch.float32 and "Vec" in lean.kept["w"] and not lean.masters
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(10)).backward()
    lean.optimizer.step()
    assert not torch.equal(model.w, before)
