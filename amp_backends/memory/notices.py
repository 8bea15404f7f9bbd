"""What a lean model with low-precision weights warns of, once each: two uses that run, but not as the
user expects.

- **A forward outside autocast.** The low-precision linears meet the norms kept in float32 only under
  autocast: without it Llama's, Mistral's and T5's float32 RMSNorm output meets a bfloat16 linear and
  raises a dtype error, and GPT-2 and BERT compute every op in bfloat16, softmax and norms included,
  not as they trained. Evaluation and ``generate`` run under the backend's autocast, as the training
  does.
- **The model's own ``state_dict`` with float32 masters.** It gives the parameters, as torch's does (a
  write through it reaches them), so it holds their rounding: a checkpoint made from it (``torch.save(
  model.state_dict())``, ``save_pretrained``, a trainer's) resumes from the rounding, not the masters.
  ``Lean.state_dict()`` gives the masters (``model.save_pretrained(path, state_dict=lean.state_dict())``).

Both are forward pre-hook and state-dict hook of the model alone (the levers' own hooks are elsewhere);
neither changes what runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .master_buffers import LOW_PRECISION

__all__ = ["Notices", "notices", "quiet_state_dict"]


class _Outside:
    """Forward pre-hook of the model: a warning, once, where it runs outside autocast with low-precision weights."""

    def __init__(self, probe: torch.Tensor) -> None:
        self.probe, self.warned = probe, False

    def __call__(self, module: nn.Module, args: Any) -> None:
        probe = self.probe
        if (self.warned or torch.compiler.is_compiling() or probe.dtype not in LOW_PRECISION
                or torch.is_autocast_enabled(probe.device.type)):
            return
        self.warned = True
        dtype = str(probe.dtype).replace("torch.", "")
        warnings.warn(f"lean memory: the model ran outside autocast with {dtype} weights, which meet the norms kept "
                      "float32 only under autocast (Llama's RMSNorm then raises a dtype error; GPT-2 computes every "
                      f"op in {dtype}, not as it trained); evaluate and generate under the backend's autocast "
                      f"(with be.autocast(): ..., or torch.autocast({probe.device.type!r}, dtype=torch.{dtype}))",
                      RuntimeWarning, stacklevel=2)


class _Rounded:
    """State-dict post-hook of the model: a warning, once, that its ``state_dict`` holds the rounding of
    the float32 masters."""

    def __init__(self) -> None:
        self.warned, self.quiet = False, False

    def __call__(self, module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        if self.warned or self.quiet or torch.compiler.is_compiling():
            return
        self.warned = True
        warnings.warn("lean memory: model.state_dict() gives the low-precision parameters, the rounding of their "
                      "float32 masters: a checkpoint of it resumes from the rounding; for one that resumes exactly "
                      "save lean.state_dict() (save_pretrained(path, state_dict=lean.state_dict()))",
                      RuntimeWarning, stacklevel=3)


class Notices:
    """The hooks :func:`notices` put on the model; :meth:`remove` takes them off."""

    def __init__(self, handles: list[Any], rounded: _Rounded | None) -> None:
        self._handles, self.rounded = handles, rounded

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def notices(model: nn.Module, probe: torch.Tensor, masters: bool) -> Notices:
    """Warn once where ``model`` (whose low-precision weights ``probe`` is one of) runs outside autocast,
    and, with ``masters``, once where its own ``state_dict`` is taken (see the module docstring)."""
    handles = [model.register_forward_pre_hook(_Outside(probe))]
    rounded = None
    if masters:
        rounded = _Rounded()
        # (torch 2.4 has only the private registration, of the same hook)
        register = getattr(model, "register_state_dict_post_hook", None) or model._register_state_dict_hook
        handles.append(register(rounded))
    return Notices(handles, rounded)


@contextmanager
def quiet_state_dict(notes: Notices | None) -> Iterator[None]:
    """No warning for the model's ``state_dict`` taken inside (by ``Lean.state_dict``, which gives the masters)."""
    rounded = notes.rounded if notes is not None else None
    if rounded is None:
        yield
        return
    rounded.quiet = True
    try:
        yield
    finally:
        rounded.quiet = False
