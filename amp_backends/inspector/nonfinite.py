"""Where inf/NaN first appears in a training step: what ``torch.autograd.detect_anomaly`` would be if
it knew AMP. Turn it on for one step when the scaler keeps skipping:

    with amp_backends.detect_nonfinite(model) as found:
        with be.autocast():
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
    print(found)     # forward: mul in blocks.3.attn (float16 [8, 128, 128]) produced 4096 inf/NaN values

The first op, forward and backward, whose outputs held inf/NaN: module path, op, dtype, shape and
count. Every op's outputs are counted on the device and read once, when the block ends; the step
itself runs as usual (only slower: one count per op).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import nn

from ..tracing.opcount import NonFinite, OpRecorder

__all__ = ["NonFiniteReport", "detect_nonfinite"]


@dataclass
class NonFiniteReport:
    """Filled in when the ``with`` block ends."""

    forward: NonFinite | None = None
    backward: NonFinite | None = None

    def __str__(self) -> str:
        found = [str(x) for x in (self.forward, self.backward) if x is not None]
        return "; ".join(found) if found else "no inf/NaN in the step"


@contextmanager
def detect_nonfinite(model: nn.Module) -> Iterator[NonFiniteReport]:
    """Watch one step of ``model`` (forward, loss, scaled backward) for the first op producing inf/NaN."""
    from ..tracing.attribution import Attribution

    if not isinstance(model, nn.Module):
        raise TypeError(f"detect_nonfinite takes the model (a torch.nn.Module), got {type(model).__name__}")
    attribution = Attribution(model)
    recorder = OpRecorder(attribution.where)
    report = NonFiniteReport()
    try:
        with attribution, recorder:
            yield report
    finally:
        attribution.remove()
        report.forward = recorder.first_nonfinite(False)
        report.backward = recorder.first_nonfinite(True)
