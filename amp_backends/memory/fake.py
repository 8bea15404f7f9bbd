"""A training step counted without arithmetic: the model built on the meta device, its parameters
and buffers made again under ``FakeTensorMode`` (tied weights stay one object), the batch turned fake,
and the step run under the :class:`~.ledger.Ledger`. Fake tensors keep the device type they would have
(``cpu``), so autocast, its weight-cast cache and the CPU kernels' choices (flash attention, oneDNN)
are those of a real CPU step. The figures are a real step's where torch's fake kernel returns what the
CPU kernel returns, which is not everywhere: :data:`.ledger.FAKE_DIFFERS` lists the ops known to differ by more
than a few bytes, and the ledger warns, once an op, when a count on fake tensors meets one (measure such
a model with real tensors: ``measure(make, fake=False)``). Smaller known differences: under bfloat16 the
norms' saved statistics (a few bytes a channel or row) and ``_embedding_bag``'s offsets (8 bytes).

The meta device alone would not do: autocast does nothing on meta tensors and attention takes its
math path there (the full attention matrix), so a meta step's figures are not a CPU step's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .ledger import FAKE_DIFFERS, Ledger, MemoryReport

__all__ = ["FAKE_DIFFERS", "Setup", "measure", "on_meta_then_fake"]


@dataclass
class Setup:
    """One training step to count: ``step(ledger)`` runs it (zero_grad, forward, backward, optimizer
    step), naming its phases with ``ledger.phase(...)``; the rest says what the storages are."""

    model: nn.Module
    optimizer: Any
    step: Callable[[Ledger], None]
    #: tensors that exist before the step besides the model's parameters and buffers (the batch)
    inputs: tuple[Any, ...] = ()
    #: fp32 master weights held beside low-precision parameters, where the recipe keeps them
    master: Callable[[], list[torch.Tensor]] = field(default=lambda: [])
    #: the optimizer's state tensors (default: torch's ``optimizer.state``)
    state: Callable[[], list[torch.Tensor]] | None = None

    def optimizer_state(self) -> list[torch.Tensor]:
        if self.state is not None:
            return self.state()
        return [v for s in getattr(self.optimizer, "state", {}).values() for v in s.values() if isinstance(v, torch.Tensor)]


def on_meta_then_fake(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` on the meta device, then every parameter and buffer made again under the active mode
    (call it inside ``FakeTensorMode``), shared ones once: a tied LM head stays tied."""
    with torch.device("meta"):
        model = build()
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cpu"),
                                               p.requires_grad)
                module._parameters[name] = made[id(p)]  # type: ignore[assignment]  # a fake tensor stands in for the parameter
        for name, b in list(module._buffers.items()):
            if b is not None:
                if id(b) not in made:
                    made[id(b)] = torch.zeros(b.shape, dtype=b.dtype, device="cpu")
                module._buffers[name] = made[id(b)]
    return model


def measure(make: Callable[[], Setup], *, fake: bool = True, steps: int = 2) -> MemoryReport:
    """The ledger of the last of ``steps`` training steps (the first makes the optimizer's state): what
    ``make()`` builds, under ``FakeTensorMode`` (no arithmetic; build the model with
    :func:`on_meta_then_fake` inside ``make``) or for real."""
    from ..torch_private import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    with mode if mode is not None else torch.device("cpu"):
        setup = make()
        ledger = Ledger()
        params = list(setup.model.parameters())
        ledger.register([*setup.model.buffers(), *setup.inputs, *setup.master(), *setup.optimizer_state()],
                        params=params)
        with ledger:
            for _ in range(steps):
                ledger.restart_peak()
                setup.step(ledger)
        report = ledger.report(params=params, grads=[p.grad for p in params], optimizer=setup.optimizer_state(),
                               master=setup.master())
    return report
