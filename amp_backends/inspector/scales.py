"""The loss scales a float16 model can train at, measured: a scaled backward at every power of two
from 2**-24 to 2**30, each gradient element judged against a reference.

Every candidate is measured: what float16 loses and where it overflows need not move monotonically
with the scale (a layer that zeroes the gradients it finds non-finite loses more values at high
scales; the best scales need not be one interval), so nothing is inferred between two measured
scales. The range: 2**-24 is where the scale itself underflows (a gradient of 1 times 2**-24 is
float16's smallest value; a GradScaler halves its scale on every overflow, with no floor, so it can get
there); 2**30 is far above the scaler's start, 2**16 (it doubles after 2000 steps without overflow).
Cost: one backward per scale, 55 in all, on the graph already built.

A value is lost where it is exactly 0 in the scaled low-precision backward and not in the float32
reference; a value inf/NaN there counts as an overflow only where the reference's is finite (an inf or
NaN the float32 model makes too, ``sqrt`` at 0 in the backward, is no scale's fault). For a model
with fp8 layers, what fp8 loses is told from what float16 loses by the same model without fp8 (its
fp8 layers as plain Linear layers, under the same autocast), run at the same scale: a value lost
there too is float16's; a value the model without fp8 keeps at that scale is fp8's (its casts scale
each tensor by its own maximum, so the loss scale does not govern what it loses). Cost with fp8
layers: twice the backwards, and both graphs held while they run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..torch_private import DisableTorchDispatch

__all__ = ["SCALE_RANGE", "Sweep", "choose", "gaps", "grads", "lost", "lost_masks", "measure", "nonfinite", "runs"]

#: The loss scales tried: powers of two from 2**-24 to 2**30 (torch's scaler starts at 2**16).
SCALE_RANGE = (-24, 30)


def _dense(g: torch.Tensor | None) -> torch.Tensor | None:
    if g is None:
        return None
    if g.is_sparse:
        g = g.coalesce().to_dense()
    return g.detach().float()


def grads(loss: torch.Tensor, params: list[torch.Tensor], scale: float, retain: bool) -> list[torch.Tensor | None]:
    """Gradients of ``loss * scale`` divided by ``scale`` (float32), without touching ``.grad``."""
    found = torch.autograd.grad(loss * scale, params, retain_graph=retain, allow_unused=True)
    with DisableTorchDispatch():  # the check's own arithmetic is not the model's
        return [None if g is None else _dense(g) / scale for g in found]


def lost(low: Sequence[torch.Tensor | None], ref: Sequence[torch.Tensor | None]) -> list[int]:
    """Per parameter: gradient elements zero in ``low`` and not in ``ref``."""
    return [0 if a is None or b is None else int(((a == 0) & (b != 0)).sum()) for a, b in zip(low, ref)]


def nonfinite(found: Sequence[torch.Tensor | None], ref: Sequence[torch.Tensor | None] | None = None) -> list[int]:
    """Per parameter: gradient elements inf/NaN in ``found``; with ``ref``, only those finite there (what is
    inf/NaN in the float32 reference too is the model's, not the precision's)."""
    if ref is None:
        return [0 if g is None else int((~torch.isfinite(g)).sum()) for g in found]
    return [0 if g is None else int((~torch.isfinite(g) & torch.isfinite(r)).sum()) if r is not None and
            r.shape == g.shape else int((~torch.isfinite(g)).sum()) for g, r in zip(found, ref)]


def lost_masks(low: Sequence[torch.Tensor | None], ref: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Per parameter: where a gradient element is zero in ``low`` and not in ``ref`` (None: no gradient)."""
    return [None if a is None or b is None else (a == 0) & (b != 0) for a, b in zip(low, ref)]


def scale_list() -> list[float]:
    return [2.0**k for k in range(SCALE_RANGE[0], SCALE_RANGE[1] + 1)]


@dataclass
class Sweep:
    """What :func:`measure` found at every scale of :data:`SCALE_RANGE`."""

    #: scale -> (inf/NaN gradient values where float32's are finite, values lost to float16)
    scales: dict[float, tuple[int, int]]
    #: scaled backwards run beyond the one at the scale checked
    backwards: int
    #: scale -> values lost to the fp8 layers (kept by the model without fp8 at that scale); {} without
    fp8: dict[float, int] = field(default_factory=dict)
    #: per parameter, where fp8 loses values at the scale checked (None without fp8 layers)
    fp8_at_scale: list[torch.Tensor | None] | None = None


def measure(loss: torch.Tensor, params: list[torch.Tensor], reference: list[torch.Tensor | None], scale: float,
            first: list[torch.Tensor | None], plain: torch.Tensor | None = None) -> Sweep:
    """(inf/NaN gradient values where the float32 ``reference`` is finite, values lost) at every power of two
    in :data:`SCALE_RANGE`, from scaled backwards of ``loss`` (its graph retained; ``first`` are the gradients
    already taken at ``scale``).
    ``plain``: the loss of the same model without fp8 (graph retained), run at each scale too: a value
    lost counts as float16's where it is lost there as well, else as fp8's."""
    sweep = Sweep({}, 0, fp8_at_scale=None)
    for s in scale_list():
        found = first if s == scale else grads(loss, params, s, retain=True)
        sweep.backwards += s != scale
        masks = lost_masks(found, reference)
        if plain is not None:
            without = lost_masks(grads(plain, params, s, retain=True), reference)
            sweep.backwards += 1
            fp8 = [None if m is None else m & ~w if w is not None else m for m, w in zip(masks, without)]
            masks = [None if m is None else m & w if w is not None else torch.zeros_like(m)
                     for m, w in zip(masks, without)]
            sweep.fp8[s] = sum(0 if m is None else int(m.sum()) for m in fp8)
            if s == scale:
                sweep.fp8_at_scale = fp8
        sweep.scales[s] = (sum(nonfinite(found, reference)), sum(0 if m is None else int(m.sum()) for m in masks))
    return sweep


def runs(best: Sequence[float]) -> list[tuple[float, float]]:
    """``best`` (ascending powers of two) as runs of consecutive powers: (first, last) each."""
    out: list[list[float]] = []
    for s in best:
        if out and s == out[-1][1] * 2:
            out[-1][1] = s
        else:
            out.append([s, s])
    return [(a, b) for a, b in out]


def gaps(scales: dict[float, tuple[int, int]], best: Sequence[float]) -> list[tuple[float, float, int, int]]:
    """The measured scales between the first and the last of ``best`` that are not among them, as
    (first, last, inf/NaN values, values lost) for consecutive scales with the same figures."""
    if not best:
        return []
    chosen = set(best)
    out: list[list[Any]] = []
    for s in sorted(k for k in scales if best[0] < k < best[-1] and k not in chosen):
        figures = scales[s]
        if out and s == out[-1][1] * 2 and tuple(out[-1][2:]) == figures:
            out[-1][1] = s
        else:
            out.append([s, s, *figures])
    return [(a, b, c, d) for a, b, c, d in out]


def choose(scales: dict[float, tuple[int, int]]) -> tuple[list[float], tuple[float, float] | None]:
    """The scales with no inf/NaN gradient that lose the fewest values (all of them, ascending), and the
    longest run of consecutive powers of two among them (the higher one where two are as long), or
    ``([], None)`` where every scale overflows."""
    clean = {s: v[1] for s, v in scales.items() if not v[0]}
    if not clean:
        return [], None
    fewest = min(clean.values())
    best = sorted(s for s, n in clean.items() if n == fewest)
    widest = max(runs(best), key=lambda r: (math.log2(r[1]) - math.log2(r[0]), r[1]))
    return best, widest
