"""A per-layer precision plan: for each Linear layer, the format it trains in, why, and what was
measured (each candidate format's error, its share of the step's matmul FLOPs). Plain data, saved as
JSON, reviewed and edited by hand, applied with ``precision_policy(model, plan=plan)``; made by
measurement with :func:`amp_backends.precision.planner.plan_precision`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .formats import DTYPES, PLAN_FORMATS, RECIPE_OF, check_formats, dtype_format

__all__ = ["METRIC", "LayerPlan", "PrecisionPlan"]

PLAN_VERSION = 1
#: What a layer's error is, as the plan states it.
METRIC = ("the largest relative error (||approx - exact|| / ||exact||) of the layer's output, input gradient and "
          "weight gradient against float32, on the example batch")


@dataclass
class LayerPlan:
    """One layer's choice: its format, why, each candidate's measured error, the formats it may not
    use with why, and its share of the step's matmul FLOPs."""

    format: str
    reason: str
    errors: dict[str, float] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    flop_share: float = 0.0
    shape: tuple[int, int] = (0, 0)  # (out_features, in_features)
    tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "reason": self.reason, "flop_share": self.flop_share,
                "shape": list(self.shape), "tokens": self.tokens,
                "errors": {k: (v if math.isfinite(v) else str(v)) for k, v in self.errors.items()},
                "unavailable": dict(self.unavailable)}


@dataclass
class PrecisionPlan:
    """Per Linear layer (qualified name) the format to train in (:data:`.formats.FORMATS`), chosen within
    ``budget`` for autocast in ``dtype`` ("bf16" or "fp16"); apply with
    ``precision_policy(model, plan=plan)``. Plain data: :meth:`save` / :meth:`load` (JSON), edit
    ``plan.layers[name].format`` freely."""

    budget: float
    dtype: str
    layers: dict[str, LayerPlan] = field(default_factory=dict)
    formats: tuple[str, ...] = PLAN_FORMATS
    end_to_end: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: the final classifier / head the planner found by running the model (None: not found), which
    #: the policy's recipe keeps in float32 when it applies the plan
    head: str | None = None

    # -- reading ----------------------------------------------------------------------------
    def by_format(self) -> dict[str, list[str]]:
        """Format -> the layers planned in it."""
        out: dict[str, list[str]] = {}
        for name, layer in self.layers.items():
            out.setdefault(layer.format, []).append(name)
        return out

    def recipes(self) -> dict[str, list[str]]:
        """fp8/MX recipe (``precision_policy``'s ``fp8_recipe``) -> the layers planned in it."""
        return {RECIPE_OF[f]: names for f, names in self.by_format().items() if f in RECIPE_OF}

    def table(self) -> str:
        """The plan as text: per layer its format, FLOP share, error and why."""
        rows = [("layer", "format", "FLOPs", "error", "why")]
        for name, layer in self.layers.items():
            err = layer.errors.get(layer.format)
            rows.append((name, layer.format, f"{100 * layer.flop_share:.1f}%",
                         "-" if err is None else f"{err:.2e}", layer.reason))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
        head = f"precision plan: budget {self.budget:g} ({METRIC}); autocast {self.dtype}"
        tail = []
        if self.end_to_end:
            tail.append("the plan applied at once, against float32 on the example batch: " + ", ".join(
                f"{k} {v:.2e}" for k, v in self.end_to_end.items()))
        return "\n".join([head, *lines, *tail, *self.notes])

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"version": PLAN_VERSION, "budget": self.budget, "metric": METRIC, "dtype": self.dtype,
                "formats": list(self.formats), "end_to_end": dict(self.end_to_end), "notes": list(self.notes),
                "head": self.head,
                "layers": {name: layer.to_dict() for name, layer in self.layers.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrecisionPlan:
        """A plan from :meth:`to_dict`'s form, checked: a clear error naming the field."""
        if not isinstance(data, Mapping) or data.get("version") != PLAN_VERSION:
            raise ValueError(f"not a precision plan of version {PLAN_VERSION} (got "
                             f"{data.get('version') if isinstance(data, Mapping) else type(data).__name__!r}); make "
                             "one with amp_backends.plan_precision and save it with PrecisionPlan.save")
        dtype = data.get("dtype")
        if dtype not in ("bf16", "fp16"):
            raise ValueError(f"precision plan: dtype must be 'bf16' or 'fp16' (the autocast dtype), got {dtype!r}")
        layers = data.get("layers")
        if not isinstance(layers, Mapping):
            raise ValueError("precision plan: 'layers' must map layer names to their plan")
        out = {}
        for name, raw in layers.items():
            if not isinstance(raw, Mapping) or "format" not in raw:
                raise ValueError(f"precision plan: layer {name!r} has no 'format'")
            fmt = check_formats([raw["format"]], f"precision plan, layer {name!r}")[0]
            errors = {k: float(v) for k, v in dict(raw.get("errors", {})).items()}
            out[str(name)] = LayerPlan(fmt, str(raw.get("reason", "")), errors, dict(raw.get("unavailable", {})),
                                       float(raw.get("flop_share", 0.0)), tuple(raw.get("shape", (0, 0))),
                                       int(raw.get("tokens", 0)))
        head = data.get("head")
        if head is not None and not isinstance(head, str):
            raise ValueError(f"precision plan: 'head' must be a layer name or null, got {head!r}")
        return cls(float(data.get("budget", math.nan)), dtype, out,
                   tuple(data.get("formats", PLAN_FORMATS)), dict(data.get("end_to_end", {})),
                   list(data.get("notes", [])), head)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PrecisionPlan:
        with open(path, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{os.fspath(path)} is not JSON ({exc}); a precision plan is saved by "
                                 "PrecisionPlan.save") from None
        return cls.from_dict(data)

    # -- applying ---------------------------------------------------------------------------
    def check(self, model: nn.Module) -> dict[str, nn.Linear]:
        """The model's Linear layers the plan names, checked (each exists, is a Linear of the planned
        shape, in a format the plan's autocast dtype can run); raises ValueError naming the layer."""
        own = dtype_format(DTYPES[self.dtype])
        found: dict[str, nn.Linear] = {}
        for name, layer in self.layers.items():
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise ValueError(f"precision plan: the model has no layer {name!r}; a plan applies to the model it "
                                 "was made for (make one for this model with amp_backends.plan_precision)") from None
            if not isinstance(module, nn.Linear):
                raise ValueError(f"precision plan: {name!r} is a {type(module).__name__}, not a Linear layer")
            if tuple(layer.shape) not in ((0, 0), tuple(module.weight.shape)):
                raise ValueError(f"precision plan: {name!r} was planned as {tuple(layer.shape)} (out, in) but the "
                                 f"model's is {tuple(module.weight.shape)}: the plan is for another model")
            if layer.format in DTYPES and layer.format not in ("fp32", own):
                raise ValueError(f"precision plan: {name!r} in {layer.format}, but the plan's autocast dtype is "
                                 f"{self.dtype}: autocast runs one 16-bit dtype; use 'fp32', {own!r} or an 8-bit format")
            found[name] = module
        return found
