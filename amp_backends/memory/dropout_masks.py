"""Dropout's masks kept as bits, eight to a byte.

A dropout keeps, for its backward, which elements it kept. CUDA, XPU and the PrivateUse1 devices (an
MLU, an NPU) run torch's fused kernel (``native_dropout``), which saves a bool mask: a byte an element.
The CPU multiplies the input by a noise tensor of its dtype (each element 0 or ``1/(1-p)``) and saves
that: 2 or 4 bytes an element. Transformers' BERT-base and GPT-2 small run two dropout modules a layer
over the hidden width: at the bench's 8,192 tokens a GPU keeps 144 MiB of masks over twelve layers, the
CPU 288 MiB of bf16 noise under autocast.

:func:`pack_dropout_masks` puts a forward pre-hook on each ``nn.Dropout`` of a model. While its forward
runs in training, a ``saved_tensors_hooks`` pair takes the first tensor saved (the mask) and, where it
requires no grad and is contiguous, stores it as bits (:func:`pack_bits`), unpacking it when the backward
asks: the same mask, so the gradients are bitwise those without the lever. A bool round-trips exactly on any device. A CPU noise
tensor is stored as bits and the bits of its one nonzero value (a 0-d integer tensor), once a host read
has checked, comparing the elements' bits as integers, that every element is 0 or that value (on a CPU a
host read costs no sync; a fake tensor, which has no values to check, only under torch's own
``nn.Dropout`` forward); anything else is saved as it is, and so
is any other device's non-bool save (MPS's noise). The scope closes at that first save, so the rest of
the step passes through no Python. Costs: three small ops to pack a mask in the forward, over a byte an
element (on the CPU four more for noise, its check included), three to unpack in the backward (one more
for noise), and the hooks' host time: off by default.

Composes with the hooks in force (the memory ledger, torch's checkpoint, ``save_on_cpu``): they are
handed the packed bits. As with any hook that copies what it saves, autograd no longer sees a later
in-place edit of the mask (the backward uses the mask as it was saved). Nothing is done under
``torch.compile``, without grad, where saved-tensor hooks are disabled (``torch.func``), on a torch
that cannot tell which hooks are in force (2.4: :func:`.substitutes.available`), nor for a nested
tensor or a tensor subclass (a DTensor), whose mask is of its kind and cannot be packed as bits. A ``KeyboardInterrupt``
between the pre-hook and the save leaves the pair in force; the next save closes it (passing on, or
packing exactly what qualifies), and so do the next dropout's forward and :meth:`DropoutMasks.remove`;
but inside another's ``saved_tensors_hooks`` block (``save_on_cpu``, a checkpoint) that block's exit then
takes out the lever's pair instead of its own, as torch's hooks are a stack: after such an interrupt,
start again in a fresh process.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from .. import torch_private
from . import substitutes

__all__ = ["DropoutMasks", "pack_bits", "pack_dropout_masks", "unpack_bits"]

#: device -> 0..7 as uint8 on it (made once a device: one op fewer a pack and an unpack)
_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (the memory ledger's: no values, a fake mode's own)."""
    fake = torch_private.FakeTensor
    return fake is not None and isinstance(t, fake)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` is a plain dense strided tensor (or a fake one): the bits are packed by viewing it
    flat, which a nested tensor refuses, and by ops mixing it with plain tensors, which a subclass (a
    DTensor) refuses; those are saved as they are."""
    return not t.is_nested and t.layout == torch.strided and (type(t) is torch.Tensor or _fake(t))


def _shifts(like: torch.Tensor) -> torch.Tensor:
    """0..7 as uint8 on ``like``'s device (made afresh for a fake tensor: a fake mode's own)."""
    if _fake(like):
        return torch.arange(8, dtype=torch.uint8, device=like.device)
    shifts = _SHIFTS.get(like.device)
    if shifts is None:
        with torch_private.DisableTorchDispatch():  # a real constant, unseen by the modes around the first use
            shifts = _SHIFTS[like.device] = torch.arange(8, dtype=torch.uint8, device=like.device)
    return shifts


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A contiguous bool ``mask`` as uint8 bits, eight elements a byte, the first in the lowest bit."""
    flat = mask.reshape(-1).view(torch.uint8)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, 8).bitwise_left_shift(_shifts(mask)).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The bool mask of ``shape`` :func:`pack_bits` packed (contiguous)."""
    bits = packed.unsqueeze(-1).bitwise_right_shift(_shifts(packed)).bitwise_and_(1)
    return bits.view(-1)[:shape.numel()].view(torch.bool).view(shape)


class _Bits:
    """What is stored in place of a mask: its bits (as the hooks in force before packed them), its
    shape and dtype, and for a noise tensor the bits of its nonzero value."""

    __slots__ = ("dtype", "packed", "scope", "shape", "value")

    def __init__(self, scope: _Scope, packed: Any, shape: torch.Size, dtype: torch.dtype,
                 value: torch.Tensor | None) -> None:
        self.scope, self.packed, self.shape, self.dtype, self.value = scope, packed, shape, dtype, value


class _Scope(substitutes.HooksOver):
    """The hook pair of one dropout's forward, over the hooks in force when it began (or none). It takes
    the first save (the mask) and closes itself there."""

    def __init__(self, outer: tuple[Any, Any] | None, noise: tuple[torch.dtype, torch.Size, torch.device] | None) -> None:
        super().__init__(outer)
        #: the dtype, shape and device of the dropout's input (not the input: a stored mask holds its scope),
        #: on a device whose saved noise is checked (the CPU: a host read costs nothing)
        self.noise = noise
        #: the first save taken: every later one is passed on, even where hooks put in force over these
        #: keep them in force
        self.done = False

    def close(self) -> None:
        self.done = True
        super().close()

    def pack(self, t: torch.Tensor) -> Any:
        bits = value = None
        if self.done or t.requires_grad or not _dense(t) or not t.is_contiguous() or t.numel() == 0:
            pass
        elif t.dtype == torch.bool:
            bits = pack_bits(t)
        elif self.noise is not None and (t.dtype, t.shape, t.device) == self.noise and t.element_size() in _BITS_OF:
            kept, value = _noise(t)
            if kept is not None:
                bits = pack_bits(kept)
        self.close()
        if bits is None:
            return self.pass_on(t)
        return _Bits(self, bits if self.outer_pack is None else self.outer_pack(bits), t.shape, t.dtype, value)

    def unpack(self, stored: Any) -> torch.Tensor:
        if not isinstance(stored, _Bits) or stored.scope is not self:
            return self.unpack_outer(stored)
        bits = self.unpack_outer(stored.packed)
        mask = unpack_bits(bits, stored.shape)
        return mask if stored.value is None else (mask * stored.value).view(stored.dtype)


#: a float's element size -> the integer dtype its bits are read as
_BITS_OF = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _noise(noise: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Where ``noise`` is nonzero, and its one nonzero value's bits (a 0-d integer tensor), where every
    element is 0 or that value, bit for bit (read on the host: a CPU tensor; a fake tensor, which has no
    values, is taken as torch's noise); else ``(None, None)``. Compared as integers: exact, and faster."""
    ints = noise.view(_BITS_OF[noise.element_size()])
    kept, value = ints.ne(0), ints.amax()
    if _fake(noise) or torch.equal(kept * value, ints):
        return kept, value
    return None, None


_LOCAL = threading.local()


def _enter(module: nn.Dropout, args: tuple[Any, ...]) -> None:
    """Forward pre-hook of a dropout: its mask is stored as bits."""
    if torch.compiler.is_compiling():
        return
    _leave(module, args, None)  # a scope a KeyboardInterrupt left open
    if (not module.training or not 0.0 < module.p < 1.0 or len(args) != 1 or not isinstance(args[0], torch.Tensor)
            or not args[0].requires_grad or not _dense(args[0]) or not substitutes.can_open()):
        return  # (a nested tensor or a subclass: its mask is of its kind, saved as it is, under no hooks of ours)
    x = args[0]
    checkable = not _fake(x) or (type(module).forward is nn.Dropout.forward and "forward" not in vars(module))
    noise = (x.dtype, x.shape, x.device) if x.device.type == "cpu" and checkable else None
    scope = _LOCAL.scope = _Scope(torch_private.top_saved_tensors_hooks(False), noise)
    scope.enter()


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    """Forward hook of a dropout (also run when it raised): close its scope where no save closed it."""
    if torch.compiler.is_compiling():
        return
    scope = getattr(_LOCAL, "scope", None)
    if scope is not None:
        _LOCAL.scope = None
        scope.close()


class DropoutMasks(substitutes.Hooked):
    """What :func:`pack_dropout_masks` turned on (:attr:`modules`: the dropouts); :meth:`remove` turns it off."""

    def remove(self) -> None:
        super().remove()
        _leave(nn.Module(), (), None)

    def __repr__(self) -> str:
        return f"DropoutMasks({len(self.modules)} dropouts)"


def pack_dropout_masks(model: nn.Module) -> DropoutMasks:
    """Keep the masks ``model``'s ``nn.Dropout`` modules save for backward as bits (see the module docstring)."""
    dropouts: list[nn.Module] = list({id(m): m for m in model.modules() if isinstance(m, nn.Dropout)}.values())
    handles = [h for m in dropouts for h in (m.register_forward_pre_hook(_enter),
                                             m.register_forward_hook(_leave, always_call=True))]
    return DropoutMasks(dropouts, handles)
