"""selective_recompute under a hostile review's uses, each against the same model without the lever: a
GPT-2 decoding with grad enabled (eval mode) fills its key-value cache and gives the plain model's next
logits; in training a cache asked for is dropped with a warning naming ``use_cache``, the loss and
gradients the plain model's; blocks holding BatchNorm (``momentum=None``, whose running statistics read
``num_batches_tracked``, and the default momentum) end three steps with the plain model's buffers, loss
and gradients, bitwise. Hooks on modules inside a block run again in backward (documented): pinned."""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from amp_backends.memory import recompute
from amp_backends.memory.recompute import selective_recompute, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))

VOCAB = 128
PROMPT = 8


# -- GPT-2 and its key-value cache ---------------------------------------------------------------
def _gpt2() -> nn.Module:
    """A tiny GPT2LMHeadModel without dropout (the cache's own path is what differs, not the masks)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _cache_kwarg(model: nn.Module) -> str:
    """The name this Transformers gives the model's cache argument (``cache`` from 5.x, else
    ``past_key_values``)."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _returned_cache(out: Any) -> Any:
    """The cache a forward returned, whichever name this Transformers gives it."""
    return out.cache if hasattr(out, "cache") else out.past_key_values


def _cached_tokens(cache: Any) -> int:
    """How many positions a returned cache holds (0 for none)."""
    if cache is None:
        return 0
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    return int(cache[0][0].shape[-2])  # the legacy tuple of (key, value) per layer


def _ours(caught: list[warnings.WarningMessage]) -> list[str]:
    """The lever's own warnings among ``caught``."""
    return [str(w.message) for w in caught if "selective_recompute" in str(w.message)]


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def test_decoding_with_grad_enabled_in_eval_mode_fills_the_cache_and_gives_the_plain_next_logits() -> None:
    """Eval mode, grad enabled (a validation loop or an RL rollout without no_grad): the prompt's
    forward returns a cache holding the prompt's tokens, as the plain model's does, and the next
    token's logits, computed from that cache, are the plain model's bitwise; the lever says nothing."""
    plain = _gpt2().eval()
    lever = copy.deepcopy(plain)
    selective_recompute(lever)
    kw = _cache_kwarg(plain)
    ids = _ids()
    assert torch.is_grad_enabled()
    runs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for model in (plain, lever):
            out = model(ids, use_cache=True)
            cache = _returned_cache(out)
            after_prompt = _cached_tokens(cache)
            token = out.logits[:, -1:].argmax(-1) if not runs else runs[0][2]  # the plain model's choice, both
            step = model(token, **{kw: cache}, use_cache=True)
            runs.append((out.logits.detach(), after_prompt, token, step.logits.detach(),
                         _cached_tokens(_returned_cache(step))))
    assert _ours(caught) == [], "decoding in eval mode is no misuse: nothing to say"
    (p_logits, p_len, _, p_next, p_len2), (l_logits, l_len, _, l_next, l_len2) = runs
    assert p_len == l_len == PROMPT, (p_len, l_len)
    assert p_len2 == l_len2 == PROMPT + 1, (p_len2, l_len2)
    assert torch.equal(l_logits, p_logits)
    assert torch.equal(l_next, p_next), f"next-token logits differ: max {(l_next - p_next).abs().max().item()}"


def test_a_cache_asked_for_in_training_is_dropped_with_one_warning_and_the_step_is_the_plain_models(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Training with use_cache=True (GPT-2's default): the lever warns, once, naming use_cache; the
    loss and every gradient are bitwise the plain model's (which fills its cache); the lever's model
    returns no cached positions, as documented (transformers' gradient checkpointing does the same)."""
    monkeypatch.setattr(recompute, "_CACHE_WARNED", [], raising=False)  # the once-flag, afresh
    plain = _gpt2().train()
    lever = copy.deepcopy(plain)
    selective_recompute(lever)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    ref = plain(ids, labels=ids, use_cache=True)
    ref.loss.backward()
    torch.manual_seed(3)
    with pytest.warns(RuntimeWarning, match="use_cache"):
        ours = lever(ids, labels=ids, use_cache=True)
    assert torch.equal(ours.loss.detach(), ref.loss.detach()), (ours.loss.item(), ref.loss.item())
    ours.loss.backward()
    for (name, a), b in zip(lever.named_parameters(), plain.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad), f"{name}: max {(a.grad - b.grad).abs().max().item()}"
    assert _cached_tokens(_returned_cache(ref)) == 16
    assert _cached_tokens(_returned_cache(ours)) == 0, "documented: the cache stays empty under the lever"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lever(ids, labels=ids, use_cache=True)
    assert _ours(caught) == [], "said once per process"


# -- blocks with in-place buffer updates ---------------------------------------------------------
class _BnBlock(nn.Module):
    """A residual block whose BatchNorm writes its buffers in place in every training forward."""

    def __init__(self, momentum: float | None) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16, momentum=momentum)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.nn.functional.gelu(self.bn(self.lin(x))))


class _BnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # momentum=None: a cumulative average read from num_batches_tracked; 0.1: torch's default
        self.blocks = nn.ModuleList([_BnBlock(None), _BnBlock(0.1), _BnBlock(None)])
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train(model: _BnNet, steps: int = 3) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """``steps`` SGD steps on fixed data and dropout seeds: each step's loss and gradients."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    out = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad()
        torch.manual_seed(10 + step)  # the dropout masks' seed
        loss = model(x).square().mean()
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        opt.step()
    return out


def test_batchnorm_buffers_loss_and_gradients_are_the_plain_models_after_three_steps() -> None:
    """BatchNorm1d(momentum=None) and the default momentum in recomputed blocks, 3 training steps:
    num_batches_tracked, running_mean and running_var end bitwise as without the lever (the replay in
    backward used to count every batch twice), and each step's loss and gradients are bitwise equal.
    Hooks: the block's own run once per forward; a hook on a module inside the block runs again with
    the replay (2x, as documented)."""
    torch.manual_seed(0)
    plain = _BnNet().train()
    lever = copy.deepcopy(plain)
    handle = selective_recompute(lever)
    assert handle.blocks == tuple(lever.blocks)
    calls: dict[str, int] = {}

    def counter(key: str) -> Any:
        return lambda module, args, output: calls.__setitem__(key, calls.get(key, 0) + 1)

    for name, model in (("plain", plain), ("lever", lever)):
        model.blocks[0].lin.register_forward_hook(counter(f"{name} inner"))
        model.blocks[0].register_forward_hook(counter(f"{name} block"))
    ref, ours = _train(plain), _train(lever)
    for step, ((rl, rg), (ol, og)) in enumerate(zip(ref, ours)):
        assert torch.equal(ol, rl), (step, ol.item(), rl.item())
        assert all(torch.equal(a, b) for a, b in zip(og, rg)), f"gradients differ at step {step}"
    for i, (p, q) in enumerate(zip(plain.blocks, lever.blocks)):
        assert int(q.bn.num_batches_tracked) == int(p.bn.num_batches_tracked) == 3, i
        assert torch.equal(q.bn.running_mean, p.bn.running_mean), i
        assert torch.equal(q.bn.running_var, p.bn.running_var), i
    assert all(torch.equal(a, b) for a, b in zip(lever.parameters(), plain.parameters()))
    assert calls["plain block"] == calls["lever block"] == 3, calls
    assert calls["plain inner"] == 3 and calls["lever inner"] == 6, calls


class _ScaledBlock(nn.Module):
    def __init__(self, shared: torch.Tensor | None = None) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8) if shared is None else shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.lin(x))) * self.scale + x


class _ScaledNet(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ScaledBlock(), _ScaledBlock()])
        if tied:
            self.blocks[1].scale = self.blocks[0].scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.blocks[1].scale  # the parent reads a block's buffer, saved for its own backward
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


@pytest.mark.parametrize("tied", [False, True], ids=["read-outside", "tied-across-blocks"])
def test_buffers_put_back_after_the_replay_move_no_version_counter(tied: bool) -> None:
    """The replay's buffers are put back without moving their version counters: a buffer the parent
    saved for its backward (or one two blocks share) used to fail autograd's version check mid-backward.
    Gradients and buffers bitwise the plain model's."""
    runs = []
    for lever in (False, True):
        torch.manual_seed(0)
        model = _ScaledNet(tied)
        if lever:
            selective_recompute(model, blocks=list(model.blocks))
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        model(x).backward()
        runs.append(([p.grad for p in model.parameters()], list(model.buffers()), x.grad))
    (rg, rb, rx), (og, ob, ox) = runs
    assert all(torch.equal(a, b) for a, b in zip(og, rg)) and torch.equal(ox, rx)
    assert all(torch.equal(a, b) for a, b in zip(ob, rb))
