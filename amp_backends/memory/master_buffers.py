"""The float32 buffers of the master step: the gradients made float32 in one concatenation and one
cast, the masters kept as views of one float32 buffer per (device, parameter dtype), rounded back into
the parameters with one cast and one same-dtype multi-tensor copy (a copy across dtypes is a kernel per
tensor on CUDA), and the gradient arithmetic of the float16 path (scale, norm)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.weak import WeakIdRef

from ..torch_private import flatten_dense_tensors, foreach_copy_, foreach_mul_, foreach_norm, unflatten_dense_tensors
from .ledger import gradient_copies

#: The parameter dtypes that get a float32 master.
LOW_PRECISION = (torch.float16, torch.bfloat16)

__all__ = ["LOW_PRECISION", "Flats", "consolidate", "float32_grads", "grad_key", "grads_of", "inverse", "norm", "round_into", "scale_"]

#: (device, parameter dtype) -> (float32 buffer, its parameters, their masters: views of it)
Flats = dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, list[nn.Parameter], list[torch.Tensor]]]


def scale_(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply each gradient in place by ``factor`` (a multi-tensor op per device; sparse ones alone)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if g.is_sparse:
            g.mul_(factor.to(g.device))
        else:
            by_device.setdefault(g.device, []).append(g)
    for device, same in by_device.items():
        foreach_mul_(same, factor.to(device))


def norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The total ``norm_type``-norm of float32 ``grads``, as torch's clip_grad_norm_ computes it."""
    dense = [g.coalesce()._values() if g.is_sparse else g for g in grads]
    if not dense:
        return torch.zeros(())
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in dense:
        by_device.setdefault(g.device, []).append(g)
    first = dense[0].device
    norms = [n.to(first) for same in by_device.values() for n in foreach_norm(same, norm_type)]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def grads_of(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of ``params``, each of which has one."""
    return [p.grad for p in params if p.grad is not None]


def grad_key(p: nn.Parameter) -> tuple[WeakIdRef, int]:
    """Which gradient ``p`` holds and how often it was written: (the gradient, weakly and by identity;
    its version counter). A gradient replaced or changed in place since gives another key, and so does
    one made after it was freed, at the same address (an id would be reused)."""
    assert p.grad is not None
    return WeakIdRef(p.grad), p.grad._version


def inverse(scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """1/scale as torch's scaler computes it: in float64 (float32 where the device has no float64)."""
    if scale.device.type == "mps":
        return scale.float().reciprocal().to(device)
    return scale.double().reciprocal().float().to(device)


def float32_grads(grads: list[torch.Tensor], inverse: torch.Tensor | None) -> list[torch.Tensor]:
    """The gradients in float32, one buffer per device, multiplied by ``inverse`` (1/scale) in float32
    where given (a memory ledger counting counts them as gradients)."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(grads)
    by_device: dict[torch.device, list[int]] = {}
    for i, g in enumerate(grads):
        by_device.setdefault(g.device, []).append(i)
    for device, index in by_device.items():
        same = [grads[i] for i in index]
        if any(g.is_sparse for g in same):
            views = [g.float() for g in same]
            gradient_copies(views)
            if inverse is not None:
                views = [v.mul_(inverse.to(device)) for v in views]
        else:  # one concatenation and one cast (a copy across dtypes per tensor is a launch per tensor)
            joined = flatten_dense_tensors(same)
            gradient_copies([joined])  # (both are the gradients again, the float32 one for the whole step)
            flat = joined.to(torch.float32)
            del joined
            gradient_copies([flat])
            if inverse is not None:
                flat.mul_(inverse.to(device))
            views = list(unflatten_dense_tensors(flat, same))  # one call for every view
        for v, i in zip(views, index):
            out[i] = v
    return out



def consolidate(masters: dict[nn.Parameter, torch.Tensor], flats: Flats, fake: bool) -> Flats:
    """Each (device, parameter dtype)'s masters made views of one float32 buffer, so that the step
    rounds them into the parameters with one cast and one same-dtype multi-tensor copy."""
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for p in masters:
        groups.setdefault((p.device, p.dtype), []).append(p)
    held_before, flats = flats, {}
    for key, params in groups.items():
        held = held_before.get(key)
        if held is not None and [id(p) for p in held[1]] == [id(p) for p in params] and all(
                masters[p] is v for p, v in zip(params, held[2])):
            flats[key] = held
            continue
        values = [masters[p] for p in params]
        if fake or any(m.is_sparse for m in values):
            continue
        flat = flatten_dense_tensors(values)
        views = list(unflatten_dense_tensors(flat, values))
        for p, v in zip(params, views):
            masters[p] = v
        flats[key] = (flat, params, views)
    return flats


@torch.no_grad()
def round_into(masters: dict[nn.Parameter, torch.Tensor], flats: Flats, with_master: list[nn.Parameter]) -> None:
    """Each parameter := its master, rounded (written through the parameter: its version moves)."""
    done: set[int] = set()
    for (_, dtype), (flat, params, _) in flats.items():
        low = flat.to(dtype)
        targets: list[torch.Tensor] = list(params)
        foreach_copy_(targets, list(unflatten_dense_tensors(low, targets)))
        done.update(id(p) for p in params)
    rest = [p for p in with_master if id(p) not in done]
    if rest:
        foreach_copy_(list[torch.Tensor](rest), [masters[p] for p in rest])
