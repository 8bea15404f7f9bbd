"""``amp-backends check``: a model from ``MODULE:FACTORY`` or the bench, checked and printed."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..inspector.check import check_model
from ..errors import AmpBackendsError
from ..patches import stdout_to_stderr
from ..torch_private import tree_map

__all__ = ["load_target", "main", "plan_main", "strict_json"]


def load_target(target: str, size: str = "small") -> tuple[nn.Module, Any, Callable[[Any], torch.Tensor] | None]:
    """``MODULE:FACTORY`` (the factory returns ``(model, example_inputs[, loss_fn])``) or
    ``bench:NAME``; a clear error for anything else, and for a target that exits the process."""
    import importlib

    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise AmpBackendsError(f"{target!r} is not MODULE:FACTORY (e.g. mypkg.models:make, or bench:gpt2-small)")
    if module_name == "bench":
        from .bench_models import MODELS, model_unavailable
        from .bench_thirdparty import THIRD_PARTY_NAMES

        if attr not in MODELS:
            why = model_unavailable(attr) if attr in THIRD_PARTY_NAMES else None
            raise AmpBackendsError(f"bench:{attr}: {why}" if why else
                                   f"bench:{attr}: no such bench model; choose from {', '.join(MODELS)}")
        spec = MODELS[attr]
        torch.manual_seed(0)  # the bench's initialisation: the same report every run
        inputs, targets = spec.batch(size, torch.device("cpu"), None)
        return spec.build(size), inputs, lambda out: spec.loss(out, targets)
    try:
        module = importlib.import_module(module_name)
    except SystemExit as exc:
        raise AmpBackendsError(f"importing {module_name!r} exited the process (sys.exit({exc.code!r})): a script "
                               "without `if __name__ == '__main__':` runs on import; guard it, or put the factory in "
                               "a module of its own") from None
    except ImportError as exc:
        raise AmpBackendsError(f"cannot import {module_name!r}: {exc} (is it on PYTHONPATH?)") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise AmpBackendsError(f"{module_name!r} has no callable {attr!r}")
    try:
        made = factory()
    except SystemExit as exc:
        raise AmpBackendsError(f"{target} exited the process (sys.exit({exc.code!r})) instead of returning "
                               "(model, example_inputs)") from None
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not isinstance(made[0], nn.Module):
        raise AmpBackendsError(f"{target} must return (model, example_inputs) or (model, example_inputs, loss_fn), "
                               f"got {type(made).__name__}")
    return made[0], made[1], made[2] if len(made) == 3 else None


def main(target: str, backend: str | None, dtype: str | None, size: str, policy: str,
         loss_scale: float | None, as_json: bool, fp8: str | None = None) -> int:
    """``amp-backends check``: print the table and the summary (or JSON, alone on stdout)."""
    import json

    from ..registry.registry import resolve_backend

    if loss_scale is not None and not (math.isfinite(loss_scale) and loss_scale > 0):
        raise AmpBackendsError(f"--loss-scale must be a positive number, got {loss_scale:g}")
    be = resolve_backend(backend)
    with stdout_to_stderr(cause="what the target prints goes to stderr: stdout carries the report (JSON a parser reads whole)"):
        model, inputs, loss_fn = load_target(target, size)
        dev = be.device()
        model = model.to(dev)
        inputs = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, inputs)
        handle = None
        native = bool(be.fp8_dtypes()) if not (fp8 or "").startswith("mxfp8") else "mxfp8" in be.mx_formats()
        if policy == "recipe" or fp8:
            from ..precision.policy import RECIPE, precision_policy

            handle = precision_policy(model, fp32=RECIPE if policy == "recipe" else (), backend=be,
                                      example_inputs=inputs, fp8=[nn.Linear] if fp8 else None,
                                      fp8_recipe=fp8 or "tensorwise", emulate=bool(fp8) and not native)
        try:
            report = check_model(model, inputs, be, dtype, loss_fn=loss_fn, loss_scale=loss_scale)
        finally:
            if handle is not None:
                handle.remove()
        if fp8 and not native:
            what = "MXFP8" if fp8.startswith("mxfp8") else "fp8"
            report.notes.append(f"{what} emulated: backend {be.name!r} has no {what} matmul, so the figures are "
                                f"{what}'s numerics, not its speed")
    if as_json:
        print(json.dumps(strict_json(report.to_dict()), indent=2, allow_nan=False))
    else:
        print(report.table())
        print()
        print(f"{be.name}, {report.dtype}: {report.summary}")
    return 0


def strict_json(value: Any) -> Any:
    """``value`` with every inf/NaN float as None: JSON has no such numbers (Python's ``NaN`` and
    ``Infinity`` tokens are not JSON, and strict parsers refuse them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def plan_main(target: str, backend: str | None, dtype: str | None, size: str, budget: float, emulate: bool,
              save: str | None, as_json: bool) -> int:
    """``amp-backends check --plan``: the per-layer precision plan, as a table with reasons or JSON."""
    import json

    from ..precision.formats import dtype_format
    from ..precision.planner import plan_precision
    from ..registry.registry import resolve_backend

    be = resolve_backend(backend)
    low = be.default_dtype if dtype is None else getattr(torch, dtype, None)
    if not isinstance(low, torch.dtype) or low not in (torch.bfloat16, torch.float16):
        raise AmpBackendsError(f"--dtype {dtype!r}: a plan is for autocast in bfloat16 or float16")
    with stdout_to_stderr(cause="what the target prints goes to stderr: stdout carries the plan"):
        model, inputs, loss_fn = load_target(target, size)
        dev = be.device()
        model = model.to(dev)
        inputs = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, inputs)
        try:
            plan = plan_precision(model, inputs, loss_fn, budget=budget, dtype=dtype_format(low), emulate=emulate,
                                  backend=be)
        except ValueError as exc:
            raise AmpBackendsError(f"--plan: {exc}") from None
    if save:
        plan.save(save)
    if as_json:
        print(json.dumps(strict_json(plan.to_dict()), indent=2, allow_nan=False))
    else:
        print(plan.table())
        if save:
            print(f"saved to {save}: apply with amp_backends.precision_policy(model, plan={save!r})")
    return 0
