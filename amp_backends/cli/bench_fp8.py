"""The bench's fp8 modes: the training step with the fp8 recipe's Linear layers in fp8 under bf16
autocast, through a precision policy (``amp-fp8``) and through torchao called directly
(``torchao-fp8``) on the same layers, so the policy's cost is a ratio measured in the same run.
Where the device has no fp8 matmul (or torchao is missing), the rows say why, as TF32's do."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..precision.fp8 import engine as fp8
from ..precision.selectors import RECIPE as PRESET

if TYPE_CHECKING:
    from ..backend import Backend

__all__ = ["FP8_MODES", "fp8_unavailable", "make_fp8_steps"]

#: (mode name, how it runs)
FP8_MODES = (("amp-fp8", "amp-fp8"), ("torchao-fp8", "torchao-fp8"))
RECIPE = "tensorwise"
#: the layers converted: the recipe's choice (what the project recommends)
SELECTION: Any = PRESET


def fp8_unavailable(be: Backend) -> str | None:
    """Why the fp8 rows cannot be measured on this backend, or None."""
    if not be.fp8_recipes():
        return f"{be.name} has no fp8 matmul (NVIDIA compute capability 8.9+ and AMD MI300/MI350 have)"
    if torch.bfloat16 not in be.supported_dtypes():
        return f"fp8 training runs under bf16 autocast, which {be.name} does not have"
    return fp8.unavailable_reason()


def make_fp8_steps(be: Backend, model: nn.Module, loss_fn: Callable[..., torch.Tensor],
                   batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[dict[str, Callable[[], None]], str | None]:
    """The two fp8 steps on copies of ``model`` (each with its own AdamW), or why this model has no
    layer the recipe converts."""
    from ..precision.policy import precision_policy

    x, y = batch
    ours = copy.deepcopy(model)
    policy = precision_policy(ours, fp32=(), fp8=SELECTION, fp8_recipe=RECIPE, backend=be, example_inputs=x)
    chosen = set(policy.fp8)
    if not chosen:
        policy.remove()
        return {}, (f"no Linear layer of this model passes the {RECIPE} recipe (first and last layers, dimensions "
                    "not multiples of 16, layers below torchao's break-even stay out)")
    theirs = copy.deepcopy(model)
    fp8.engine().convert_to_float8_training(theirs, config=fp8.config(RECIPE, False),
                                            module_filter_fn=lambda module, fqn: fqn in chosen)

    def step_of(net: nn.Module, autocast: Callable[[], Any]) -> Callable[[], None]:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-5)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
        step.model, step.optimizer = net, opt  # type: ignore[attr-defined]  # what the ledger classifies
        return step

    return {
        "amp-fp8": step_of(ours, lambda: be.autocast(torch.bfloat16)),
        "torchao-fp8": step_of(theirs, lambda: torch.autocast(be.device_type, dtype=torch.bfloat16)),
    }, None
