"""Saved tensors substituted (``amp_backends.memory.substitutes``) by two levers. Activations' outputs
recomputed from their inputs for the ops that save them: on Transformers' GPT-2, BERT and Llama the
gradients are bitwise those without the lever; the bytes saved for backward are lower by exactly one
tensor of the MLP's inner width per layer, counted by the ledger and by a saved-tensor hook of our own;
it composes with torch's checkpoint, ``save_on_cpu``, second order and ``torch.compile``; an input
edited in place is refused; ``remove()`` and copies behave. Autocast's copies of one float32 activation
for several sibling linears kept once: bitwise gradients, exactly the extra copies fewer bytes."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from amp_backends import PerformanceWarning, torch_private
from amp_backends.memory import (Lean, fused_activations, hooks_around, memory_lean, recompute_activation_outputs, share_casts,
                                 substitutes)
from amp_backends.memory.activation_outputs import RecomputedInputEdited, pure_function
from amp_backends.memory.ledger import Ledger, MemoryReport
from saved_bytes import saved_storage_bytes
from sim_marks import needs_sim_device


def _transformers():  # type: ignore[no-untyped-def]
    return pytest.importorskip("transformers")

#: whether this torch can tell which saved-tensor hooks are in force (2.4 cannot: the lever does nothing)
ACTIVE = torch_private.top_saved_tensors_hooks is not None
TOKENS = (2, 16)


def _gpt2() -> nn.Module:
    transformers = _transformers()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    transformers = _transformers()
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                     intermediate_size=96, vocab_size=64, max_position_embeddings=32)
    return transformers.BertForSequenceClassification(config)


def _llama() -> nn.Module:
    transformers = _transformers()
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=4, intermediate_size=80, vocab_size=64,
                                      max_position_embeddings=32, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(config)


#: model -> (build, inner width of its MLP)
MODELS = {"gpt2": (_gpt2, 4 * 32), "bert": (_bert, 96), "llama": (_llama, 80)}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().train()


def _loss(model: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    labels = torch.tensor([0, 1]) if name == "bert" else x
    torch.manual_seed(1)  # the same dropout masks in every run
    return model(x, labels=labels).loss


def _step(model: nn.Module, name: str, dtype: torch.dtype | None, x: torch.Tensor,
          create_graph: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = _loss(model, name, x)
    params = [p for p in model.parameters()]
    if create_graph:  # a gradient penalty: its gradient goes through the saved tensors' graph
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        (loss + sum(g.pow(2).sum() for g in grads if g is not None)).backward()
    else:
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _lean_steps(lean: Lean, model: nn.Module, name: str, x: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """``steps`` bf16-autocast training steps of ``model`` through ``lean.optimizer`` (a memory_lean
    handle's): each step's loss, detached."""
    losses = []
    for _ in range(steps):
        lean.optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, name, x)
        loss.backward()
        lean.optimizer.step()
        losses.append(loss.detach())
    return losses


def _assert_bitwise(a: tuple[torch.Tensor, dict[str, torch.Tensor]],
                    b: tuple[torch.Tensor, dict[str, torch.Tensor]]) -> None:
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert a[1].keys() == b[1].keys() and a[1]
    for key in a[1]:
        assert torch.equal(a[1][key], b[1][key]), key


def _with_lever(name: str) -> tuple[nn.Module, object]:
    model = _build(name)
    fused_activations(model)
    return model, recompute_activation_outputs(model)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_are_bitwise_those_without_the_lever(name: str, dtype: torch.dtype | None) -> None:
    x = torch.randint(0, 64, TOKENS)
    plain = _build(name)
    fused_activations(plain)  # GPT-2's GELU fused in both: the lever under test is the recomputation
    model, handle = _with_lever(name)
    assert len(handle.modules) == 2 and handle.active == ACTIVE  # type: ignore[attr-defined]
    _assert_bitwise(_step(plain, name, dtype, x), _step(model, name, dtype, x))


def _saved_bytes(model: nn.Module, name: str, x: torch.Tensor) -> tuple[int, int]:
    """After a bf16 forward: the ledger's bf16 activations; and, in a second forward, the bytes of the
    distinct storages a saved-tensor hook of our own is handed (the hooks in force beneath the lever's)."""
    report, handed = _counted(model, name, x)
    return report.activations_by_dtype.get("bfloat16", 0), handed


def _counted(model: nn.Module, name: str, x: torch.Tensor) -> tuple[MemoryReport, int]:
    """After a bf16 forward: the ledger's report of what is live (activations, every storage); and, in a
    second forward, the bytes of the distinct storages a saved-tensor hook of our own is handed (the hooks
    in force beneath the lever's)."""
    ledger = Ledger()
    ledger.register([x], params=model.parameters())
    with ledger:
        with ledger.phase("forward"), torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, name, x)
        ledger.restart_peak()
        report = ledger.report(params=model.parameters())
    del loss

    def forward() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _loss(model, name, x)

    return report, saved_storage_bytes(forward)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_tensor_of_the_inner_width_less_per_layer(name: str) -> None:
    """Counted twice, by the ledger and by a hook of our own beneath the lever: the bytes saved for
    backward are lower by exactly layers x tokens x inner width x 2 (bf16), the activation's output
    each MLP's second op (GPT-2's c_proj, BERT's output dense, Llama's product with up) kept."""
    x = torch.randint(0, 64, TOKENS)
    plain = _build(name)
    fused_activations(plain)  # GPT-2's GELU fused in both: the lever under test is the recomputation
    before = _saved_bytes(plain, name, x)
    model, handle = _with_lever(name)
    after = _saved_bytes(model, name, x)
    tokens, inner = TOKENS[0] * TOKENS[1], MODELS[name][1]
    expected = 2 * tokens * inner * 2 if ACTIVE else 0
    assert before[0] - after[0] == expected, (before, after)
    assert before[1] - after[1] == expected, (before, after)


def test_memory_lean_turns_it_on_and_it_composes_with_the_masters() -> None:
    """Through ``memory_lean`` (bf16 weights, float32 masters, low-precision saves, the fused GELU):
    three AdamW steps give bitwise the weights the same lean setup without the lever gives."""
    import amp_backends

    x = torch.randint(0, 64, TOKENS)
    weights = {}
    for on in (False, True):
        model = _build("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        lean = memory_lean(model, opt, backend=amp_backends.get("cpu"), weights=torch.bfloat16,
                           activation_outputs=on)
        for _ in range(3):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = _loss(model, "gpt2", x)
            loss.backward()
            lean.optimizer.step()
            lean.optimizer.zero_grad()
        assert ("2 activations' outputs recomputed" in repr(lean)) == (on and ACTIVE), repr(lean)
        weights[on] = {k: v.clone() for k, v in lean.state_dict().items()}
        lean.remove()
        assert not [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    for key in weights[False]:
        assert torch.equal(weights[False][key], weights[True][key]), key


@pytest.mark.parametrize("name", ["gpt2", "bert"])
@pytest.mark.parametrize("how", ["checkpoint", "hf-checkpoint-reentrant", "selective-recompute", "save_on_cpu",
                                 "create_graph"])
def test_composes_with_the_hooks_in_force_and_second_order(how: str, name: str) -> None:
    """Under torch's checkpoint of the whole model (non-reentrant: its hooks beneath ours; Transformers'
    reentrant one), the lean mode's selective recomputation of each block (a checkpoint inside the block
    the activation's output would be substituted in: left to it, the same in the forward and its
    recomputation), inside ``save_on_cpu`` and through a gradient penalty (``create_graph``): bitwise
    what the same run gives without the levers."""
    from amp_backends.memory import selective_recompute

    x = torch.randint(0, 64, TOKENS)
    runs = []
    for on in (False, True):
        model = _build(name)
        fused_activations(model)
        if how == "selective-recompute":
            selective_recompute(model)
        if on:
            recompute_activation_outputs(model)
            share_casts(model)
        if how == "hf-checkpoint-reentrant":
            kwargs = {"use_reentrant": True}
            if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.x
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if how == "checkpoint":
            inner = model.forward

            def forward(*args: object, _inner: object = inner, **kwargs: object) -> object:
                return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **kwargs)

            model.forward = forward  # type: ignore[method-assign]
        if how == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                runs.append(_step(model, name, torch.bfloat16, x))
        else:
            runs.append(_step(model, name, torch.bfloat16, x, create_graph=how == "create_graph"))
    _assert_bitwise(runs[0], runs[1])


def test_compiled_model_gives_eager_gradients() -> None:
    """Under ``torch.compile`` the lever stays out (the compiler decides what to save): the compiled
    model's loss and gradients are the eager model's."""
    x = torch.randint(0, 64, TOKENS)
    eager = _step(_build("gpt2"), "gpt2", None, x)
    model, _ = _with_lever("gpt2")
    compiled = torch.compile(model, backend="aot_eager")
    with torch.autocast("cpu", enabled=False):
        torch.manual_seed(1)
        loss = compiled(x, labels=x).loss
    loss.backward()
    torch.testing.assert_close(loss.detach(), eager[0], rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, eager[1][name], rtol=1e-5, atol=1e-6)


class _Mlp(nn.Module):
    def __init__(self, edit_output: bool = False, edit_input: bool = False) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)
        self.edit_output, self.edit_input = edit_output, edit_input
        self.hidden: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden = self.up(x)
        y = self.act(self.hidden)
        if self.edit_output:
            y = y.mul_(2)  # edited in place before anything saves it: it is not the GELU's output any more
        if self.edit_input:
            with torch.no_grad():
                self.hidden.add_(1)  # the input edited before the output is saved: no longer its source
        return self.down(y)


def test_a_torch_mlp_keeps_one_tensor_less_where_this_torch_lets_it() -> None:
    """A torch MLP (Linear, GELU, Linear): the bytes a saved-tensor hook beneath the
    lever is handed are lower by the GELU's output where this torch tells the hooks in force (not on 2.4,
    where the lever says it is inactive and changes nothing), and the gradients are bitwise plain torch's."""
    x = torch.randn(4, 8)
    plain, plain_grads, _ = _saved_and_grads(_Mlp, x, False)
    counted, grads, (model, handle) = _saved_and_grads(_Mlp, x, True)
    assert handle.active == ACTIVE and handle.modules == [model.act] and handle.scopes == [model]
    assert plain - counted == (4 * 32 * 4 if ACTIVE else 0), (plain, counted)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads))


def _saved_and_grads(build, x: torch.Tensor, on: bool):  # type: ignore[no-untyped-def]
    """The bytes a saved-tensor hook beneath the lever is handed in a forward of ``build()`` (the lever on
    or off), the gradients, and the model and the lever's handle."""
    torch.manual_seed(0)
    model = build()
    handle = recompute_activation_outputs(model) if on else None
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x).pow(2).sum()
    out.backward()
    return sum(seen.values()), [p.grad for p in model.parameters()], (model, handle)


def test_an_input_edited_in_place_after_the_forward_is_refused() -> None:
    """The activation's input edited in place between forward and backward: the recomputed output would
    be wrong, so the backward raises, naming the edit and the way out (plain autograd refuses it too)."""
    model = _Mlp()
    recompute_activation_outputs(model)
    out = model(torch.randn(4, 8)).sum()
    assert model.hidden is not None
    with torch.no_grad():
        model.hidden.add_(1)
    expected = RecomputedInputEdited if ACTIVE else RuntimeError
    with pytest.raises(expected, match="modified by an inplace operation|edited in place"):
        out.backward()


def _plain_and_lever(**edits: bool) -> list[_Mlp]:
    """The same MLP twice (the same weights), the second with its activation's output recomputed."""
    models = []
    for on in (False, True):
        torch.manual_seed(0)
        models.append(_Mlp(**edits))
        if on:
            recompute_activation_outputs(models[-1])
    return models


def test_an_output_edited_before_it_is_saved_is_kept_as_it_is() -> None:
    """An output edited in place before an op saves it is no longer the activation's function of its
    input: it is saved as it is, and the gradients are plain torch's."""
    x = torch.randn(4, 8)
    grads = []
    for model in _plain_and_lever(edit_output=True):
        model(x).pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_an_input_edited_before_the_output_is_saved_leaves_the_output_saved_as_it_is() -> None:
    """The activation's input edited in place between the activation and the op that saves its output:
    the output is no longer the function of its input, so it is saved as it is, not remade from the
    edited input. The gradient of the second layer's weight alone (the activation's own backward, which
    autograd would refuse for the edit, never runs) is plain torch's; the whole backward fails as plain
    torch's does, at the activation's saved input."""
    x = torch.randn(4, 8)
    grads = []
    for model in _plain_and_lever(edit_input=True):
        out = model(x).pow(2).sum()
        grads.append(torch.autograd.grad(out, [model.down.weight], retain_graph=True)[0])
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as caught:
            out.backward()
        assert not isinstance(caught.value, RecomputedInputEdited)
    assert torch.equal(grads[0], grads[1])


def test_known_functions_only_and_remove_and_copies() -> None:
    """Only activations whose function is known are tagged (an in-place SiLU, ReLU, a subclass are not);
    ``remove()`` takes every hook off; a deep copy and a pickled model run bitwise as the original."""

    class MyGelu(nn.GELU):
        pass

    assert pure_function(nn.GELU(approximate="tanh")) is not None and pure_function(nn.SiLU()) is not None
    for module in (nn.SiLU(inplace=True), nn.ReLU(), MyGelu(), nn.Tanh()):
        assert pure_function(module) is None, module
    model, handle = _with_lever("bert")
    x = torch.randint(0, 64, TOKENS)
    copied = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    reference = _step(model, "bert", torch.bfloat16, x)
    _assert_bitwise(reference, _step(copied, "bert", torch.bfloat16, x))
    _assert_bitwise(reference, _step(loaded, "bert", torch.bfloat16, x))
    handle.remove()  # type: ignore[attr-defined]
    hooked = [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    assert hooked == []
    assert _saved_bytes(model, "bert", x) == _saved_bytes(_build("bert"), "bert", x)


# -- autocast's copies shared ---------------------------------------------------------------------------

#: model -> the extra copies per layer autocast makes of one float32 activation (BERT: query, key and value
#: read one LayerNorm output; Llama: q, k, v read one norm's output, gate and up another)
EXTRA_COPIES = {"bert": 2, "llama": 3}


def _amp_step_and_saved_bytes(model: nn.Module, name: str, x: torch.Tensor) -> tuple[int, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """A bf16 autocast step of float32 weights: the bytes of the distinct storages saved, and the result."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(model, name, x)
    loss.backward()
    return sum(seen.values()), (loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})


@pytest.mark.parametrize("name", sorted(EXTRA_COPIES))
def test_one_copy_of_an_activation_for_its_sibling_linears(name: str) -> None:
    """Float32 weights under bf16 autocast (the residual stream float32): the bytes saved are lower by
    exactly the extra copies x layers x tokens x hidden x 2, and the loss and gradients are bitwise
    those without the lever (the same casts, each linear's gradient reaching the input in float32)."""
    x = torch.randint(0, 64, TOKENS)
    plain = _amp_step_and_saved_bytes(_build(name), name, x)
    model = _build(name)
    handle = share_casts(model)
    assert handle.active and all(type(m) is nn.Linear for m in handle.modules)  # (no saved-tensor hook: every torch)
    shared = _amp_step_and_saved_bytes(model, name, x)
    expected = EXTRA_COPIES[name] * 2 * TOKENS[0] * TOKENS[1] * 32 * 2
    assert plain[0] - shared[0] == expected, (plain[0], shared[0])
    _assert_bitwise(plain[1], shared[1])
    handle.remove()
    assert not [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]


class _Projections(nn.Module):
    """Three sibling linears: two read one input, the third another, or the first input edited in place."""

    def __init__(self, edit: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.edit = edit

    def forward(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        h = x * 2
        q = self.q(h)
        if self.edit:
            h.add_(1)  # edited between the two reads: the second cast is of another value
        return q * self.k(h) + self.v(other)


@pytest.mark.parametrize("edit", [False, True], ids=["shared", "edited-between"])
def test_only_copies_of_the_same_unchanged_input_are_shared(edit: bool) -> None:
    """Two linears read one input, a third another: one copy fewer saved; with the input edited in place
    between the two reads, none (the second cast is of another value); the gradients bitwise plain
    autocast's either way. Without autocast nothing is cast."""
    x, other = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    counted, results = {}, {}
    for on in (False, True):
        torch.manual_seed(0)
        model = _Projections(edit)
        if on:
            share_casts(model)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x.grad = None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, other)
        out.float().pow(2).sum().backward()
        counted[on], results[on] = sum(seen.values()), [x.grad.clone(), *[p.grad for p in model.parameters()]]
        if on:
            with torch.no_grad():  # no autocast, float32: nothing is cast, nothing saved differently
                assert model(x, other).dtype == torch.float32
    assert counted[False] - counted[True] == (0 if edit else 4 * 8 * 2), counted
    assert all(torch.equal(a, b) for a, b in zip(results[False], results[True]))


def test_the_copy_a_sibling_saves_edited_in_place_after_the_forward_is_refused_at_the_backward() -> None:
    """The later linears are handed views of the first copy that share its version counter: the copy
    edited in place after the forward (reached here by a function mode that keeps what each linear is
    handed) is refused by autograd for every layer that saved it, as an edited saved tensor is, not read
    silently by the key's backward. Unedited, the same views give the plain gradients."""
    torch.manual_seed(0)
    model = _Projections(edit=False)
    share_casts(model)
    x = torch.randn(4, 8, requires_grad=True)
    with _LinearInputs() as inputs, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, torch.randn(4, 8))
    q_in, k_in = inputs.seen[0], inputs.seen[1]
    assert k_in is not q_in and k_in._base is not None and k_in.grad_fn is not q_in.grad_fn, "a view through a node of its own"
    assert k_in.data_ptr() == q_in.data_ptr() and k_in._version == q_in._version, "of the first copy's storage"
    before = k_in._version
    with torch.no_grad():
        q_in.add_(1)
    assert k_in._version == before + 1, "the view shares the copy's version counter"
    with pytest.raises(RuntimeError, match="modified by an inplace operation|has been modified inplace"):
        out.float().sum().backward()  # (autograd's words for the query's save, or for the key's view)


def test_inside_torch_funcs_transforms_each_layer_is_handed_its_own_cast() -> None:
    """``torch.func.grad`` (of the input, and of the parameters through ``functional_call``) and ``vmap``
    with a backward outside it: each linear is cast for as without the lever (an autograd function needs
    rules of its own inside the transforms), and the results are bitwise plain autocast's."""
    results = []
    for on in (False, True):
        torch.manual_seed(0)
        model = _Projections(edit=False)
        if on:
            share_casts(model)
        x, other = torch.randn(4, 8), torch.randn(4, 8)
        batch = torch.randn(3, 4, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            by_input = torch.func.grad(lambda v: model(v, other).float().sum())(x)
            by_params = torch.func.grad(
                lambda p: torch.func.functional_call(model, p, (x, other)).float().sum())(dict(model.named_parameters()))
            mapped = torch.vmap(lambda v: model(v, other))(batch)
        mapped.float().pow(2).sum().backward()
        results.append([by_input, *by_params.values(), batch.grad, *[p.grad for p in model.parameters()]])
    assert all(torch.equal(a, b) for a, b in zip(*results))


class _LinearInputs(TorchFunctionMode):
    """Keeps what each ``F.linear`` is handed, and the saved-tensor hooks in force when it runs (a function
    mode: unseen by the levers' test of others' hooks around a layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []
        self.hooks_in_force: list[object] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.nn.functional.linear:
            self.seen.append(args[0])
            top = torch_private.top_saved_tensors_hooks
            self.hooks_in_force.append(top(False) if top is not None else None)
        return func(*args, **(kwargs or {}))


class _Casts(TorchDispatchMode):
    """Counts the casts (``aten._to_copy``) dispatched inside it, autocast's included."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


def test_the_shared_casts_run_python_once_per_shared_copy_in_the_backward_and_no_saved_tensor_hook() -> None:
    """No saved-tensor hook is put in force (every save goes straight to autograd, or to the hooks the
    user put in force), each copy after the first is not made (two casts fewer a BERT layer, counted
    at the dispatcher), and the backward runs one Python node per copy shared: its Python calls grow by
    the same count per layer (BERT: two copies a layer), where a backward without the lever runs the same
    calls whatever the depth."""
    from python_events import python_events

    transformers = _transformers()
    x = torch.randint(0, 64, TOKENS)

    def backward_calls(layers: int, on: bool) -> tuple[int, int]:
        """The backward's Python calls, and the casts (``aten._to_copy``) the forward dispatched."""
        torch.manual_seed(0)
        config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=32, num_attention_heads=4,
                                         intermediate_size=96, vocab_size=64, max_position_embeddings=32)
        model = transformers.BertForSequenceClassification(config).train()
        handle = share_casts(model) if on else None
        casts = _Casts()
        with _LinearInputs() as inputs, casts, torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, "bert", x)
        assert inputs.hooks_in_force and all(top is None for top in inputs.hooks_in_force), inputs.hooks_in_force
        shared = sum(t._base is not None and any(s is not t and s.data_ptr() == t.data_ptr() for s in inputs.seen)
                     for t in inputs.seen)  # views of another's input (of its storage, its version counter)
        assert shared == (2 * layers if on else 0) and (handle is None or handle.stood_aside == []), shared
        return python_events(loss.backward), casts.count

    plain, plain_casts = zip(*[backward_calls(layers, False) for layers in (1, 2, 3)])
    lever, lever_casts = zip(*[backward_calls(layers, True) for layers in (1, 2, 3)])
    assert [a - b for a, b in zip(plain_casts, lever_casts)] == [2, 4, 6], (plain_casts, lever_casts)  # no cast made twice
    assert plain[0] == plain[1] == plain[2], plain
    per_layer = lever[0] - plain[0]
    assert 0 < per_layer <= 2 * 8, (plain, lever)  # two shared copies a layer, a few calls each
    assert [b - a for a, b in zip(plain, lever)] == [per_layer, 2 * per_layer, 3 * per_layer], (plain, lever)


def test_a_linear_a_precision_policy_runs_in_float32_gets_its_input_uncast() -> None:
    """A precision policy runs ``q`` in float32: its input reaches it float32 (not rounded to bf16 by the
    lever first), so its output is bitwise the policy's alone; ``k`` is cast as autocast casts it."""
    import amp_backends

    x = torch.randn(4, 8)
    outs = []
    for on in (False, True):
        torch.manual_seed(0)
        model = _Projections(edit=False)
        policy = amp_backends.precision_policy(model, fp32=["q"])
        if on:
            share_casts(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs.append((model.q(x), model.k(x)))
        policy.remove()
    assert outs[0][0].dtype == torch.float32 and torch.equal(outs[0][0], outs[1][0])
    assert outs[1][1].dtype == torch.bfloat16 and torch.equal(outs[0][1], outs[1][1])


def test_memory_lean_shares_casts_by_default() -> None:
    import amp_backends

    model = _build("bert")
    lean = memory_lean(model, torch.optim.AdamW(model.parameters()), backend=amp_backends.get("cpu"))
    assert "autocast's copies shared by 6 linears" in repr(lean), repr(lean)
    lean.remove()
    assert not [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    off = memory_lean(model, torch.optim.AdamW(model.parameters()), backend=amp_backends.get("cpu"),
                      shared_casts=False, activation_outputs=False)
    assert not [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    off.remove()


_ON_A_GPU_LIKE_DEVICE = """
import json, torch, amp_backends
from torch import nn
from amp_backends.memory import memory_lean
from amp_backends.testing.simdevice import raw_of

class Mixer(nn.Module):  # three sibling projections of one input, as attention's query, key and value
    def __init__(self):
        super().__init__()
        self.query, self.key, self.value = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
    def forward(self, h):
        return self.query(h) * self.key(h) + self.value(h)

class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32)
    def forward(self, h):
        return self.down(self.act(self.up(h)))

class Layer(nn.Module):  # post-norm, as BERT's
    def __init__(self):
        super().__init__()
        self.mixer, self.norm1, self.mlp, self.norm2 = Mixer(), nn.LayerNorm(32), Mlp(), nn.LayerNorm(32)
    def forward(self, h):
        h = self.norm1(h + self.mixer(h))
        return self.norm2(h + self.mlp(h))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.norm = nn.Embedding(64, 32), nn.LayerNorm(32)
        self.layers, self.head = nn.Sequential(Layer(), Layer()), nn.Linear(32, 2)
    def forward(self, x):
        return self.head(self.layers(self.norm(self.embed(x))))

be = amp_backends.get("mlu")
x = torch.randint(0, 64, (32,)).to("mlu")
out = {}
for on in (False, True):
    torch.manual_seed(0)
    model = Net().to("mlu")
    lean = memory_lean(model, torch.optim.AdamW(model.parameters()), backend=be, weights=torch.bfloat16,
                       activation_outputs=on, shared_casts=on)
    seen, dtypes = {}, []
    def pack(t):  # the simulated device's data lives in CPU tensors: their storages are what is kept
        storage = raw_of(t).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t
    hook = model.norm.register_forward_hook(lambda m, a, o: dtypes.append(str(o.dtype)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), be.autocast():
        loss = model(x).float().pow(2).mean()
    loss.backward()
    hook.remove()
    out[str(on)] = {"saved": sum(seen.values()), "loss": loss.item(), "norm_out": dtypes,
                    "grads": [p.grad.float().cpu().tolist() for p in model.parameters()], "repr": repr(lean)}
print(json.dumps(out))
"""


@needs_sim_device
def test_on_a_device_whose_autocast_runs_layer_norm_in_float32_the_lean_step_keeps_less() -> None:
    """The simulated MLU's autocast follows CUDA's lists (layer_norm in float32): a post-norm model's
    stream is float32 there, as BERT's on a GPU, even with bf16 weights. Its lean step (bf16 weights,
    float32 masters) keeps, with both levers, exactly layers x tokens x (2 x width + inner) x 2 bytes less
    (two copies of the norm's output autocast casts for the key and value projections, the GELU's
    output), with bitwise the same loss and gradients."""
    from amp_backends.testing import sim_packages_path

    from conftest import run_json

    out = run_json(_ON_A_GPU_LIKE_DEVICE, [sim_packages_path("mlu")], {"AMP_SIM_MLU_CHIP": "MLU590"})
    assert out["True"]["norm_out"] == ["torch.float32"], "the simulated device's LayerNorm runs in float32, as CUDA's"
    expected = 2 * 32 * (2 * 32 + (96 if ACTIVE else 0)) * 2  # (the shared casts need no saved-tensor hook)
    assert out["False"]["saved"] - out["True"]["saved"] == expected, out
    assert out["False"]["loss"] == out["True"]["loss"] and out["False"]["grads"] == out["True"]["grads"]
    assert "autocast's copies shared by 10 linears" in out["True"]["repr"], out["True"]["repr"]
    assert "GELUs fused" not in out["True"]["repr"], "none written out here: the lever is not named"


# -- what others hand the levers: layouts, leaves, their own hooks ---------------------------------
class _Transposed(nn.Module):
    """A GELU on a transposed tensor, its output the next linear's input (strides (1, 24))."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 24), nn.GELU(), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x).t()))


class _ChannelsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.act, self.c2 = nn.Conv2d(3, 8, 3), nn.SiLU(), nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(self.act(self.c1(x)))


class _Siblings(nn.Module):
    """Two sibling linears read one transposed float32 activation."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x * 2).t()
        return self.q(h) * self.k(h)


def _grads_with_and_without(build, x: torch.Tensor, hooks, autocast: bool = False, prepare=None):  # type: ignore[no-untyped-def]
    """Parameter (and input) gradients of the same model without and with both levers."""
    out = []
    for on in (False, True):
        torch.manual_seed(0)
        model = build()
        if isinstance(model, _ChannelsLast):
            model = model.to(memory_format=torch.channels_last)
        if prepare is not None:
            prepare(model)
        if on:
            recompute_activation_outputs(model)
            share_casts(model)
        leaf = x.detach().clone().requires_grad_(x.requires_grad)
        with hooks(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(leaf).float().pow(2).sum()
        loss.backward()
        out.append([p.grad for p in model.parameters()] + ([leaf.grad] if leaf.requires_grad else []))
    return out


@pytest.mark.parametrize("case", ["transposed", "channels-last", "siblings-transposed"])
def test_hooks_before_that_store_tensors_contiguous_get_the_layout_the_op_saved(case: str) -> None:
    """``save_on_cpu(pin_memory=True)`` stores what it is handed as a contiguous copy: a source handed to
    it not contiguous (an activation of a transposed tensor, a channels-last convolution's, a transposed
    input of sibling linears whose first copy a hook keeps alive) was remade from that copy and read with
    the original strides, silently wrong gradients (off by 4 to 50). Bitwise now: such tensors are handed
    to the hooks before as they are."""
    import contextlib

    kept: list[torch.Tensor] = []

    def keep_first_input(model: nn.Module) -> None:  # keeps q's bf16 copy alive past the forward
        model.q.register_forward_hook(lambda mod, args, out: kept.append(args[0]))  # type: ignore[union-attr]

    build, x, autocast, prepare = {
        "transposed": (_Transposed, torch.randn(6, 8), False, None),
        "channels-last": (_ChannelsLast, torch.randn(2, 3, 9, 9).to(memory_format=torch.channels_last), False, None),
        "siblings-transposed": (_Siblings, torch.randn(8, 6), True, keep_first_input),
    }[case]
    for hooks in (contextlib.nullcontext, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)):
        plain, lever = _grads_with_and_without(build, x, hooks, autocast, prepare)
        assert all(torch.equal(a, b) for a, b in zip(plain, lever)), [(a - b).abs().max() for a, b in zip(plain, lever)]


class _Latents(nn.Module):
    """Learned queries read by sibling linears: a leaf that requires grad, which autocast casts once."""

    def __init__(self) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(4, 16))
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.q(self.latents) * self.k(self.latents) + self.v(self.latents)).sum() * x.sum()


def test_a_leaf_that_requires_grad_keeps_autocasts_one_cached_copy() -> None:
    """Autocast caches its cast of a leaf that requires grad (learned queries, an input whose gradient is
    asked for): one bf16 copy, the siblings' gradients summed in bf16. Casting it once per linear summed
    them in float32 instead: the leaf's gradient changed (by 0.008 here). Left to autocast, bitwise."""
    plain, lever = _grads_with_and_without(_Latents, torch.randn(2), __import__("contextlib").nullcontext, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, lever))
    x = torch.randn(8, 16, requires_grad=True)  # the same for an input leaf (its gradient asked for)
    plain, lever = _grads_with_and_without(_LeafReadTwice, x, __import__("contextlib").nullcontext, True)
    assert all(torch.equal(a, b) for a, b in zip(plain, lever))


class _LeafReadTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) * self.k(x)


def _steer(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:  # type: ignore[type-arg]
    return out * 2


def _clamp_in_place(module: nn.Module, args: tuple, out: torch.Tensor) -> None:  # type: ignore[type-arg]
    out.clamp_(max=0.1)


@pytest.mark.parametrize("where", ["activation", "activation-in-place", "sibling-pre-hook", "sibling-backward-hook",
                                   "every-module"])
def test_the_users_own_hooks_see_and_return_what_they_would_without_the_levers(
        where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward hook on the activation that steers or clamps its output, a pre-hook or a full backward
    hook on a sibling linear, a hook on every module (registered after the levers): the levers stand aside
    where others' hooks run (the recomputed output would have been the unhooked function's, the hooks would
    have been handed bf16 copies), so the gradients are bitwise those without them. Not silently: each
    lever names the layers (``stood_aside``) and warns once per hook."""
    seen: list[torch.dtype] = []

    def prepare(model: nn.Module) -> None:
        if where == "activation":
            model.act.register_forward_hook(_steer)  # type: ignore[union-attr]
        if where == "activation-in-place":
            model.act.register_forward_hook(_clamp_in_place)  # type: ignore[union-attr]
        if where == "sibling-backward-hook":
            model.k.register_full_backward_hook(  # type: ignore[union-attr]
                lambda mod, gi, go: (seen.append(gi[0].dtype), (gi[0] * 0.3,))[1])

    x = torch.randn(4, 8, requires_grad=True)
    build = _Mlp if where.startswith("activation") or where == "every-module" else (lambda: _Projections(False))
    args = (x, torch.randn(4, 8)) if build is not _Mlp else (x,)
    handle = None
    # where each lever stands aside (the MLP's linears cast nothing: a leaf that requires grad, a bf16 input)
    expected = {"activation": {"act"}, "activation-in-place": {"act"}, "sibling-pre-hook": {"k"},
                "sibling-backward-hook": {"k"}, "every-module": {"act"}}[where]
    aside: set[str] = set()
    monkeypatch.setattr(hooks_around, "_WARNED", set())
    if where == "every-module":
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda mod, a, out: out * 2 if isinstance(mod, nn.GELU) else None)
    try:
        results = []
        for on in (False, True):
            torch.manual_seed(0)
            model = build()
            prepare(model)
            if on:
                levers = (recompute_activation_outputs(model), share_casts(model))
            if where == "sibling-pre-hook":  # after the levers' own: it runs after their cast
                model.k.register_forward_pre_hook(lambda mod, a: (a[0] * 1.1, *a[1:]))  # type: ignore[union-attr]
            x.grad = None
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(2 if on else 1):  # a second forward warns no more
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = model(*args).float().pow(2).sum()
            loss.backward()
            results.append([x.grad.clone(), *[p.grad for p in model.parameters()]])
            if on:
                names = {id(m): n for n, m in model.named_modules()}
                aside = {names[id(m)] for lever in levers for m, hook in lever.stood_aside}
                said = [str(w.message) for w in caught if issubclass(w.category, PerformanceWarning)]
    finally:
        if handle is not None:
            handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(*results)), [(a - b).abs().max() for a, b in zip(*results)]
    assert aside == expected, "each layer where a lever stood aside is named"
    assert len(said) == len(expected) and all("stands aside" in m and "Lean.stood_aside" in m for m in said), said
    if where == "sibling-backward-hook":
        assert seen == [torch.float32, torch.float32], "the hook sees the float32 input's gradient, as without the lever"


def test_a_copy_from_a_forward_whose_graph_is_then_freed_serves_the_next_one() -> None:
    """The same float32 input read by sibling linears in two forwards while the first's graph lives: the
    second's copy is saved as the first's (equal bitwise), then the first graph is freed before the
    second backward. The first copy, reached through a weak reference, must stay a whole tensor (torch
    2.9 freed it under a live Python object: "sym_strides() called on an undefined Tensor"); the
    gradients are bitwise those without the lever."""
    import gc

    other = torch.randn(4, 8)
    grads = []
    for on in (False, True):
        torch.manual_seed(0)
        model = _Projections(False)
        if on:
            share_casts(model)
        x = torch.randn(4, 8, requires_grad=True)
        for _ in range(2):  # the first forward's graph is dropped when the second's loss replaces it
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, other).float().pow(2).sum()
        gc.collect()
        loss.backward()
        grads.append([x.grad, *[p.grad for p in model.parameters()]])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("then", ["next-step", "remove"])
def test_a_forward_a_keyboard_interrupt_ends_leaves_no_hooks_in_force_after_the_next_step_or_remove(then: str) -> None:
    """torch runs always-call forward hooks for an Exception only: a KeyboardInterrupt inside a block
    after its scope opened left the lever's saved-tensor hooks in force for the rest of the process
    (torch.func's transforms refuse to run under them). The block's next forward, or ``remove()``, closes
    what was left open; the next step's gradients are bitwise those of an uninterrupted run."""
    top = torch_private.top_saved_tensors_hooks
    x = torch.randn(4, 8)

    def interrupt(module: nn.Module, args: tuple) -> None:  # type: ignore[type-arg]
        raise KeyboardInterrupt

    def grads(model: nn.Module) -> list[torch.Tensor]:
        model.zero_grad()
        model(x).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(_Mlp()), nn.Sequential(_Mlp()))
    handle = recompute_activation_outputs(model)
    clean = grads(model)
    inside = model[0][0].down.register_forward_pre_hook(interrupt)  # type: ignore[index,union-attr]
    with pytest.raises(KeyboardInterrupt):
        model(x)
    inside.remove()
    if ACTIVE:
        assert top is not None and top(False) is not None, "the interrupted block's scope was left open"
    if then == "next-step":
        assert all(torch.equal(a, b) for a, b in zip(clean, grads(model)))
    else:
        handle.remove()
    assert top is None or top(False) is None, "nothing left in force"
    w = torch.randn(3)
    torch.testing.assert_close(torch.func.grad(lambda v: (v * v).sum())(w), 2 * w)


#: saves a layer from the activation's output to its consumer's and the next one (which closes the scope):
#: GPT-2's c_proj and BERT's output dense save their input, then their weight; Llama's up projection (input,
#: weight) runs between, then the product saves its two factors (the up projection's output first), then
#: the down projection its input
_SAVES_TO_CONSUMER = {"gpt2": 2, "bert": 2, "llama": 5}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_scope_closes_once_its_tagged_tensor_is_saved(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hooks run for the saves after a tag only until the tag's consumer saves it (each later save of
    the block would cost a Python call at the forward and one at the backward): on GPT-2, BERT and Llama only
    the saves up to the consumer's and the one after pass through them (2, 2 and 5 a layer, where a scope
    open to the block's end passed 3, 8 and 6), one of them substituted; the
    bytes saved are those the hooks open to the block's end gave (one tensor of the inner width less a
    layer), and the gradients are bitwise those without the lever (none of it on torch 2.4: nothing there)."""

    calls = {"pack": 0, "stored": 0}
    real_pack, real_stored = substitutes._Scope.pack, substitutes._Stored.__init__

    def pack(self, t):  # type: ignore[no-untyped-def]
        calls["pack"] += 1
        return real_pack(self, t)

    def stored(self, *args):  # type: ignore[no-untyped-def]
        calls["stored"] += 1
        real_stored(self, *args)

    monkeypatch.setattr(substitutes._Scope, "pack", pack)
    monkeypatch.setattr(substitutes._Stored, "__init__", stored)
    x = torch.randint(0, 64, TOKENS)
    plain = _build(name)
    fused_activations(plain)
    before = _saved_bytes(plain, name, x)[1]
    model, _ = _with_lever(name)
    after = _saved_bytes(model, name, x)[1]
    layers = 2 if ACTIVE else 0  # torch 2.4: nothing substituted, no scope opened
    assert before - after == layers * TOKENS[0] * TOKENS[1] * MODELS[name][1] * 2, (before, after)
    calls.update(pack=0, stored=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(model, name, x)
    assert calls["stored"] == layers and calls["pack"] <= _SAVES_TO_CONSUMER[name] * layers, calls
    loss.backward()  # the substituted saves remade
    model.zero_grad(set_to_none=True)
    _assert_bitwise(_step(plain, name, torch.bfloat16, x), _step(model, name, torch.bfloat16, x))


class _TwoMlps(nn.Module):  # one owner block, two activations in it: a scope for each, one after the other
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = _Mlp(), _Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _TwoMlps()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


def test_a_second_tag_in_a_block_whose_first_scope_closed_opens_its_own() -> None:
    """Two activations in one owner block: the scope the first opens closes when its output is saved, and
    the second's output is still substituted (the bytes saved lower by both), gradients bitwise plain's."""
    x = torch.randn(4, 8)
    plain, plain_grads, _ = _saved_and_grads(_Outer, x, False)
    counted, grads, (model, handle) = _saved_and_grads(_Outer, x, True)
    assert handle.scopes == [model.block] and len(handle.modules) == 2
    assert plain - counted == (2 * 4 * 32 * 4 if ACTIVE else 0), (plain, counted)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads))


class _SquaredMlp(nn.Module):  # its consumer saves the activation's output twice, back to back
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.up(x))
        return self.down(h * h)


class _TwoConsumers(nn.Module):  # a second consumer saves it after the first's and the down projection's saves
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)
        self.gate = nn.Parameter(torch.randn(32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.up(x))
        return self.down(h) + self.down(h * self.gate)


@pytest.mark.parametrize(("build", "saved"), [(_SquaredMlp, 4 * 32 * 4), (_TwoConsumers, 0)])
def test_an_op_that_saves_the_tagged_tensor_twice_has_both_saves_substituted(build, saved: int) -> None:  # type: ignore[no-untyped-def]
    """``h * h`` saves the activation's output twice, back to back: both saves are substituted (the scope
    closes at the save after), so the output is not kept (4 x 32 fp32 fewer bytes). A second consumer
    whose save comes after other saves keeps it (the documented limit: nothing saved, nothing wrong).
    Gradients bitwise those without the lever either way."""
    x = torch.randn(4, 8)
    plain, plain_grads, _ = _saved_and_grads(build, x, False)
    counted, grads, _ = _saved_and_grads(build, x, True)
    assert plain - counted == (saved if ACTIVE else 0), (plain, counted)
    assert all(torch.equal(a, b) for a, b in zip(plain_grads, grads))


def test_lean_names_the_layers_where_a_lever_stood_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook of the user's on one of BERT's GELUs (a profiler's, an offloading framework's): memory_lean's
    recomputation stands aside on that layer only; ``Lean.stood_aside`` names it with the hook, its repr
    counts it, one warning says so over two steps; the other layer's output is still recomputed (fewer
    bytes saved than with the lever off everywhere, more than with it on everywhere)."""
    monkeypatch.setattr(hooks_around, "_WARNED", set())
    x = torch.randint(0, 64, TOKENS)

    def lean(hooked: bool):  # type: ignore[no-untyped-def]
        model = _build("bert")
        if hooked:
            model.bert.encoder.layer[1].intermediate.intermediate_act_fn.register_forward_hook(_observe)
        return model, memory_lean(model, None, saves=False, activations=False, shared_casts=False)

    model, handle = lean(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hooked = _saved_bytes(model, "bert", x)[1]
        _step(model, "bert", torch.bfloat16, x)
    said = [str(w.message) for w in caught if issubclass(w.category, PerformanceWarning)]
    name = "bert.encoder.layer.1.intermediate.intermediate_act_fn"
    assert handle.stood_aside == {name: f"activation_outputs: a forward hook ({__name__}._observe)"}
    assert "1 layers stood aside for others' hooks" in repr(handle)
    assert len(said) == 1 and "activation_outputs lever stands aside on a GELUActivation" in said[0], said
    everywhere, nowhere = _saved_bytes(lean(False)[0], "bert", x)[1], _saved_bytes(_build("bert"), "bert", x)[1]
    assert everywhere < hooked < nowhere or not ACTIVE, (everywhere, hooked, nowhere)
    assert lean(False)[1].stood_aside == {}


def _observe(module: nn.Module, args: tuple, out: torch.Tensor) -> None:  # type: ignore[type-arg]
    pass


@pytest.mark.parametrize("tracker", ["ModuleTracker", "FlopCounterMode"])
def test_torchs_module_trackers_leave_the_levers_on_and_a_hook_of_the_users_for_every_module_does_not(tracker: str) -> None:
    """torch's module trackers (FlopCounterMode runs one) register forward hooks for every module that only
    observe: under them BERT's lean step keeps as few bytes as without them, with bitwise the same gradients;
    a forward hook of the user's own for every module makes the levers stand aside (all bytes kept)."""
    from torch.utils.flop_counter import FlopCounterMode
    from torch.utils.module_tracker import ModuleTracker

    x = torch.randint(0, 64, TOKENS)

    def lean() -> nn.Module:
        model = _build("bert")
        memory_lean(model, None, saves=False, activations=False)  # the two substituting levers on
        return model

    plain = _build("bert")
    alone = _saved_bytes(lean(), "bert", x)[1]
    with ModuleTracker() if tracker == "ModuleTracker" else FlopCounterMode(display=False):
        tracked = _saved_bytes(lean(), "bert", x)[1]
        model = lean()
        grads = _step(model, "bert", torch.bfloat16, x)
    assert tracked == alone < _saved_bytes(plain, "bert", x)[1] or not ACTIVE
    _assert_bitwise(_step(plain, "bert", torch.bfloat16, x), grads)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert _saved_bytes(lean(), "bert", x)[1] == _saved_bytes(_build("bert"), "bert", x)[1]
    finally:
        handle.remove()


class _TanhMlp(nn.Module):
    """An MLP whose activation's output goes through ``tanh`` (which saves its own output) before the
    consumer: a save of an op's output passes through the lever's scope."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.act(self.up(h))))


class _TanhBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = _TanhMlp()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(h)


def test_a_forward_never_run_backward_leaves_no_graph_alive() -> None:
    """A saved-tensor hook that hands an op's saved output back as it is makes a cycle through C++ (the
    output's grad_fn owns the saved variable that holds the output) which no collection frees where the
    graph never runs backward (a validation pass under grad, a ``retain_graph`` dropped): the lever's scope
    hands back a detached tensor (it leaked such graphs before). Counted: tensors with a grad_fn alive
    after a collection; and the gradients with the lever still bitwise."""
    import gc

    def alive() -> int:
        gc.collect()
        count = 0
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor):
                try:
                    count += o.grad_fn is not None
                except RuntimeError:  # an undefined tensor (torch 2.4's collector lists some)
                    pass
        return count

    torch.manual_seed(0)
    model = nn.Sequential(_TanhBlock(), _TanhBlock())
    plain = copy.deepcopy(model)
    handle = recompute_activation_outputs(model)
    assert handle.modules
    x = torch.randn(4, 8)
    before = alive()
    model(x).sum()
    model(x).sum().backward(retain_graph=True)
    assert alive() == before
    model.zero_grad()
    for net in (model, plain):
        net(x).square().sum().backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_the_host_bench_counts_each_levers_python_calls_and_the_defaults_add_up(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``bench/lean_profile.py --host --smoke``: each hooked lever alone and the defaults together, timed
    and counted; each adds Python calls, and the defaults' calls are exactly the two levers' own (they
    share nothing a step), a count that is the same on any machine."""
    import importlib.util
    import json
    from pathlib import Path

    _transformers()
    path = Path(__file__).resolve().parents[2] / "bench" / "lean_profile.py"
    spec = importlib.util.spec_from_file_location("lean_profile", path)
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    out = tmp_path / "host.json"
    assert bench.main(["--host", "--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert set(rows) == {"none", "activation_outputs", "shared_casts", "dropout_masks", "defaults"}
    calls = {name: row["python_calls"] - rows["none"]["python_calls"] for name, row in rows.items()}
    assert calls["shared_casts"] > 0  # (the other two put saved-tensor hooks in force: not on torch 2.4)
    assert (calls["activation_outputs"] > 0 and calls["dropout_masks"] > 0) or not ACTIVE
    assert calls["defaults"] == calls["activation_outputs"] + calls["shared_casts"], calls
    assert all(row["step_ms"] > 0 and row["step_ms"] == row["forward_ms"] + row["backward_ms"] for row in rows.values())


def test_the_lever_bench_times_all_the_levers_with_each_default_one_turned_off() -> None:
    """``bench/lean_profile.py --levers``: besides each lever alone and ``all`` (``lean-bf16``), a row
    for ``all`` with each of its levers off, one row per switch of ``memory_lean`` that is on by default
    (read from its signature, so a new default lever gets its row) and one for the low-precision weights,
    each differing from ``all`` in that switch alone."""
    import importlib.util
    import inspect
    from pathlib import Path

    from amp_backends.memory.lean import memory_lean

    path = Path(__file__).resolve().parents[2] / "bench" / "lean_profile.py"
    spec = importlib.util.spec_from_file_location("lean_profile", path)
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    defaults = {name for name, p in inspect.signature(memory_lean).parameters.items()
                if p.default is True and name != "master"}  # (master: how the weights lever keeps float32)
    assert defaults == {"saves", "activations", "activation_outputs", "shared_casts"}
    rows = {name[len("all-no-"):]: kw for name, kw in bench.LEVERS.items() if name.startswith("all-no-")}
    assert set(rows) == defaults | {"weights"}
    everything = bench.LEVERS["all"]
    for lever, kwargs in rows.items():
        changed = {k for k in everything.keys() | kwargs.keys() if kwargs.get(k, True) != everything.get(k, True)}
        assert changed == {lever}, (lever, kwargs)
        assert kwargs[lever] in (False, None)


# -- the shared casts under hostile use: each as plain autocast, or torch's own error -------------------
def _siblings(on: bool) -> nn.ModuleDict:
    torch.manual_seed(0)
    m = nn.ModuleDict({"q": nn.Linear(8, 8), "k": nn.Linear(8, 8), "v": nn.Linear(8, 8)})
    if on:
        share_casts(m)
    return m


def _attend(m: nn.ModuleDict, x: torch.Tensor) -> torch.Tensor:
    return m["q"](x) * m["k"](x) + m["v"](x)


def test_shared_casts_under_forward_mode_ad_give_autocasts_tangents() -> None:
    """A dual tensor read by the siblings: the shared view's tangent is the cast's (it raised: no jvp)."""
    import torch.autograd.forward_ad as fwAD

    tangents = []
    for on in (False, True):
        m = _siblings(on)
        x, t = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.randn(4, 8)
        with fwAD.dual_level(), torch.autocast("cpu", dtype=torch.bfloat16):
            tangents.append(fwAD.unpack_dual(_attend(m, fwAD.make_dual(x, t))).tangent)
    assert torch.equal(*tangents)


def test_shared_casts_under_compiled_autograd_give_autocasts_gradients() -> None:
    """An eager forward, a backward under compiled autograd: no gradient is owed to the shared copy (it
    raised: the node's None for a copy that required grad)."""
    from torch._dynamo import compiled_autograd

    if not hasattr(compiled_autograd, "_enable"):
        pytest.skip(f"torch {torch.__version__} has no compiled_autograd._enable (torch >= 2.5)")
    grads = []
    for on in (False, True):
        m = _siblings(on)
        x0 = torch.randn(4, 8, requires_grad=True, generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = _attend(m, x0 * 2)
        torch._dynamo.reset()
        with compiled_autograd._enable(torch.compile(backend="eager")):
            out.float().sum().backward()
        grads.append([x0.grad, *(p.grad for p in m.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_an_input_refilled_without_a_version_bump_is_cast_again_at_each_forward() -> None:
    """A numpy buffer refilled between two micro-batches (no version counter sees it), one backward: the
    first sibling of each forward casts it again (the stale copy was shared: wrong outputs and gradients);
    outputs and gradients are plain autocast's, bitwise."""
    import numpy as np

    results = []
    for on in (False, True):
        m = _siblings(on)
        buf = np.zeros((4, 8), np.float32)
        x = torch.from_numpy(buf)
        outs = []
        for step in range(2):
            buf[:] = np.random.RandomState(step).randn(4, 8)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs.append(_attend(m, x))
        sum(o.float().sum() for o in outs).backward()
        results.append([*outs, *(p.grad for p in m.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_selective_checkpointing_that_saves_casts_replays_them_in_the_forwards_order() -> None:
    """torch's selective activation checkpointing with a policy that saves every cast: the recomputation
    runs the lever as the forward did, so the cached casts are handed back to the ops they came from
    (gradients 150 off before, the recomputation casting in autocast's order where the forward had the
    lever's); bitwise plain autocast's."""
    import functools

    import torch.utils.checkpoint as ckpt

    if not hasattr(ckpt, "CheckpointPolicy"):
        pytest.skip(f"torch {torch.__version__} has no selective checkpointing (torch >= 2.5)")
    CheckpointPolicy, checkpoint = ckpt.CheckpointPolicy, ckpt.checkpoint
    create_selective_checkpoint_contexts = ckpt.create_selective_checkpoint_contexts

    def save_casts(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten._to_copy.default else CheckpointPolicy.PREFER_RECOMPUTE

    grads = []
    for on in (False, True):
        m = _siblings(on)
        x0 = torch.randn(8, 8, requires_grad=True, generator=torch.Generator().manual_seed(1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = checkpoint(functools.partial(_attend, m), x0 * 2, use_reentrant=False,
                             context_fn=functools.partial(create_selective_checkpoint_contexts, save_casts))
        out.float().pow(2).sum().backward()
        grads.append([x0.grad, *(p.grad for p in m.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("kind", ["inference", "nested"])
def test_inference_tensors_and_nested_tensors_are_cast_as_autocast_casts_them(kind: str) -> None:
    """Features made under inference_mode (no version counter) and strided nested tensors (no view_as):
    each linear casts its own copy, as without the lever (both raised)."""
    outs = []
    for on in (False, True):
        m = _siblings(on)
        if kind == "inference":
            with torch.inference_mode():
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 2
        else:
            x = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], requires_grad=True) * 2
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = _attend(m, x)
        if kind == "inference":
            out.float().sum().backward()
            outs.append([out, *(p.grad for p in m.parameters())])
        else:
            outs.append(list(out.unbind()))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
