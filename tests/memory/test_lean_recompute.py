"""Selective recomputation of transformer blocks against the same model without it: the loss and every
gradient bitwise equal under the same seeds (dropout on, train and eval, float32 and bf16 autocast,
sdpa and eager attention), and fewer bytes held for backward, counted storage by storage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torch.utils.checkpoint as torch_checkpoint

from amp_backends.memory.ledger import Ledger
from amp_backends.memory.recompute import RecomputeError, find_blocks, selective_recompute, unavailable_reason

transformers = pytest.importorskip("transformers")

VOCAB = 128


def _gpt2(attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                     bos_token_id=0, eos_token_id=0, attn_implementation=attn)
    return transformers.GPT2LMHeadModel(config)


def _bert(attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                                     vocab_size=VOCAB, max_position_embeddings=64, attn_implementation=attn)
    return transformers.BertForSequenceClassification(config)


BUILD = {"gpt2": _gpt2, "bert": _bert}
X = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(1))
LABELS = {"gpt2": X, "bert": torch.tensor([0, 1, 1, 0])}


def _step(kind: str, model: nn.Module, amp: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(2)  # the dropout masks' seed
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = model(X, labels=LABELS[kind]).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def _bitwise(a: tuple[torch.Tensor, list[torch.Tensor]], b: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    assert torch.equal(a[0], b[0]), (a[0].item(), b[0].item())
    assert len(a[1]) == len(b[1])
    for i, (ga, gb) in enumerate(zip(a[1], b[1])):
        assert (ga is None) == (gb is None), i
        if ga is not None:
            assert torch.equal(ga, gb), f"gradient {i} differs: max {(ga - gb).abs().max().item()}"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_loss_and_every_gradient_bitwise_the_plain_models(kind: str, train: bool, attn: str) -> None:
    plain = BUILD[kind](attn).train(train)
    lean = BUILD[kind](attn).train(train)
    handle = selective_recompute(lean)
    assert {type(b).__name__ for b in handle.blocks} == {"GPT2Block" if kind == "gpt2" else "BertLayer"}
    assert len(handle.blocks) == 2
    _bitwise(_step(kind, plain), _step(kind, lean))
    if train:  # dropout really drew masks: another seed gives another loss
        torch.manual_seed(3)
        assert not torch.equal(plain(X, labels=LABELS[kind]).loss.detach(), _step(kind, lean)[0])


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_bitwise_under_bf16_autocast(kind: str) -> None:
    plain, lean = BUILD[kind]().train(), BUILD[kind]().train()
    selective_recompute(lean)
    _bitwise(_step(kind, plain, amp=True), _step(kind, lean, amp=True))


def test_torchs_transformer_encoder_is_found_and_bitwise() -> None:
    def build() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        return nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(64, 8))

    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(4))

    def step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        torch.manual_seed(5)
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    plain, lean = build().train(), build().train()
    handle = selective_recompute(lean)
    assert handle.blocks == tuple(lean[0].layers)
    _bitwise(step(plain), step(lean))


def _held_for_backward(kind: str, model: nn.Module) -> tuple[int, int]:
    """Bytes of the storages made in the forward and still alive after it (what the backward keeps, and
    the loss and logits), counted by the ledger's dispatch mode; and, beside it, the unique storages
    autograd packs through ``saved_tensors_hooks`` (blind inside a checkpoint, whose hooks take over)."""
    packed: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        packed[storage.data_ptr()] = storage.nbytes()
        return t

    ledger = Ledger()
    ledger.register([X, LABELS[kind]], params=list(model.parameters()))
    torch.manual_seed(2)
    with ledger, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        before = ledger.live
        loss = model(X, labels=LABELS[kind]).loss
        held = ledger.live - before
    loss.backward()
    existed = {t.untyped_storage().data_ptr() for t in (*model.parameters(), X, LABELS[kind])}
    return held, sum(n for ptr, n in packed.items() if ptr not in existed)


@pytest.mark.parametrize("kind,attn,at_least", [("gpt2", "sdpa", 0.50), ("gpt2", "eager", 0.50),
                                                ("bert", "sdpa", 0.35), ("bert", "eager", 0.35)])
def test_fewer_bytes_held_for_backward(kind: str, attn: str, at_least: float) -> None:
    # measured on torch 2.13 (CPU): GPT-2 2,529,544 -> 1,153,288 bytes (sdpa, -54.4%), 1,169,672 (eager,
    # -53.8%); BERT 1,680,680 -> 1,025,320 (-39.0%, both); the tiny models' logits and loss are in both
    plain_held, plain_packed = _held_for_backward(kind, BUILD[kind](attn).train())
    lean = BUILD[kind](attn).train()
    selective_recompute(lean)
    lean_held, lean_packed = _held_for_backward(kind, lean)
    # the plain model's count agrees with autograd's own: what it saves is alive, besides the loss and logits
    assert plain_packed <= plain_held
    assert lean_packed < plain_packed  # the hooks see only what is saved outside the blocks
    saving = 1 - lean_held / plain_held
    assert saving >= at_least, (plain_held, lean_held, saving)


def test_remove_restores_the_blocks_and_the_plain_step() -> None:
    model = _gpt2().train()
    before = [b.forward for b in model.transformer.h]
    handle = selective_recompute(model)
    assert all("forward" in b.__dict__ for b in model.transformer.h)
    with pytest.raises(RecomputeError, match="already recomputed"):
        selective_recompute(model)
    handle.remove()
    handle.remove()  # idempotent
    assert all("forward" not in b.__dict__ for b in model.transformer.h)
    assert [b.forward for b in model.transformer.h] == before
    selective_recompute(model).remove()  # and it can be turned on again
    # after remove no checkpoint runs: autograd's own hooks see every saved tensor again
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        model(X, labels=X).loss
    plain_seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain_seen.append(t) or t, lambda t: t):
        _gpt2().train()(X, labels=X).loss
    assert len(seen) == len(plain_seen)


def test_blocks_given_and_found() -> None:
    model = _bert()
    assert find_blocks(model) == list(model.bert.encoder.layer)
    handle = selective_recompute(model, blocks=[model.bert.encoder.layer[1]])
    assert handle.blocks == (model.bert.encoder.layer[1],)
    assert "forward" not in model.bert.encoder.layer[0].__dict__
    handle.remove()


def test_bad_input_is_refused_with_nothing_changed() -> None:
    model = _gpt2()
    other = _bert()
    cases = [
        (dict(blocks=[]), "blocks= is empty"),
        (dict(blocks=[other.bert.encoder.layer[0]]), "not a module of this model"),
        (dict(blocks=[model.transformer.h[0], model.transformer.h[0]]), "twice"),
        (dict(blocks=[model.transformer.h[0], model.transformer.h[0].mlp]), "one inside it"),
        (dict(save=[]), "save= is empty"),
        (dict(save=["mm"]), "takes torch ops"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RecomputeError, match=message):
            selective_recompute(model, **kwargs)
        assert all("forward" not in m.__dict__ for m in model.modules())
    with pytest.raises(RecomputeError, match="pass blocks="):
        selective_recompute(nn.Sequential(nn.Linear(4, 4), nn.GELU()))
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with pytest.raises(RecomputeError, match="checkpointed whole already"):
        selective_recompute(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_torch_without_selective_checkpoint_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert unavailable_reason() is None  # this torch (>= 2.5) has it
    monkeypatch.delattr(torch_checkpoint, "create_selective_checkpoint_contexts")
    model = _gpt2()
    with pytest.raises(RecomputeError, match=r"torch >= 2.5"):
        selective_recompute(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_composes_with_the_lean_mode_bitwise() -> None:
    """bf16 weights with float32 masters, low-precision saves and the head in blocks, with and without
    recomputation: the same gradients and the same parameters after the master step."""
    import amp_backends
    from amp_backends.memory import memory_lean

    runs = []
    for lever in (False, True):
        model = _gpt2().train()
        lean = memory_lean(model, torch.optim.AdamW(model.parameters()), backend=amp_backends.get("cpu"),
                           weights=torch.bfloat16, lm_head="lm_head")
        handle = selective_recompute(model) if lever else None
        step = _step("gpt2", model, amp=True)
        lean.optimizer.step()
        runs.append((step, [p.detach().clone() for p in model.parameters()]))
        if handle is not None:
            handle.remove()
        lean.remove()
    model = _gpt2().train()  # the same through memory_lean's own switch
    lean = memory_lean(model, torch.optim.AdamW(model.parameters()), backend=amp_backends.get("cpu"),
                       weights=torch.bfloat16, lm_head="lm_head", recompute=True)
    assert "blocks recompute" in repr(lean)
    step = _step("gpt2", model, amp=True)
    lean.optimizer.step()
    _bitwise(runs[0][0], step)
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], model.parameters()))
    lean.remove()
    assert all("forward" not in block.__dict__ for block in model.transformer.h), "remove() unwraps the blocks"
    _bitwise(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_memory_lean_refuses_recompute_without_blocks_with_nothing_changed() -> None:
    from amp_backends.memory import LeanError, memory_lean

    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with pytest.raises(LeanError, match="recompute"):
        memory_lean(model, torch.optim.AdamW(model.parameters()), backend="cpu", weights=torch.bfloat16, recompute=True)
    assert model[0].weight.dtype == torch.float32 and "forward" not in model[1].__dict__
    memory_lean(model, torch.optim.AdamW(model.parameters()), backend="cpu", weights=torch.bfloat16).remove()


def _live_tensor_bytes() -> int:
    """Bytes of every distinct CPU storage a live tensor holds, counted through the garbage collector."""
    import gc

    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        # plain tensors only: fake ones other tests left to the collector have no data pointer
        if type(obj) in (torch.Tensor, nn.Parameter) and obj.device.type == "cpu" and not obj.is_meta:
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("through", ["selective_recompute", "memory_lean"])
@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_a_recomputed_model_dropped_frees_itself_and_its_optimizer(kind: str, through: str) -> None:
    """Its mark on the blocks is weak both ways: a model trained with recomputation and then dropped,
    with its handle and optimizer, is collected, and every storage it held (parameters, gradients,
    the optimizer's state, masters) with it."""
    import gc
    import weakref

    import amp_backends
    from amp_backends.memory import memory_lean

    before = _live_tensor_bytes()
    model = BUILD[kind]().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if through == "memory_lean":
        lean = memory_lean(model, opt, backend=amp_backends.get("cpu"), weights=torch.bfloat16, recompute=True)
        step_opt: object = lean.optimizer
    else:
        handle = selective_recompute(model)
        step_opt = opt
    for _ in range(2):
        step_opt.zero_grad()  # type: ignore[attr-defined]
        _step(kind, model, amp=True)
        step_opt.step()  # type: ignore[attr-defined]
    held = _live_tensor_bytes() - before
    assert held >= 3 * sum(p.numel() * p.element_size() for p in model.parameters()), "parameters, grads, moments"
    alive = [weakref.ref(model), weakref.ref(opt), weakref.ref(step_opt)]
    if through == "selective_recompute":
        alive.append(weakref.ref(handle))
        del handle
    else:
        alive.append(weakref.ref(lean))
        del lean
    del model, opt, step_opt
    gc.collect()
    assert [r() for r in alive] == [None] * 4, "the model, its optimizer or the handle outlive every reference to them"
    assert _live_tensor_bytes() - before <= 4096, "storages of the dropped model or optimizer are still alive"


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_the_first_step_in_a_fresh_process_is_bitwise_the_plain_lean_step(kind: str) -> None:
    """The low-precision saves ask the device once per process, on their first call, whether autocast
    runs a norm in float32. In GPT-2 that first call is inside a recomputed block: the question's own
    ops must not reach the selective checkpoint, whose cache of saved outputs is matched to the ops by
    order (the probe's layer_norm taken for the block's, the recomputation fed its [2, 4] output). With
    the answer forgotten (a fresh process), the first lean step with recomputation is bitwise the lean
    step without it."""
    import amp_backends
    from amp_backends.memory import memory_lean
    from amp_backends.memory.saves import autocast_runs_in_fp32

    runs = []
    for recompute in (False, True):
        autocast_runs_in_fp32.__wrapped__.cache_clear()  # type: ignore[attr-defined]  # as in a fresh process
        model = BUILD[kind]().train()
        lean = memory_lean(model, torch.optim.AdamW(model.parameters()), backend=amp_backends.get("cpu"),
                           weights=torch.bfloat16, recompute=recompute)
        step = _step(kind, model, amp=True)
        lean.optimizer.step()
        runs.append((step, [p.detach().clone() for p in model.parameters()]))
        lean.remove()
    _bitwise(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_a_copy_of_a_recomputed_model_runs_its_own_parameters() -> None:
    """copy.deepcopy of a recomputed model (an EMA of it, a snapshot) gets wrappers of its own: its
    blocks run their own forward on their own parameters, recomputed, its loss and gradients bitwise a
    plain copy's with the same weights, nothing reaching the original; it refuses to be wrapped again,
    saying how to undo it, and the original's handle leaves the copy alone."""
    import copy

    from amp_backends import patches

    model = _gpt2().train()
    handle = selective_recompute(model)
    twin = copy.deepcopy(model)
    plain = _gpt2().train()
    with torch.no_grad():
        for t, p in zip(twin.parameters(), plain.parameters()):
            t.mul_(0.5)
            p.copy_(t)
    _bitwise(_step("gpt2", twin), _step("gpt2", plain))
    assert all(p.grad is None for p in model.parameters()), "the original's parameters took no gradient"
    assert all(b.forward.block is b for b in twin.transformer.h)
    import inspect

    assert inspect.signature(twin.transformer.h[0].forward) == inspect.signature(plain.transformer.h[0].forward)
    with pytest.raises(RecomputeError, match="copied so from a recomputed model"):
        selective_recompute(twin)
    handle.remove()
    assert all("forward" not in b.__dict__ for b in model.transformer.h)
    assert all("forward" in b.__dict__ for b in twin.transformer.h), "the copy keeps its own"
    for b in twin.transformer.h:
        patches.unwrap(b, "forward", b.forward)
    assert all("forward" not in b.__dict__ for b in twin.transformer.h)


def test_a_recomputed_model_pickles_whole_and_the_loaded_one_runs_its_own_blocks() -> None:
    """torch.save(model) of a recomputed model (and of one under every lever of the lean mode): the
    checkpoint's policy travels by op name, and the loaded model's blocks run recomputed on their own
    parameters, its loss and gradients bitwise the original's."""
    import io

    import amp_backends
    from amp_backends.memory import memory_lean

    for lean in (False, True):
        model = _gpt2().train()
        if lean:
            memory_lean(model, torch.optim.AdamW(model.parameters()), backend=amp_backends.get("cpu"),
                        weights=torch.bfloat16, lm_head="lm_head", recompute=True)
        else:
            selective_recompute(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert all(b.forward.block is b for b in loaded.transformer.h)
        assert loaded.transformer.h[0].forward.policy.save == model.transformer.h[0].forward.policy.save
        _bitwise(_step("gpt2", loaded, amp=lean), _step("gpt2", model, amp=lean))
