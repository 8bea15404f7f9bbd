"""Dropouts' masks kept as bits (``amp_backends.memory.dropout_masks``). The bits round-trip any bool
tensor; on Transformers' BERT and GPT-2 (dropout 0.1) the gradients are bitwise those without the lever
(fp32 and bf16 autocast, with the other levers, second order); the bytes saved for backward are lower by
exactly each dropout's noise less its bits, counted by the ledger and by a hook of our own, each dropout's
size counted by hooks on the dropouts; the bool mask of torch's fused kernel (CUDA's, run on the CPU
through ``torch.native_dropout``) is packed too; a saved float that is not dropout's noise is kept as it is;
checkpoints (both kinds), ``save_on_cpu`` and compile compose; an interrupted forward leaves nothing in force."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from amp_backends import torch_private
from amp_backends.memory import memory_lean, pack_dropout_masks
from amp_backends.memory import dropout_masks
from amp_backends.memory.dropout_masks import pack_bits, unpack_bits
from test_substitutes import TOKENS, _assert_bitwise, _build, _counted, _lean_steps, _loss, _step

#: whether this torch can tell which saved-tensor hooks are in force (2.4 cannot: the lever does nothing)
ACTIVE = torch_private.top_saved_tensors_hooks is not None
NAMES = ["bert", "gpt2"]


def _top_hooks() -> object:
    return torch_private.top_saved_tensors_hooks(False) if ACTIVE else None


@pytest.fixture
def packs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The masks the lever packs, counted (elements of each), so that a test can tell it did its work."""
    counted: list[int] = []

    def counting(mask: torch.Tensor) -> torch.Tensor:
        counted.append(mask.numel())
        return pack_bits(mask)

    monkeypatch.setattr(dropout_masks, "pack_bits", counting)
    return counted


@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (9,), (1000,), (3, 5, 7), (2, 0)])
def test_the_bits_round_trip_any_bool_tensor(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    n = torch.Size(shape).numel()
    for mask in (torch.rand(shape) < 0.3, torch.ones(shape, dtype=torch.bool), torch.zeros(shape, dtype=torch.bool)):
        packed = pack_bits(mask)
        assert packed.dtype == torch.uint8 and packed.shape == ((n + 7) // 8,)
        back = unpack_bits(packed, mask.shape)
        assert back.dtype == torch.bool and back.shape == mask.shape and torch.equal(back, mask)
    assert pack_bits(torch.tensor([True, False, True] + [False] * 4 + [True])).tolist() == [0b10000101]


def _model(name: str, masks: bool) -> nn.Module:
    model = _build(name)
    if masks:
        handle = pack_dropout_masks(model)
        assert handle.modules and handle.active == ACTIVE
    return model


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_are_bitwise_those_without_the_lever(name: str, dtype: torch.dtype | None, packs: list[int]) -> None:
    x = torch.randint(0, 64, TOKENS)
    plain = _step(_model(name, False), name, dtype, x)
    assert not packs
    _assert_bitwise(plain, _step(_model(name, True), name, dtype, x))
    layers = 2  # each calls two dropouts on the hidden width (32), after the embeddings' one
    assert packs.count(TOKENS[0] * TOKENS[1] * 32) == (2 * layers + 1 if ACTIVE else 0), packs


@pytest.mark.parametrize("name", NAMES)
def test_second_order_is_bitwise(name: str, packs: list[int]) -> None:
    """A gradient penalty: the dropout's backward is differentiated again through the unpacked mask."""
    x = torch.randint(0, 64, TOKENS)
    _assert_bitwise(_step(_model(name, False), name, torch.bfloat16, x, create_graph=True),
                    _step(_model(name, True), name, torch.bfloat16, x, create_graph=True))
    assert len(packs) >= (5 if ACTIVE else 0)


def _dropped_bytes(model: nn.Module, name: str, x: torch.Tensor) -> tuple[int, int, int]:
    """Each dropout's input, counted by hooks on the dropouts in a bf16 forward: the noise bytes it saves
    (its input's numel x itemsize, the CPU's noise being of the input's dtype), the bytes of its bits, and
    of the noise's one value kept beside them (a 0-d tensor of the input's dtype)."""
    sizes: list[tuple[int, int]] = []
    handles = [m.register_forward_hook(lambda m, a, o: sizes.append((a[0].numel(), a[0].element_size())))
               for m in model.modules() if isinstance(m, nn.Dropout)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _loss(model, name, x)
    for h in handles:
        h.remove()
    assert sizes
    return sum(n * size for n, size in sizes), sum((n + 7) // 8 for n, _ in sizes), sum(size for _, size in sizes)


def _saved(model: nn.Module, name: str, x: torch.Tensor) -> tuple[int, int, int]:
    """After a bf16 forward: the ledger's activations, and every storage live (nothing else is kept alive);
    and, in a second forward, the bytes of the distinct storages a saved-tensor hook of our own (in force
    beneath the lever's) is handed."""
    report, handed = _counted(model, name, x)
    return report.parts["activations"], report.peak, handed


@pytest.mark.parametrize("name", NAMES)
def test_the_bytes_saved_are_lower_by_each_dropouts_noise_less_its_bits(name: str) -> None:
    """The ledger's activations and a hook beneath the lever's see the bits in place of the noise; every
    storage live after the forward also counts the noise's value kept beside them, and nothing else (the
    lever holds no other tensor: an earlier version kept each dropout's input alive)."""
    x = torch.randint(0, 64, TOKENS)
    noise, bits, values = _dropped_bytes(_build(name), name, x)
    plain, packed = _saved(_model(name, False), name, x), _saved(_model(name, True), name, x)
    saved = noise - bits if ACTIVE else 0
    assert saved > 0 or not ACTIVE
    assert plain[0] - packed[0] == saved and plain[2] - packed[2] == saved, (plain, packed, noise, bits)
    assert plain[1] - packed[1] == (saved - values if ACTIVE else 0), (plain, packed, noise, bits, values)


class FusedDropout(nn.Dropout):
    """Dropout as CUDA, XPU and the PrivateUse1 devices run it: torch's fused kernel, which saves a bool mask."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_dropout(x, self.p, self.training)[0]


class SoftDropout(nn.Dropout):
    """Not dropout's noise: the input scaled by a random factor of many values, saved for backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (torch.rand_like(x) + 0.5)


def _mlp(dropout: type[nn.Dropout]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 36), dropout(0.25), nn.GELU(), nn.Linear(36, 4), dropout(0.5))


def _mlp_step(model: nn.Module, dtype: torch.dtype | None = torch.bfloat16, **hooks: object) -> tuple[
        torch.Tensor, dict[str, torch.Tensor], dict[torch.dtype, int]]:
    """One step of 9 rows (a bits tensor padded: 9 x 36 elements is not a multiple of 8); the bytes a hook
    beneath the lever's is handed, by dtype."""
    torch.manual_seed(2)
    x = torch.randn(9, 16)
    by_dtype: dict[torch.dtype, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(x).float().square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, by_dtype


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_kernels_bool_mask_is_packed_bitwise(dtype: torch.dtype | None) -> None:
    plain = _mlp_step(_mlp(FusedDropout), dtype)
    model = _mlp(FusedDropout)
    pack_dropout_masks(model)
    packed = _mlp_step(model, dtype)
    _assert_bitwise(plain[:2], packed[:2])
    masks = 9 * 36 + 9 * 4
    assert plain[2][torch.bool] == masks
    if ACTIVE:
        assert torch.bool not in packed[2] and packed[2][torch.uint8] == (9 * 36 + 7) // 8 + (9 * 4 + 7) // 8


def test_a_saved_float_that_is_not_dropouts_noise_is_kept_as_it_is() -> None:
    """The check before noise is packed: a random factor of many values is saved as it was."""
    plain = _mlp_step(_mlp(SoftDropout))
    model = _mlp(SoftDropout)
    pack_dropout_masks(model)
    kept = _mlp_step(model)
    _assert_bitwise(plain[:2], kept[:2])
    assert kept[2] == plain[2] and torch.uint8 not in kept[2]


#: masks packed a step: the two dropouts of the forward, and again in a checkpoint's recomputation
#: (the non-reentrant one runs the forward with grad, then recomputes; the reentrant one's forward has no grad)
PACKS = {"non-reentrant": 4, "reentrant": 2, "save_on_cpu": 2}


@pytest.mark.parametrize("kind", ["non-reentrant", "reentrant", "save_on_cpu"])
def test_checkpoints_and_save_on_cpu_compose(kind: str, packs: list[int]) -> None:
    """Under hooks in force before the lever (a checkpoint's, ``save_on_cpu``'s) they are handed the bits."""
    handed: list[torch.dtype] = []

    def run(masks: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = _mlp(nn.Dropout)
        if masks:
            pack_dropout_masks(model)
        torch.manual_seed(2)
        x = torch.randn(9, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if kind == "save_on_cpu":
                def beneath(t: torch.Tensor) -> torch.Tensor:
                    handed.append(t.dtype)
                    return t

                with torch.autograd.graph.saved_tensors_hooks(beneath, lambda t: t):
                    with torch.autograd.graph.save_on_cpu():
                        y = model(x)
            else:
                y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=kind == "reentrant")
        y.float().square().mean().backward()
        return x.grad, {n: p.grad for n, p in model.named_parameters()}

    plain = run(False)
    assert not packs
    _assert_bitwise(plain, run(True))
    assert len(packs) == (PACKS[kind] if ACTIVE else 0), packs
    assert _top_hooks() is None


def test_through_memory_lean_two_steps_are_bitwise_and_remove_leaves_no_hooks() -> None:
    x = torch.randint(0, 64, TOKENS)

    def train(masks: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = _build("bert")
        lean = memory_lean(model, torch.optim.AdamW(model.parameters(), lr=1e-3), weights=torch.bfloat16,
                           dropout_masks=masks)
        assert ("dropouts' masks as bits" in repr(lean)) is (masks and ACTIVE)
        loss = _lean_steps(lean, model, "bert", x, 2)[-1]
        lean.remove()
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules() if isinstance(m, nn.Dropout))
        return loss, dict(model.named_parameters())

    _assert_bitwise(train(False), train(True))


def test_nothing_is_done_in_eval_without_grad_at_p_zero_or_compiled(packs: list[int]) -> None:
    model = _mlp(nn.Dropout)
    pack_dropout_masks(model)
    x = torch.randn(9, 16)
    packed: list[torch.dtype] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.no_grad():
            model(x)
        model.eval()
        model(x).sum().backward()
        model.train()
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        model(x).sum().backward()
    assert packed and torch.uint8 not in packed and not packs
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.5
    plain = _mlp(nn.Dropout)
    for m in plain.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.5
    grads = []
    for net in (plain, model):
        net.zero_grad(set_to_none=True)
        compiled = torch.compile(net, backend="eager")
        torch.manual_seed(3)
        compiled(x).sum().backward()
        grads.append((torch.zeros(()), {n: p.grad for n, p in net.named_parameters()}))
    _assert_bitwise(*grads)
    assert not packs, "compiled, the compiler decides what to save"
    assert _top_hooks() is None


def test_a_forward_interrupted_inside_a_dropout_leaves_nothing_in_force() -> None:
    """A KeyboardInterrupt (which torch's always-called forward hooks do not see) between the lever's
    pre-hook and the dropout's save leaves its hooks in force: the next dropout's forward takes them out
    (and so does ``remove()``), and the training after is bitwise as without the lever."""
    model = _mlp(nn.Dropout)
    handle = pack_dropout_masks(model)
    dropout = model[1]

    def interrupt(module: nn.Module, args: object) -> None:
        raise KeyboardInterrupt

    x = torch.randn(9, 16)
    for end in ("next dropout", "remove"):
        stop = dropout.register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            model(x)
        stop.remove()
        if ACTIVE:
            assert _top_hooks() is not None  # left in force by the interruption
        if end == "next dropout":
            with torch.no_grad():  # nothing saved: only the dropout's pre-hook runs its cleanup
                dropout(torch.randn(3, 36))
        else:
            handle.remove()
        assert _top_hooks() is None
    pack_dropout_masks(model)
    plain = _mlp(nn.Dropout)
    grads = []
    for net in (model, plain):
        torch.manual_seed(3)
        net(x).sum().backward()
        grads.append((torch.zeros(()), {n: p.grad for n, p in net.named_parameters()}))
        assert _top_hooks() is None
    _assert_bitwise(*grads)


def test_no_scope_outlives_its_step_without_a_garbage_collection() -> None:
    """A scope's context held its bound hooks, a cycle only a collection freed, keeping the hooks beneath
    it alive (a checkpoint's frame, the ledger's) until then: closed scopes drop it. Both kinds, the
    dropouts' and the substituted saves' (``activation_outputs``), counted with the collector off."""
    import gc

    from amp_backends.memory import fused_activations, recompute_activation_outputs, substitutes

    model = _build("bert")
    fused_activations(model)
    recompute_activation_outputs(model)
    pack_dropout_masks(model)
    x = torch.randint(0, 64, TOKENS)

    def scopes() -> list[str]:
        return [type(o).__module__ for o in gc.get_objects() if isinstance(o, (substitutes._Scope, dropout_masks._Scope))]

    gc.collect()
    before = scopes()  # a graph never run backward under identity saved-tensor hooks (an earlier test's) lives on
    gc.disable()
    try:
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(model, "bert", x)
            loss.backward()
            del loss
        alive = scopes()
    finally:
        gc.enable()
    assert alive == before, alive
