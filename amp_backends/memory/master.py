"""Low-precision weights with float32 master copies that the optimizer updates: the classic recipe.

The model's parameters hold bfloat16 or float16 values (the forward and backward run on them, and
autocast makes no copies of them); for each such parameter a float32 master keeps the weight the
optimizer updates. :class:`MasterWeights` wraps the user's own optimizer: its parameter groups (the
same dicts: LR schedulers work) list the model's parameters, so the scaler unscales and checks the
low-precision gradients, clipping clips them; ``step()`` runs the wrapped optimizer's own math on the
masters (their gradients the float32 values of the model's), then copies the masters back, rounded.
Its ``state_dict`` is the wrapped optimizer's over the masters: the same format as that optimizer's over
a float32 model, so a checkpoint moves between a lean run and a plain one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["BLOCK_ELEMENTS", "MasterWeights"]

#: Elements of float32 master gradients that exist at once during a step (16 MiB; a larger parameter alone).
BLOCK_ELEMENTS = 2**22


class MasterWeights(torch.optim.Optimizer):
    """``optimizer``'s updates applied to float32 masters of the model's low-precision parameters
    (``masters``: parameter -> its float32 master; parameters without one are stepped as they are).

    Under a float16 loss scale it takes torch's fused-optimizer protocol: the scaler checks the float16
    gradients and hands over ``grad_scale`` and ``found_inf``; the step skips where found_inf is set and
    divides in float32, on the masters' gradients (so no small gradient is lost to a float16 unscale)."""

    #: the step takes ``grad_scale`` and ``found_inf`` (torch's fused protocol) and honours both
    _step_supports_amp_scaling = True
    amp_found_inf = "honours"
    #: its float16 gradients may be unscaled in place (clipping): the update is on float32 masters
    amp_master_weights = True

    def __init__(self, optimizer: torch.optim.Optimizer, masters: dict[torch.nn.Parameter, torch.Tensor]) -> None:
        # not torch's __init__: the groups stay the wrapped optimizer's own dicts
        self.optimizer = optimizer
        self.masters = masters
        #: master -> the model's parameter it stands for
        self._model_of = {m: p for p, m in masters.items()}
        self.defaults = optimizer.defaults
        self._optimizer_step_pre_hooks = getattr(optimizer, "_optimizer_step_pre_hooks", {})
        self._optimizer_step_post_hooks = getattr(optimizer, "_optimizer_step_post_hooks", {})

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def __repr__(self) -> str:
        return f"MasterWeights({self.optimizer!r}, {len(self.masters)} float32 masters)"

    @contextmanager
    def _on_masters(self) -> Iterator[None]:
        """The wrapped optimizer's groups list the masters while it works (its state is keyed by them)."""
        held = [group["params"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["params"] = [self.masters.get(p, p) for p in group["params"]]
        try:
            yield
        finally:
            for group, params in zip(self.optimizer.param_groups, held):
                group["params"] = params

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's step on the masters, their gradients the model's in float32; then the
        masters copied into the model's parameters. The float32 gradients exist a block of parameters at a
        time (:data:`BLOCK_ELEMENTS`), so the step never holds a float32 gradient of the whole model."""
        if closure is not None:
            raise RuntimeError("MasterWeights.step() takes no closure: run the forward and backward first")
        grad_scale, found_inf = self.__dict__.get("grad_scale"), self.__dict__.get("found_inf")
        if found_inf is not None and bool(found_inf.item()):
            return None  # an inf/NaN gradient: nothing moves (the scaler skips the step)
        inv = None if grad_scale is None else grad_scale.double().reciprocal().float()
        result = None
        with self._on_masters():
            groups = self.optimizer.param_groups
            held = [group["params"] for group in groups]
            try:
                for block in self._blocks(held):
                    for group, params in zip(groups, block):
                        group["params"] = params
                    scaled: list[tuple[torch.Tensor, torch.Tensor]] = []
                    for m in (m for params in block for m in params):
                        p = self._model_of.get(m)
                        if p is not None:
                            m.grad = None if p.grad is None else (p.grad.float() if inv is None
                                                                  else p.grad.float() * inv.to(p.device))
                        elif inv is not None and m.grad is not None:  # a float32 parameter: unscaled for the step
                            scaled.append((m, m.grad))
                            m.grad = m.grad * inv.to(m.device)
                    try:
                        result = self.optimizer.step()
                    finally:
                        for m, grad in scaled:
                            m.grad = grad
                        for m in (m for params in block for m in params):
                            p = self._model_of.get(m)
                            if p is not None:
                                m.grad = None
                                p.copy_(m)
            finally:
                for group, params in zip(groups, held):
                    group["params"] = params
        return result

    def _blocks(self, held: list[list[torch.Tensor]]) -> list[list[list[torch.Tensor]]]:
        """The groups' parameters in blocks of at most :data:`BLOCK_ELEMENTS` elements with a master (a
        parameter without one, and an oversized one, fits in any block), in order."""
        blocks: list[list[list[torch.Tensor]]] = [[[] for _ in held]]
        size = 0
        for gi, params in enumerate(held):
            for m in params:
                n = m.numel() if m in self._model_of else 0
                if size and size + n > BLOCK_ELEMENTS:
                    blocks.append([[] for _ in held])
                    size = 0
                blocks[-1][gi].append(m)
                size += n
        return blocks

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("MasterWeights: add the parameters before turning lean memory on (amp_backends.memory_lean), "
                           "or turn it off (remove()), add them, and turn it on again")

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state_dict, as over a float32 model."""
        with self._on_masters():
            return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state_dict of this optimizer, or of the same optimizer over the float32 model."""
        with self._on_masters():
            self.optimizer.load_state_dict(dict(state_dict))

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
