"""torchao's per-parameter compiled optimizer step with each compile wrapper built once: the same
parameters and state, bitwise, as its own step under the same random state, one wrapper in all."""

from __future__ import annotations

import pytest
import torch

from amp_backends.memory.compile_once import compile_once, uses_compile_per_call

from fp8_marks import needs_torchao


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(3):
        p = torch.nn.Parameter(torch.randn(8, 4, generator=g).bfloat16())
        p.grad = (torch.randn(8, 4, generator=g) * 1e-2).bfloat16()
        out.append(p)
    return out


@needs_torchao
def test_the_sr_step_bitwise_with_one_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchao.optim import _AdamW

    built = []
    real = torch.compile

    def counting(model=None, **options):  # type: ignore[no-untyped-def]
        built.append(model)
        return real(model, **options)

    monkeypatch.setattr(torch, "compile", counting)
    plain = _AdamW(_params(), lr=1e-2, bf16_stochastic_round=True)
    once = compile_once(_AdamW(_params(), lr=1e-2, bf16_stochastic_round=True))
    assert uses_compile_per_call(plain) and not uses_compile_per_call(torch.optim.AdamW(_params()))
    assert compile_once(once) is once and once.step is compile_once(once).step  # twice is a no-op
    for _ in range(2):
        torch.manual_seed(7)
        plain.step()
        torch.manual_seed(7)
        before = len(built)
        once.step()
        assert torch.compile is counting  # put back after the step
    assert len(built) - before == 0  # the second step built none
    assert sum(1 for _ in built) == 2 * 3 + 1  # plain: one per parameter per step; compile_once: one in all
    for p, q, start in zip(plain.param_groups[0]["params"], once.param_groups[0]["params"], _params()):
        assert torch.equal(p, q)
        assert not torch.equal(p, start)  # it moved
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(plain.state[p][k], once.state[q][k])
