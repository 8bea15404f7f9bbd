"""The saved-tensor levers (``activation_outputs``, ``activation_inputs``, ``dropout_masks``) under
torch's non-reentrant checkpoint, in stacks of MLPs and on tensors that are not plain ones, each against
plain torch doing the same: the same model under ``torch.autocast`` with the same checkpointing, bitwise;
peak bytes counted directly, every storage an op makes tracked until it is freed."""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

import amp_backends
from amp_backends import torch_private
from amp_backends.memory import (memory_lean, pack_dropout_masks, recompute_activation_inputs,
                                 recompute_activation_outputs)

ACTIVE = torch_private.top_saved_tensors_hooks is not None  # (torch 2.4 tells no hooks in force: nothing substituted)
needs_hooks = pytest.mark.skipif(not ACTIVE, reason="this torch cannot tell which saved-tensor hooks are in force")
DTYPES = pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
Result = tuple[torch.Tensor, dict[str, torch.Tensor]]


@pytest.fixture(autouse=True)
def _quiet():  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", amp_backends.PerformanceWarning)
        yield


def _assert_bitwise(a: Result, b: Result) -> None:
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys() and a[1]
    bad = [k for k in a[1] if not torch.equal(a[1][k], b[1][k])]
    assert not bad, f"{len(bad)} of {len(a[1])} gradients differ: {bad}"


def _step(model: nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> Result:
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        out = model(x)
    loss = out.float().pow(2).mean()
    loss.backward()
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad for n, p in model.named_parameters()}


class _SecondConsumer(nn.Module):
    """An MLP whose activation's output (``reuse="a"``) or input (``reuse="h"``) a gated product saves
    again after other saves; ``up`` keeps the width, so that a wrong substitution has the right shape."""

    def __init__(self, reuse: str) -> None:
        super().__init__()
        self.reuse = reuse
        self.up, self.act, self.down, self.gate = nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        a = self.act(h)
        again = a if self.reuse == "a" else h
        return self.down(a) + (again * self.gate(x)).sum(-1, keepdim=True)


class _Checkpointed(nn.Module):
    """Blocks each run under ``checkpoint(use_reentrant=False)``."""

    def __init__(self, make: Callable[[], nn.Module], ckpt: bool = True) -> None:
        super().__init__()
        self.blocks, self.ckpt = nn.ModuleList([make(), make()]), ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return x


def _checkpointed_run(make: Callable[[], nn.Module], lever: Callable[[nn.Module], Any] | None,
                      dtype: torch.dtype | None) -> Result:
    torch.manual_seed(0)
    model = _Checkpointed(make)
    if lever is not None:
        lever(model)
    return _step(model, torch.randn(4, 8), dtype)


@needs_hooks
@DTYPES
@pytest.mark.parametrize(("lever", "reuse"), [(recompute_activation_outputs, "a"), (recompute_activation_inputs, "h")],
                         ids=["outputs-reused", "inputs-reused"])
def test_a_second_consumer_under_a_non_reentrant_checkpoint_gives_the_checkpointed_gradients(
        lever: Callable[[nn.Module], Any], reuse: str, dtype: torch.dtype | None) -> None:
    """The tagged tensor saved a second time after other saves: the scope is done after its consumer in
    the forward and in the checkpoint's recomputation alike (which matches saves by order), so the second
    save stores the tensor itself in both (it stored the source in the recomputation: wrong gradients)."""
    plain = _checkpointed_run(lambda: _SecondConsumer(reuse), None, dtype)
    _assert_bitwise(plain, _checkpointed_run(lambda: _SecondConsumer(reuse), lever, dtype))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))


@needs_hooks
def test_the_inputs_lever_under_a_checkpoint_of_a_float32_stream_in_bf16_gives_the_checkpointed_gradients() -> None:
    """The up-projection's float32 input cast by the lever: its copy, saved by the layer, is dropped by
    the checkpoint in the forward and kept in the recomputation. Held until the activation reads the
    output, it is substituted in both (in the recomputation alone before: another tensor at that place)."""
    plain = _checkpointed_run(_mlp, None, torch.bfloat16)
    _assert_bitwise(plain, _checkpointed_run(_mlp, recompute_activation_inputs, torch.bfloat16))


class _Penalised(nn.Module):
    """A post-norm block whose MLP activations carry an L2 penalty (``pow`` saves the GELU's output)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down, self.ln = nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act(self.up(x))
        return self.ln(x + self.down(a)) + a.pow(2).mean()


@needs_hooks
def test_memory_lean_defaults_under_apply_activation_checkpointing_give_the_checkpointed_gradients() -> None:
    """torch's ``apply_activation_checkpointing`` (non-reentrant) over memory_lean's default levers."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    def run(lean: bool) -> Result:
        torch.manual_seed(0)
        model = _Checkpointed(_Penalised, ckpt=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if lean:
            memory_lean(model, opt)
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, _Penalised))
        return _step(model, torch.randn(4, 6, 16), torch.bfloat16)

    _assert_bitwise(run(False), run(True))


class _GatedMlp(nn.Module):
    """Llama's MLP: ``gate`` and ``up`` read one float32 activation (autocast casts it for each)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down, self.act = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16), nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


class _PreNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(16), _GatedMlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


@needs_hooks
def test_all_levers_under_the_lean_selective_recompute_give_plain_torchs_gradients() -> None:
    """A guard: torch's selective checkpoint of each block's forward recomputes it without the block's
    hooks, so the up-projection's input is held alike whether the owner runs or not (held only where it
    ran, the shared casts made a copy again in the recomputation, and the checkpoint refused it)."""

    def run(lean: bool) -> Result:
        torch.manual_seed(0)
        model = _Checkpointed(_PreNorm, ckpt=False)
        if lean:
            memory_lean(model, recompute=list(model.blocks), activation_inputs=True, dropout_masks=True)
        return _step(model, torch.randn(2, 8, 16), torch.bfloat16)

    _assert_bitwise(run(False), run(True))


class _Peak(TorchDispatchMode):
    """Live bytes of every storage an op makes (until the storage is freed), and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_nested:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def _stack(widths: tuple[int, ...]) -> nn.Sequential:
    """``Linear, GELU, Linear, ..., Linear`` through ``widths`` (a DINO-style head, the bench's ``mlp``)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers[:-1])


@needs_hooks
@pytest.mark.parametrize("widths", [(16, 64, 64, 64, 8), (16, 64, 64, 64, 64, 8), (16, 16, 64, 8)],
                         ids=["equal", "deep", "expanding"])
def test_both_levers_on_a_stack_of_mlps_peak_no_higher_in_the_backward_than_the_outputs_lever_alone(
        widths: tuple[int, ...]) -> None:
    """Each up-projection's input is the GELU's output before it: chained through it, the tags reached
    back to the stack's input and the first backward node remade the whole stack at once (as high as
    no lever). The remakings now chain within one MLP: the backward's peak is no higher than with the
    outputs' lever alone, and the gradients are bitwise the plain stack's."""
    runs: dict[str, tuple[int, Result]] = {}
    for levers in ("none", "outputs", "both"):
        model = _stack(widths)
        if levers != "none":
            recompute_activation_outputs(model)
        if levers == "both":
            recompute_activation_inputs(model)
        x = torch.randn(256, widths[0])
        gc.collect()
        counted = _Peak()
        with counted:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().logsumexp(-1).mean()
            counted.peak = counted.live  # the backward's own peak from here
            loss.backward()
        runs[levers] = (counted.peak, (loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert runs["both"][0] <= runs["outputs"][0] < runs["none"][0], {k: v[0] for k, v in runs.items()}
    _assert_bitwise(runs["none"][1], runs["both"][1])


class _GeluOutputs(TorchDispatchMode):
    """Weak references to the storage of every GELU output made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[weakref.ref[torch.UntypedStorage]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.gelu.default:
            self.made.append(weakref.ref(out.untyped_storage()))
        return out


@needs_hooks
def test_with_both_levers_no_activation_output_outlives_the_forward() -> None:
    """The last linear of a stack is beside a GELU, and is taken for an up-projection: its input (the last
    GELU's output, which the outputs' lever does not keep) was held as long as its output lived. Held
    only until the owner block's forward ends now: after the forward no GELU output is alive, as with
    the outputs' lever alone."""
    alive = {}
    for levers in ("outputs", "both"):
        model = _stack((8, 32, 16, 2))
        recompute_activation_outputs(model)
        if levers == "both":
            recompute_activation_inputs(model)
        outputs = _GeluOutputs()
        with outputs:
            loss = model(torch.randn(512, 8)).pow(2).mean()
        gc.collect()
        alive[levers] = [ref().nbytes() for ref in outputs.made if ref() is not None]
        loss.backward()
    assert alive == {"outputs": [], "both": []}


def _nested(layout: torch.layout) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=layout, requires_grad=True)


def _nested_grads(model: nn.Module, layout: torch.layout) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)  # the same dropout draws in each run
    x = _nested(layout)  # (a fresh leaf a run: torch accumulates no second gradient into a nested one)
    out = model(x)
    (out.values().sum() if layout == torch.jagged else sum(t.sum() for t in out.unbind())).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@needs_hooks
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize(("lever", "layout"), [(pack_dropout_masks, torch.jagged), (pack_dropout_masks, torch.strided),
                                               (recompute_activation_inputs, torch.strided)],
                         ids=["dropout_masks-jagged", "dropout_masks-strided", "activation_inputs-strided"])
def test_nested_tensors_give_plain_torchs_gradients(lever: Callable[[nn.Module], Any], layout: torch.layout) -> None:
    """A nested tensor's dropout mask cannot be viewed flat to pack its bits (it raised), and a strided
    nested tensor tells no strides for an up-projection's output to be remade in (it raised): both are
    saved as they are."""
    results = []
    for on in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 8))
        if on:
            lever(model)
        results.append(_nested_grads(model, layout))
    _assert_bitwise((torch.zeros(()), results[0]), (torch.zeros(()), results[1]))


def _dtensor_worker(rank: int, init: str) -> None:
    """One of two gloo ranks: a dropout of a DTensor, with and without the lever, the same draws."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        mesh = init_device_mesh("cpu", (2,))
        grads = []
        for on in (False, True):
            model = nn.Sequential(nn.Dropout(0.3))
            if on:
                pack_dropout_masks(model)
            torch.manual_seed(0)
            x = distribute_tensor(torch.randn(4, 6, 8), mesh, [Shard(1)]).requires_grad_(True)
            local = model(x).to_local()
            (local * torch.arange(local.numel()).view_as(local)).sum().backward()
            grads.append(x.grad.full_tensor())
        assert torch.equal(grads[0], grads[1]), "the lever changed a DTensor's gradient"
    finally:
        dist.destroy_process_group()


@needs_hooks
def test_a_dtensors_dropout_gives_plain_torchs_gradients_on_two_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A DTensor's mask is a DTensor: packing its bits mixed it with plain tensors (it raised). Saved as
    it is, on two gloo ranks."""
    pytest.importorskip("torch.distributed.tensor")
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("no gloo")
    mp.spawn(_dtensor_worker, args=(f"file://{tmp_path / 'rendezvous'}",), nprocs=2)
