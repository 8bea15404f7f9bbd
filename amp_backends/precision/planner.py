"""The plan chosen by measurement: each eligible Linear layer in the cheapest format
whose measured error stays within a budget.

    plan = amp_backends.plan_precision(model, example_inputs, loss_fn, budget=0.05)
    plan.save("plan.json")            # review, edit
    amp_backends.precision_policy(model, plan=amp_backends.PrecisionPlan.load("plan.json"))

How it decides (:func:`plan_precision`): the model runs once in float32 on the example inputs (its
buffers, random state and gradients untouched); each Linear layer's input ``x``, weight ``W`` and
output gradient ``gy`` are kept. For every candidate format (:data:`.formats.PLAN_FORMATS`) the
layer's three matmuls run on the operands as that format quantizes them (:mod:`.quantize`, torchao's
numerics), their results rounded to the dtype they come out in; the layer's error in the format is the
largest relative error (``||approx - exact|| / ||exact||``) of its output, input gradient and weight
gradient against float32. Each layer gets the first format in :data:`.formats.COST_ORDER` (cheapest
first) whose error is at most ``budget`` and that it may use: 8-bit formats need a device that runs
them (or ``emulate=True``), shapes they take, and are kept off the first and last Linear layers the
model runs and the head (the recipe's rules), and, on hardware (not emulated), off layers below
torchao's measured break-even for the recipe; 16-bit formats other than the autocast dtype would need a
second autocast dtype and are measured only. float32 always qualifies. Each layer's share of the
step's matmul FLOPs (forward and backward, counted by torch's FlopCounterMode) is recorded, and, where
torchao is usable, the whole plan applied at once (emulated) is compared with float32 on the example
batch: the relative error of the loss and of the gradients (``end_to_end``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..torch_private import tree_leaves
from .formats import COST_ORDER, DTYPES, PLAN_FORMATS, RECIPE_OF, check_formats, dtype_format, spec
from .plan import LayerPlan, PrecisionPlan
from .quantize import MX_BLOCK, qdq

__all__ = ["layer_error", "plan_precision"]


# -- measuring ----------------------------------------------------------------------------------
def _rel(approx: torch.Tensor, exact: torch.Tensor) -> float:
    denom = exact.double().norm()
    diff = (approx.double() - exact.double()).norm()
    if not torch.isfinite(diff):
        return math.inf
    return float(diff / denom) if denom > 0 else (0.0 if diff == 0 else math.inf)


def layer_error(x: torch.Tensor, weight: torch.Tensor, gy: torch.Tensor | None, fmt: str, out_dtype: torch.dtype) -> float:
    """The largest relative error of a Linear's output, input gradient and weight gradient in ``fmt``
    against float32, from its 2-D input ``x`` (M, K), ``weight`` (N, K) and output gradient ``gy`` (M, N)."""
    x, w = x.float(), weight.float()
    rounded = DTYPES[fmt] if fmt in DTYPES else out_dtype

    def q(t: torch.Tensor, operand: str, axis: int) -> torch.Tensor:
        return qdq(t, spec(fmt, operand), axis)[0]

    errs = [_rel((q(x, "fwd.input", -1) @ q(w, "fwd.weight", -1).t()).to(rounded), x @ w.t())]
    if gy is not None:
        g = gy.float()
        errs.append(_rel((q(g, "dgrad.grad_output", -1) @ q(w, "dgrad.weight", 0)).to(rounded), g @ w))
        errs.append(_rel((q(g, "wgrad.grad_output", 0).t() @ q(x, "wgrad.input", 0)).to(rounded), g.t() @ x))
    return max(errs)


def _capture(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
             names: list[str]) -> tuple[dict[str, dict[str, Any]], float]:
    """One float32 step on ``inputs`` (nothing in the model changes): each named layer's first input,
    weight and output gradient, its matmul FLOPs summed over its calls; and the step's matmul FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..tracing.isolation import call_args, untouched

    seen: dict[str, dict[str, Any]] = {n: {"flops": 0.0} for n in names}
    handles = []

    def hook_for(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            x = args[0].detach()
            rec = seen[name]
            m, k, n = x.numel() // x.shape[-1], x.shape[-1], module.weight.shape[0]
            rec["flops"] += 2.0 * m * k * n * (1 + int(module.weight.requires_grad) + int(args[0].requires_grad))
            if "x" in rec:
                return
            rec["x"], rec["w"] = x.reshape(-1, k), module.weight.detach()
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(lambda g: rec.__setitem__("gy", g.detach().reshape(-1, n)))
        return hook

    for name in names:
        handles.append(model.get_submodule(name).register_forward_hook(hook_for(name)))
    args, kwargs = call_args(inputs)
    device = next((t.device.type for t in model.parameters()), "cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    try:
        with untouched(model, device), FlopCounterMode(display=False) as counter:
            with torch.autocast(device, enabled=False):
                out = model(*args, **kwargs)
                loss = _loss(out, loss_fn)
            if params and loss.requires_grad:
                torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return seen, float(counter.get_total_flops())


def _loss(out: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    if loss_fn is not None:
        loss = loss_fn(out)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"plan_precision(loss_fn=...) must return a scalar tensor, got "
                             f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}")
        return loss.float().reshape(())
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().mean() for t in leaves)  # type: ignore[return-value]  # a sum of 0-dim tensors is a tensor


def _availability(backend: Any, fmts: tuple[str, ...], emulate: bool) -> dict[str, str]:
    """8-bit format -> why it cannot be chosen on ``backend`` (no torchao, no such matmul), for those it cannot."""
    from .fp8 import engine
    from .fp8.mx import MX_RECIPES

    out: dict[str, str] = {}
    for fmt in fmts:
        if fmt not in RECIPE_OF:
            continue
        recipe = RECIPE_OF[fmt]
        why = engine.mx_unavailable_reason() if recipe in MX_RECIPES else engine.unavailable_reason()
        if why is None:
            try:
                engine.check_device(backend, recipe, emulate)
            except engine.Fp8UnavailableError as exc:
                why = str(exc).split(": ")[0] + " (measured only; emulate=True to plan it for tests)"
        if why is not None:
            out[fmt] = why
    return out


def plan_precision(model: nn.Module, example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
                   budget: float = 0.05, formats: str | tuple[str, ...] = PLAN_FORMATS, dtype: torch.dtype | str = "bf16",
                   emulate: bool = False, backend: Any = None, recipe_rules: bool = True,
                   verify: bool = True) -> PrecisionPlan:
    """Measure every Linear layer of ``model`` on ``example_inputs`` (and ``loss_fn(output)``, a scalar;
    default: the mean of the outputs) in each of ``formats`` and plan each in the cheapest whose error is
    at most ``budget`` (module docstring: how), for autocast in ``dtype``. ``emulate``: 8-bit formats
    may be planned on a device without them (their numerics, for tests). ``recipe_rules``: keep the
    first and last Linear layers the model runs and the head out of 8 bits. ``verify``: apply the plan
    to a copy and measure it against float32 (needs torchao where the plan has 8-bit layers).
    Nothing in ``model`` changes."""
    from ..registry.registry import resolve_backend
    from .fp8 import engine
    from .fp8.convert import layer_reason
    from .fp8.mx import MX_RECIPES, tokens_reason
    from .selectors import recipe_head, strip, wrapper_prefix

    if not isinstance(model, nn.Module):
        raise TypeError(f"plan_precision takes a torch.nn.Module, got {type(model).__name__}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not (budget > 0 and math.isfinite(budget)):
        raise ValueError(f"plan_precision(budget=...) takes a positive relative error (e.g. 0.05 for 5%), got {budget!r}")
    fmts = check_formats(formats, "plan_precision(formats=...)")
    own = dtype if isinstance(dtype, str) else dtype_format(dtype)
    if own not in ("bf16", "fp16"):
        raise ValueError(f"plan_precision(dtype=...) takes the autocast dtype, 'bf16' or 'fp16', got {dtype!r}")
    be = resolve_backend(backend)
    prefix = wrapper_prefix(model)
    names = [n for n, m in model.named_modules() if strip(n, prefix) and isinstance(m, nn.Linear)]
    if not names:
        raise ValueError("plan_precision: the model has no nn.Linear layer to plan")
    seen, total = _capture(model, example_inputs, loss_fn, names)
    unavailable = _availability(be, fmts, bool(emulate))
    rules: dict[str, str] = {}
    head, _ = recipe_head(model, example_inputs)
    if recipe_rules:
        order = [n for n in engine.linear_order(model, example_inputs, names) if "x" in seen[n]]
        if order:
            rules[order[0]] = "the first Linear layer the model runs (the recipe keeps it out of 8 bits)"
            rules.setdefault(order[-1], "the last Linear layer the model runs (the recipe keeps it out of 8 bits)")
        if head is not None and head in seen:
            rules.setdefault(head, "the head (the recipe keeps it out of 8 bits)")
    out_dtype = DTYPES[own]
    plan = PrecisionPlan(float(budget), own, formats=fmts, head=head)
    if loss_fn is None:
        plan.notes.append("no loss given: the gradients are those of the mean of the outputs")
    matmul_total = total or sum(rec["flops"] for rec in seen.values()) or 1.0
    for name in names:
        rec, module = seen[name], model.get_submodule(name)
        if "x" not in rec:
            plan.notes.append(f"{name}: did not run on the example inputs; left out of the plan")
            continue
        x, w, gy = rec["x"], rec["w"], rec.get("gy")
        layer = LayerPlan("fp32", "", flop_share=rec["flops"] / matmul_total, shape=tuple(w.shape), tokens=x.shape[0])
        for fmt in fmts:
            kind_mx = spec(fmt, "fwd.input").kind == "mx"
            if kind_mx and (x.shape[1] % MX_BLOCK or w.shape[0] % MX_BLOCK
                            or (fmt == "mxfp8" and gy is not None and x.shape[0] % MX_BLOCK)):
                layer.unavailable[fmt] = (f"shape (tokens {x.shape[0]}, in {x.shape[1]}, out {w.shape[0]}): MXFP8 "
                                          f"casts in blocks of {MX_BLOCK} along each matmul's reduction dimension")
                continue
            layer.errors[fmt] = layer_error(x, w, gy, fmt, out_dtype)
            why = None
            if fmt in RECIPE_OF:
                recipe = RECIPE_OF[fmt]
                why = (rules.get(name) or unavailable.get(fmt) or layer_reason(module, recipe)
                       or (tokens_reason(x.shape[0], recipe) if recipe in MX_RECIPES else None)
                       or (None if emulate else engine.too_small(module, recipe)))
            elif fmt != "fp32" and fmt != own:
                why = f"autocast runs {own}; {fmt} would need a second autocast dtype (measured only)"
            if why is not None:
                layer.unavailable[fmt] = why
        usable = [f for f in COST_ORDER if f in layer.errors and f not in layer.unavailable]
        within = [f for f in usable if layer.errors[f] <= budget]
        layer.format = within[0] if within else "fp32"
        over = [f"{f} {layer.errors[f]:.2e}" for f in usable[:usable.index(layer.format)] if f not in within] \
            if layer.format in usable else [f"{f} {layer.errors[f]:.2e}" for f in usable if f != "fp32"]
        if within and not (layer.format == "fp32" and over):
            layer.reason = f"the cheapest format it may use within {budget:g} (error {layer.errors[layer.format]:.2e})"
            if over:
                layer.reason += f"; over budget: {', '.join(over)}"
        else:
            layer.reason = f"every cheaper format it may use is over {budget:g}: {', '.join(over) or 'none'}"
        if rules.get(name) and any(f in RECIPE_OF for f in fmts):
            layer.reason += f"; not 8-bit: {rules[name]}"
        plan.layers[name] = layer
    if verify:
        plan.end_to_end = _verify(model, example_inputs, loss_fn, plan, be, bool(emulate))
    return plan


def _verify(model: nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None, plan: PrecisionPlan,
            backend: Any, emulate: bool) -> dict[str, float]:
    """The plan applied to a copy of ``model`` at once, against float32 on ``inputs``: the relative error
    of the loss and of all gradients together; {} where it cannot run here (no torchao for 8-bit layers)."""
    from .fp8 import engine
    from .policy import precision_policy
    from ..tracing.isolation import RngState, call_args

    if plan.recipes() and engine.unavailable_reason() is not None:
        return {}
    args, kwargs = call_args(inputs)
    device = next((t.device.type for t in model.parameters()), "cpu")
    results = []
    rng = RngState(device)  # the same dropout masks in both runs, on the CPU and on the device
    for planned in (False, True):
        twin = copy.deepcopy(model)
        rng.restore()
        # applied as a user applies it: the recipe's float32 layers too (the default fp32=)
        policy = precision_policy(twin, plan=plan, emulate=True, backend=backend) if planned else None
        with torch.autocast(device, dtype=DTYPES[plan.dtype], enabled=planned):
            loss = _loss(twin(*args, **kwargs), loss_fn)
        params = [p for p in twin.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True) if loss.requires_grad else ()
        flat = torch.cat([g.detach().float().flatten() for g in grads if g is not None]) if grads else torch.zeros(0)
        results.append((loss.detach().float(), flat))
        if policy is not None:
            policy.remove()
    rng.restore()
    (l32, g32), (lp, gp) = results
    return {"loss_rel_error": _rel(lp, l32), "grad_rel_error": _rel(gp, g32) if g32.numel() else 0.0}
