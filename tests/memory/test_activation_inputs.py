"""Activations' inputs recomputed in backward from the up-projection's input
(``amp_backends.memory.activation_inputs``). On Transformers' GPT-2, BERT and Llama: gradients bitwise
those without the lever (fp32 and bf16 autocast, alone and with the activations' outputs recomputed,
second order, a second backward); the bytes saved for backward lower by exactly one tensor of the MLP's
inner width per layer (two with the outputs' lever), counted by the ledger and by a hook of our own;
the up-projection's matmul run once more a layer in backward, counted with a dispatch mode (once with
both levers: the remaking is shared); on a device whose stream is float32 (the simulated MLU) the same;
an edited weight refused; others' hooks stood aside for; compiled models untouched."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from amp_backends import torch_private
from amp_backends.memory import (UpProjectionEdited, fused_activations, memory_lean, recompute_activation_inputs,
                                 recompute_activation_outputs, substitutes)
from mlp_blocks import MlpBlocks
from sim_marks import needs_sim_device
from test_substitutes import (_ON_A_GPU_LIKE_DEVICE, MODELS, TOKENS, _assert_bitwise, _build, _lean_steps, _loss,
                              _saved_bytes, _step)

#: whether this torch can tell which saved-tensor hooks are in force (2.4 cannot: the lever does nothing)
ACTIVE = torch_private.top_saved_tensors_hooks is not None
LAYERS = 2


def _model(name: str, inputs: bool, outputs: bool) -> nn.Module:
    model = _build(name)
    fused_activations(model)  # GPT-2's GELU fused in every model compared: the levers under test are the others
    if inputs:
        recompute_activation_inputs(model)
    if outputs:
        recompute_activation_outputs(model)
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("outputs", [False, True], ids=["alone", "with-outputs"])
def test_gradients_are_bitwise_those_without_the_lever(name: str, dtype: torch.dtype | None, outputs: bool) -> None:
    x = torch.randint(0, 64, TOKENS)
    plain = _step(_model(name, False, False), name, dtype, x)
    _assert_bitwise(plain, _step(_model(name, True, outputs), name, dtype, x))


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_second_order_and_a_second_backward_are_bitwise(name: str) -> None:
    """A gradient penalty (the remaking differentiable under ``create_graph``), and two backwards of one
    graph (``retain_graph``: the second remakes again, nothing was kept for it)."""
    x = torch.randint(0, 64, TOKENS)
    _assert_bitwise(_step(_model(name, False, True), name, torch.bfloat16, x, create_graph=True),
                    _step(_model(name, True, True), name, torch.bfloat16, x, create_graph=True))
    grads = []
    for inputs in (False, True):
        model = _model(name, inputs, True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, name, x)
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    _assert_bitwise(*grads)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_tensor_of_the_inner_width_less_per_layer_and_two_with_the_outputs(name: str) -> None:
    """Counted by the ledger and by a saved-tensor hook of our own: the bytes saved for backward lower by
    exactly layers x tokens x inner width x 2 (bf16) with this lever, twice that with the outputs' lever
    too (where that one alone saves one such tensor: the two do not count the same tensor twice)."""
    x = torch.randint(0, 64, TOKENS)
    plain = _saved_bytes(_model(name, False, False), name, x)
    alone = _saved_bytes(_model(name, True, False), name, x)
    outputs = _saved_bytes(_model(name, False, True), name, x)
    both = _saved_bytes(_model(name, True, True), name, x)
    unit = LAYERS * TOKENS[0] * TOKENS[1] * MODELS[name][1] * 2 if ACTIVE else 0
    for counted in (0, 1):
        assert plain[counted] - alone[counted] == unit, (plain, alone)
        assert plain[counted] - outputs[counted] == unit, (plain, outputs)
        assert plain[counted] - both[counted] == 2 * unit, (plain, both)


class _Matmuls(TorchDispatchMode):
    """Counts the matmuls dispatched (mm, addmm, bmm, baddbmm) and the elements they make."""

    NAMES = {"mm", "addmm", "bmm", "baddbmm"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += func._schema.name.split("::")[-1] in self.NAMES
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_up_projection_runs_once_more_a_layer_in_the_backward(name: str) -> None:
    """Matmuls dispatched in the backward, counted directly: one more a layer with the lever, alone or
    with the outputs' lever (whose remaking of the activation's output goes through the same one)."""
    x = torch.randint(0, 64, TOKENS)

    def backward_matmuls(model: nn.Module) -> int:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = _loss(model, name, x)
        counter = _Matmuls()
        with counter:
            loss.backward()
        return counter.count

    plain = backward_matmuls(_model(name, False, True))
    extra = LAYERS if ACTIVE else 0
    assert backward_matmuls(_model(name, True, False)) == plain + extra
    assert backward_matmuls(_model(name, True, True)) == plain + extra


@needs_sim_device
def test_on_a_device_whose_autocast_runs_layer_norm_in_float32_the_input_is_cast_once_and_kept_once() -> None:
    """The simulated MLU (layer_norm in float32, as CUDA's): the up-projection's input is float32, cast by
    the lever's pre-hook as autocast casts it. The lean step with this lever on as well keeps exactly
    layers x tokens x inner x 2 bytes less than with the others alone, with bitwise the same loss and gradients."""
    from amp_backends.testing import sim_packages_path

    from conftest import run_json

    script = _ON_A_GPU_LIKE_DEVICE.replace("activation_outputs=on, shared_casts=on",
                                           "activation_outputs=True, shared_casts=True, activation_inputs=on")
    assert script != _ON_A_GPU_LIKE_DEVICE
    out = run_json(script, [sim_packages_path("mlu")], {"AMP_SIM_MLU_CHIP": "MLU590"})
    assert out["True"]["norm_out"] == ["torch.float32"], "the simulated device's LayerNorm runs in float32, as CUDA's"
    expected = LAYERS * 32 * 96 * 2 if ACTIVE else 0
    assert out["False"]["saved"] - out["True"]["saved"] == expected, out
    assert out["False"]["loss"] == out["True"]["loss"] and out["False"]["grads"] == out["True"]["grads"]
    assert ("2 activations' inputs recomputed" in out["True"]["repr"]) == ACTIVE, out["True"]["repr"]


@pytest.mark.skipif(not ACTIVE, reason="this torch cannot tell which saved-tensor hooks are in force: nothing is substituted")
def test_a_weight_edited_in_place_before_the_backward_is_refused() -> None:
    """The up-projection's weight changed under ``no_grad`` between the forward and the backward: the
    backward refuses, naming the weight and the way out, where it would have run the layer on new weights."""
    model = _model("bert", True, False)
    x = torch.randint(0, 64, TOKENS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _loss(model, "bert", x)
    with torch.no_grad():
        model.bert.encoder.layer[1].intermediate.dense.weight.mul_(2)
    with pytest.raises(UpProjectionEdited, match=r"up-projection's weight \(\(96, 32\), torch.float32\).*activation_inputs=False"):
        loss.backward()


def test_through_memory_lean_with_masters_off_by_default_and_removed() -> None:
    """Off unless asked; asked, two bf16 steps with float32 masters give bitwise the losses and weights of
    the same run without it; named in the handle's repr; ``remove()`` takes its hooks off."""
    x = torch.randint(0, 64, TOKENS)
    runs = []
    for on in (False, True):
        model = _build("bert")
        lean = memory_lean(model, torch.optim.AdamW(model.parameters(), lr=1e-2), weights=torch.bfloat16,
                           activation_inputs=on)
        assert ("2 activations' inputs recomputed" in repr(lean)) == (on and ACTIVE), repr(lean)
        losses = _lean_steps(lean, model, "bert", x, 2)
        runs.append((torch.stack(losses), {k: v.clone() for k, v in lean.state_dict().items()}))
        lean.remove()
        assert not [m for m in model.modules() if m._forward_hooks or m._forward_pre_hooks]
    _assert_bitwise(*runs)


def test_others_hooks_on_the_up_projection_are_stood_aside_for() -> None:
    """A forward hook of the user's on one up-projection: that layer's output is saved as it is (its hook
    saw and may have replaced it), the lever names it, and the gradients are bitwise the plain model's."""
    x = torch.randint(0, 64, TOKENS)
    plain = _step(_model("bert", False, False), "bert", torch.bfloat16, x)
    model = _build("bert")
    dense = model.bert.encoder.layer[0].intermediate.dense
    dense.register_forward_hook(lambda m, a, o: None)
    lean = memory_lean(model, weights=None, activation_inputs=True, activation_outputs=False)
    with pytest.warns(Warning, match="activation_inputs lever stands aside on a Linear"):
        result = _step(model, "bert", torch.bfloat16, x)
    _assert_bitwise(plain, result)
    assert list(lean.stood_aside) == ["bert.encoder.layer.0.intermediate.dense"], lean.stood_aside


def test_a_compiled_model_is_left_to_the_compiler() -> None:
    """Under ``torch.compile`` the hooks do nothing (the compiler decides what to save): the gradients are
    the eager plain model's."""
    x = torch.randint(0, 64, TOKENS)
    plain = _step(_model("gpt2", False, False), "gpt2", None, x)
    model = _model("gpt2", True, True)
    compiled = torch.compile(model, backend="aot_eager")
    loss = _loss(compiled, "gpt2", x)
    loss.backward()
    torch.testing.assert_close(loss.detach(), plain[0])
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, plain[1][n], rtol=1e-5, atol=1e-6)


class _SavedBytes:
    """A saved-tensor hook pair counting the bytes of the distinct storages saved, the model's weights left out."""

    def __init__(self, model: nn.Module) -> None:
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.weights:
            self.seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.seen.values())


def _remakings() -> set[int]:
    """The remakings alive now (other tests' graphs among them)."""
    gc.collect()
    return {id(r) for r in gc.get_objects() if isinstance(r, substitutes._Remade)}


def _holding(earlier: set[int]) -> list[object]:
    """The remakings made since ``earlier`` that still hold a tensor."""
    return [r for r in gc.get_objects() if isinstance(r, substitutes._Remade) and id(r) not in earlier
            and r.value is not None]


@pytest.mark.skipif(not ACTIVE, reason="this torch cannot tell which saved-tensor hooks are in force: nothing is substituted")
def test_a_stack_of_linears_and_gelus_chains_its_remakings_within_one_mlp() -> None:
    """``Linear, GELU, Linear, GELU, Linear`` (the bench's ``mlp``): remakings chain within one MLP only
    (chained back to the stack's input, the first backward node would remake the whole stack at once).
    The second up-projection's input is the first GELU's remade output, narrower kept: the saves are the
    stack's input, the second GELU's 16-wide input and the output (the loss's), and the weights alone
    (every other saved tensor remade); one linear runs once more in the backward (counted directly),
    and the gradients are bitwise the plain stack's; after the backward no remaking holds a tensor."""

    def stack() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 2))

    x = torch.randn(4, 8)
    results = []
    for on in (False, True):
        model = stack()
        if on:
            recompute_activation_inputs(model)
            recompute_activation_outputs(model)
        saved = _SavedBytes(model)
        earlier = _remakings()
        with saved.hooks:
            loss = model(x).pow(2).mean()
        counter = _Matmuls()
        with counter:
            loss.backward(retain_graph=True)  # the graph kept: what the remakings hold after it is theirs
        assert not _holding(earlier), "each remaking dropped after its last use"
        results.append((saved.bytes, counter.count,
                        (loss.detach(), {n: p.grad for n, p in model.named_parameters()})))
    (plain_saved, plain_mm, plain), (lean_saved, mm, lean) = results
    assert plain_saved == 4 * (8 + 32 + 32 + 16 + 16 + 2) * 4, plain_saved  # (and the output, for the loss's pow)
    assert lean_saved == 4 * (8 + 16 + 2) * 4, "the stack's input, the second GELU's input (and the output)"
    assert mm == plain_mm + 1
    _assert_bitwise(plain, lean)


@pytest.mark.skipif(not ACTIVE, reason="this torch cannot tell which saved-tensor hooks are in force: nothing is substituted")
def test_under_fsdp2_on_two_ranks_the_gradients_are_the_same_and_each_block_remakes_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """FSDP2's fully_shard on each MLP block (held in a ModuleList) and on the root, the levers turned on
    before: each block's up-projection runs once more in the backward (the MLP is the block: its scope is
    opened there, not in the list, which is never called), and the full gradients are bitwise those
    without the levers, on both ranks."""
    from torchrun import TORCH_MINOR, torchrun

    if TORCH_MINOR < (2, 6):
        pytest.skip("fully_shard on CPU (gloo) needs torch 2.6+: torch 2.4's creates CUDA streams")
    proc = torchrun(Path(__file__).parent.parent / "activation_inputs_fsdp_worker.py", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["same"] and result["remakes"] == 2, result


@pytest.mark.skipif(not ACTIVE, reason="this torch cannot tell which saved-tensor hooks are in force: nothing is substituted")
@pytest.mark.parametrize("lever", ["inputs", "outputs"])
def test_in_a_module_list_of_mlp_blocks_each_lever_keeps_one_tensor_less_a_block(lever: str) -> None:
    """MLP blocks held in a ``ModuleList``, which is never called: each lever opens its scopes in the block
    itself (before, the outputs' lever chose the list and saved nothing there), one tensor of the inner
    width less a block, counted directly."""
    x = torch.randn(4, 8)

    def saved(on: bool) -> int:
        torch.manual_seed(0)
        model = MlpBlocks()
        if on:
            (recompute_activation_inputs if lever == "inputs" else recompute_activation_outputs)(model)
        counted = _SavedBytes(model)
        with counted.hooks:
            model(x).pow(2).mean()
        return counted.bytes

    assert saved(False) - saved(True) == 2 * 4 * 32 * 4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))


def _grads_of(model: nn.Module, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # type: ignore[no-untyped-def]
    out = run(model)
    out.float().pow(2).mean().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_a_layer_a_precision_policy_runs_in_float32_gets_its_input_as_it_came() -> None:
    """The up-projection run in float32 by a precision policy, a float32 input under bf16 autocast: the
    lever neither casts its input (the float32 forward would compute on a rounded input) nor tags its
    output; output and gradients bitwise those without the lever."""
    from amp_backends import precision_policy

    x = torch.randn(4, 8)
    results = []
    for on in (False, True):
        model = _mlp()
        precision_policy(model, fp32=["0"])
        if on:
            recompute_activation_inputs(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_grads_of(model, lambda m: m(x)))
    _assert_bitwise(*results)


def test_an_input_edited_in_place_before_the_activation_reads_the_output_is_not_remade_from() -> None:
    """``h = up(x); x.mul_(2); down(act(h))`` with ``up`` frozen (so autograd keeps no ``x`` and allows the
    edit): the lever keeps ``h`` itself, and the gradients are those without it."""
    results = []
    for on in (False, True):
        model = _mlp()
        model[0].requires_grad_(False)
        if on:
            recompute_activation_inputs(model)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()

        def run(m: nn.Module, x: torch.Tensor = x) -> torch.Tensor:
            y = x * 1.0
            h = m[0](y)
            y.mul_(2)
            return m[2](m[1](h)) + y.sum()

        out, grads = _grads_of(model, run)
        results.append((out, {**grads, "x": x.grad}))
    _assert_bitwise(*results)


def test_weights_that_are_not_the_layers_parameters_are_left_alone() -> None:
    """``torch.func.functional_call`` hands the layers plain tensors as weights: nothing is tagged (the
    backward would have run the layer on its own parameters), and the gradients are those without the lever."""
    x = torch.randn(4, 8)
    results = []
    for on in (False, True):
        model = _mlp()
        if on:
            recompute_activation_inputs(model)
        params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
        out = torch.func.functional_call(model, params, (x,))
        out.pow(2).mean().backward()
        results.append((out.detach(), {n: p.grad for n, p in params.items()}))
    _assert_bitwise(*results)


@pytest.mark.skipif(not ACTIVE, reason="this torch cannot tell which saved-tensor hooks are in force: nothing is substituted")
def test_with_shared_casts_where_the_up_projection_reads_the_second_copy() -> None:
    """``down(act(up(x)) * gate(x))``, ``gate`` first, a float32 input under bf16 autocast: ``up`` is handed
    a view of ``gate``'s copy of ``x`` (shared casts), and ``up``'s output is remade from that view.
    Gradients bitwise those without the levers; no remaking holds a tensor after the backward."""
    from amp_backends.memory import share_casts

    class GatedMlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate, self.up, self.act, self.down = nn.Linear(8, 32), nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g = self.gate(x)
            return self.down(self.act(self.up(x)) * g)

    x = torch.randn(4, 8)
    results = []
    for on in (False, True):
        torch.manual_seed(0)
        model = GatedMlp()
        if on:
            share_casts(model)
            recompute_activation_inputs(model)
            recompute_activation_outputs(model)
        earlier = _remakings()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        counter = _Matmuls()
        with counter:
            out.float().pow(2).mean().backward(retain_graph=True)
        assert not _holding(earlier)
        results.append((counter.count, (out.detach(), {n: p.grad for n, p in model.named_parameters()})))
    assert results[1][0] == results[0][0] + 1, "up once more"
    _assert_bitwise(results[0][1], results[1][1])
