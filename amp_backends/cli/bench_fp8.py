"""The bench's fp8 modes: the training step with the fp8 recipe's Linear layers in fp8 under bf16
autocast, through a precision policy (``amp-fp8``) and through torchao called directly
(``torchao-fp8``) on the same layers, so the policy's cost is a ratio measured in the same run; and
``bf16-fp8-baseline``, the same model under bf16 autocast alone, which the fp8 rows are compared with.

torchao documents float8 training under ``torch.compile`` (eager, its scaling and casts are separate
kernels that cost more than the fp8 matmul saves): on accelerators all three models are compiled the
same way (``torch.compile(model)``, the loss and optimizer eager), and only compiled rows give an fp8
verdict. Eager rows (a CPU, where inductor would take minutes per model) are measured and labelled,
with no verdict. fp8 pays at layer widths of a few thousand (the ``llama-block`` bench model); the
recipe leaves smaller layers out. Where the device has no fp8 matmul (or torchao is missing), the rows
say why, as TF32's do."""

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

__all__ = ["COMPILE", "FP8_MODES", "compiled", "fp8_unavailable", "make_fp8_steps"]

#: (mode name, how it runs)
FP8_MODES = (("amp-fp8", "amp-fp8"), ("torchao-fp8", "torchao-fp8"), ("bf16-fp8-baseline", "fp8-baseline"))
#: Whether the fp8 rows are compiled: None compiles on accelerators (as torchao documents), not on a CPU.
COMPILE: bool | None = None
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


def compiled(be: Backend) -> bool:
    """Whether this backend's fp8 rows (and their bf16 baseline) run compiled."""
    return COMPILE if COMPILE is not None else be.device_type != "cpu"


def make_fp8_steps(be: Backend, model: nn.Module, loss_of: Callable[[nn.Module, Any, Any], torch.Tensor],
                   batch: tuple[torch.Tensor, torch.Tensor], modes: Any = None
                   ) -> tuple[dict[str, Callable[[], None]], str | None]:
    """The fp8 steps and their bf16 baseline on copies of ``model`` (each with its own AdamW; ``modes``:
    the names wanted, None for all), compiled where :func:`compiled` says, or why this model has no
    layer the recipe converts. ``loss_of(model, inputs, targets)`` is the model's loss."""
    from ..precision.policy import precision_policy

    x, y = batch
    ours = copy.deepcopy(model)
    policy = precision_policy(ours, fp32=(), fp8=SELECTION, fp8_recipe=RECIPE, backend=be, example_inputs=x)
    chosen = set(policy.fp8)
    if not chosen:
        policy.remove()
        return {}, (f"no Linear layer of this model passes the {RECIPE} recipe (first and last layers, dimensions "
                    "not multiples of 16, layers below torchao's break-even stay out)")
    wanted = {name for name, _ in FP8_MODES} if modes is None else set(modes)
    compile_them = compiled(be)

    def step_of(net: nn.Module, autocast: Callable[[], Any]) -> Callable[[], None]:
        opt = torch.optim.AdamW(net.parameters(), lr=1e-5)
        run = torch.compile(net) if compile_them else net

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = loss_of(run, x, y)
            loss.backward()
            opt.step()
        step.model, step.optimizer = net, opt  # type: ignore[attr-defined]  # what the ledger classifies
        step.compiled = compile_them  # type: ignore[attr-defined]
        return step

    torch_bf16 = lambda: torch.autocast(be.device_type, dtype=torch.bfloat16)  # noqa: E731
    steps: dict[str, Callable[[], None]] = {}
    if "amp-fp8" in wanted:
        steps["amp-fp8"] = step_of(ours, lambda: be.autocast(torch.bfloat16))
    else:
        policy.remove()
    if "torchao-fp8" in wanted:
        theirs = copy.deepcopy(model)
        fp8.engine().convert_to_float8_training(theirs, config=fp8.config(RECIPE, False),
                                                module_filter_fn=lambda module, fqn: fqn in chosen)
        steps["torchao-fp8"] = step_of(theirs, torch_bf16)
    if "bf16-fp8-baseline" in wanted:
        steps["bf16-fp8-baseline"] = step_of(copy.deepcopy(model), torch_bf16)
    return steps, None
