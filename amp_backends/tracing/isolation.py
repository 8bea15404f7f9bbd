"""Running a model to inspect it without changing it, or letting anything of the user's observe it.

Inside :func:`untouched`: every buffer (BatchNorm's running statistics and counters) is restored
afterwards, in place and by object; the global RNG states (CPU, and the device's) are put back, so
dropout in the check does not shift the user's later draws; the model's backward hooks, its
parameters' gradient hooks and the global module backward hooks are held back (a backward run by
the inspector is no training step: an optimizer stepping in a post-accumulate-grad hook, a
gradient-logging hook, must not see it); gradients are taken with ``torch.autograd.grad``, so no
``.grad`` (the parameters', an input's) is written. Modes are not changed.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any
import torch
from torch import nn

from .. import patches

__all__ = ["RngState", "call_args", "untouched"]


def call_args(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How example inputs call a model: a tensor is one positional argument; a tuple or list, the
    positional arguments; a mapping (a batch of named inputs, as Transformers models take), keyword
    arguments."""
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


class RngState:
    """The global random state of torch's CPU generator and of ``device_type``'s, where it has one."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.cpu = torch.get_rng_state()
        self.device = None
        module = getattr(torch, device_type, None) if device_type != "cpu" else None
        initialized = getattr(module, "is_initialized", None)
        get_all = getattr(module, "get_rng_state_all", None)
        if callable(get_all) and (not callable(initialized) or initialized()):
            try:
                self.device = get_all()
            except Exception:  # noqa: BLE001 - a device without a generator state: nothing to keep
                self.device = None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            getattr(torch, self.device_type).set_rng_state_all(self.device)


@contextlib.contextmanager
def untouched(model: nn.Module, device_type: str) -> Iterator[RngState]:
    """Inspect ``model`` inside: afterwards its buffers, the RNG and every hook are as before.
    Yields the RNG state at entry (:meth:`RngState.restore` puts it back, for a second forward with
    the same dropout masks)."""
    from torch.nn.modules import module as module_module

    rng = RngState(device_type)
    modules = list(model.modules())
    buffers = [(m, dict(m._buffers)) for m in modules]
    values = [(b, b.detach().clone()) for _, held in buffers for b in held.values() if b is not None]
    module_hooks = [(m, m._backward_hooks, m._backward_pre_hooks) for m in modules]
    params = list(model.parameters())
    tensor_hooks = [(p, p._backward_hooks, getattr(p, "_post_accumulate_grad_hooks", None)) for p in params]
    global_hooks = {name: getattr(module_module, name) for name in ("_global_backward_hooks",
                                                                    "_global_backward_pre_hooks")
                    if hasattr(module_module, name)}
    patched: list[patches.Patch] = []
    try:
        for m in modules:
            m._backward_hooks = OrderedDict()
            m._backward_pre_hooks = OrderedDict()
        for p in params:
            if p._backward_hooks:
                p._backward_hooks = None
            if getattr(p, "_post_accumulate_grad_hooks", None):
                p._post_accumulate_grad_hooks = None
        for name in global_hooks:
            patched.append(patches.replace(module_module, name, OrderedDict(), scope="while the model runs isolated",
                                           cause="hooks registered for every module must not see the isolated run"))
        with torch.enable_grad():
            yield rng
    finally:
        for patch in patched:
            patch.remove()
        for p, hooks, post in tensor_hooks:
            if hooks:
                p._backward_hooks = hooks
            if post:
                p._post_accumulate_grad_hooks = post
        for m, backward, pre in module_hooks:
            m._backward_hooks, m._backward_pre_hooks = backward, pre
        for m, held in buffers:
            m._buffers.clear()
            m._buffers.update(held)
        with torch.no_grad():
            for b, value in values:
                b.copy_(value)
        rng.restore()
