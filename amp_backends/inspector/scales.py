"""The loss scales a float16 model can train at, measured: a scaled backward at every power of two
from 2**-24 to 2**30, each gradient element judged against a reference.

Every candidate is measured: what float16 loses and where it overflows need not move monotonically
with the scale (a layer that zeroes the gradients it finds non-finite loses more values at high
scales; the best scales need not be one interval), so nothing is inferred between two measured
scales. The range: 2**-24 is where the scale itself underflows (a gradient of 1 times 2**-24 is
float16's smallest value; a GradScaler halves its scale on every overflow, with no floor, so it can get
there); 2**30 is far above the scaler's start, 2**16 (it doubles after 2000 steps without overflow).
Cost: one backward per scale, 55 in all, on the graph already built.

A value is lost to float16 where it is exactly 0 in the scaled low-precision backward and not in the
reference; for a model with fp8 layers the reference keeps those layers in fp8 (everything else in
float32), so what fp8's own rounding loses is not counted as lost to float16: fp8's casts scale each
tensor by its own maximum, so loss scaling does not recover those values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["SCALE_RANGE", "choose", "grads", "lost", "measure", "nonfinite"]

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
    with torch._C._DisableTorchDispatch():  # the check's own arithmetic is not the model's
        return [None if g is None else _dense(g) / scale for g in found]


def lost(low: Sequence[torch.Tensor | None], ref: Sequence[torch.Tensor | None]) -> list[int]:
    """Per parameter: gradient elements zero in ``low`` and not in ``ref``."""
    return [0 if a is None or b is None else int(((a == 0) & (b != 0)).sum()) for a, b in zip(low, ref)]


def nonfinite(found: Sequence[torch.Tensor | None]) -> list[int]:
    return [0 if g is None else int((~torch.isfinite(g)).sum()) for g in found]


def measure(loss: torch.Tensor, params: list[torch.Tensor], reference: list[torch.Tensor | None], scale: float,
            first: list[torch.Tensor | None]) -> tuple[dict[float, tuple[int, int]], int]:
    """(inf/NaN gradient values, values lost) at every power of two in :data:`SCALE_RANGE`, from scaled
    backwards of ``loss`` (its graph retained; ``first`` are the gradients already taken at ``scale``),
    and the number of backwards this ran."""
    scales: dict[float, tuple[int, int]] = {}
    run = 0
    for k in range(SCALE_RANGE[0], SCALE_RANGE[1] + 1):
        s = 2.0**k
        found = first if s == scale else grads(loss, params, s, retain=True)
        run += s != scale
        scales[s] = (sum(nonfinite(found)), sum(lost(found, reference)))
    return scales, run


def choose(scales: dict[float, tuple[int, int]]) -> tuple[list[float], tuple[float, float] | None]:
    """The scales with no inf/NaN gradient that lose the fewest values (all of them, ascending), and the
    longest run of consecutive powers of two among them (the higher one where two are as long), or
    ``([], None)`` where every scale overflows."""
    clean = {s: v[1] for s, v in scales.items() if not v[0]}
    if not clean:
        return [], None
    fewest = min(clean.values())
    best = sorted(s for s, n in clean.items() if n == fewest)
    runs: list[list[float]] = []
    for s in best:
        if runs and s == runs[-1][-1] * 2:
            runs[-1].append(s)
        else:
            runs.append([s])
    widest = max(runs, key=lambda r: (len(r), r[-1]))
    return best, (widest[0], widest[-1])
