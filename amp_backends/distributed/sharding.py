"""FSDP2 in mixed precision from the backend and the precision policy: weights all-gathered in the
backend's low dtype, gradients reduce-scattered in the dtype asked for (float32 unless told), the
modules a precision policy keeps in float32 sharded with a float32 policy of their own.

    policy = amp_backends.precision_policy(model)            # norms and the head in float32
    plan = amp_backends.distributed.shard_in_low_precision(model, "cuda", policy=policy,
                                                           blocks=model.layers)
    plan.policies                                            # module name -> its MixedPrecisionPolicy

Every library is asked for the one reduction it takes, divide, then SUM: where fully_shard has
``set_force_sum_reduction_for_comms`` and ``set_custom_reduce_scatter`` each sharded module's
gradients are divided by the data-parallel size in the reduce dtype and reduce-scattered with SUM
(fully_shard would pick AVG for float32/bfloat16, which gloo before pytorch PR 149781 (torch 2.4 among them) and Gaudi's HCCL
refuse, and PREMUL_SUM for a custom divide factor, which gloo, CNCL, MCCL and Gaudi's HCCL refuse).
Without them, fully_shard's own ops are checked against the library before anything is sharded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..backend import Backend
from ..registry.registry import get
from ..torch_private import COMPOSABLE_FSDP, FSDP_REDUCE_SCATTER, resolve
from .library import CollectiveError, dtype_name, library_of, require_gather, require_reduce

__all__ = ["ShardPlan", "fsdp_api", "shard_in_low_precision"]


def fsdp_api() -> tuple[Any, Any]:
    """``(fully_shard, MixedPrecisionPolicy)`` from where this torch keeps them."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        composable = resolve(COMPOSABLE_FSDP)
        if composable is None:
            raise ImportError("this torch has no fully_shard (FSDP2): torch 2.4 or later has it") from None
        return composable.fully_shard, composable.MixedPrecisionPolicy
    return fully_shard, MixedPrecisionPolicy


@dataclass
class ShardPlan:
    """What :func:`shard_in_low_precision` did: each sharded module's policy (``""`` is the root), the
    library asked, and how gradients are divided."""

    policies: dict[str, Any] = field(default_factory=dict)
    library: str = ""
    #: "divide, then SUM" (ours) or fully_shard's own ops ("AVG" / "pre- and post-divide, SUM").
    reduction: str = ""


def _divide_then_sum(divisor: int) -> Any:
    """A fully_shard ReduceScatter that divides its input by ``divisor`` and reduce-scatters with SUM."""
    ReduceScatter: Any = resolve(FSDP_REDUCE_SCATTER)

    scatter = getattr(dist, "reduce_scatter_single", None)

    class DivideThenSum(ReduceScatter):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                     op: Any, async_op: bool = False) -> Any:
            input_tensor.div_(divisor)
            if scatter is not None:
                return scatter(output=output_tensor, input=input_tensor, group=group, op=dist.ReduceOp.SUM,
                               async_op=async_op)
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group,
                                              async_op=async_op)

    return DivideThenSum()


def _can_divide_then_sum() -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    if resolve(FSDP_REDUCE_SCATTER) is None:
        return False
    return all(hasattr(FSDPModule, m) for m in ("set_custom_reduce_scatter", "set_force_sum_reduction_for_comms",
                                                "set_gradient_divide_factor"))


def _inside(name: str, group: str) -> bool:
    return group == "" or name == group or name.startswith(group + ".")


def _tied_partners(model: nn.Module, groups: list[str]) -> dict[str, list[str]]:
    """For each group (a module name to be sharded on its own), the modules outside it that hold one of
    its parameters (a tied weight: GPT-2's head and embedding). fully_shard refuses a parameter two
    groups manage, at the first forward; such modules are sharded together."""
    owners: dict[int, list[str]] = {}
    for mname, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(mname)
    partners: dict[str, list[str]] = {}
    for group in groups:
        outside = {o for names in owners.values() if any(_inside(n, group) for n in names)
                   for o in names if not _inside(o, group)}
        if outside:
            partners[group] = sorted(outside)
    return partners


def _grouped(model: nn.Module, order: list[tuple[str, Any]], fully_shard: Any) -> list[tuple[list[str], Any]]:
    """``order`` (name, policy) with each group whose parameters are tied to modules outside it joined
    by those modules (sharded together, with the group's policy); refused, nothing sharded, where they
    cannot be: a partner that is the root, lies inside or holds another group, or a torch whose
    fully_shard takes one module only."""
    names = [n for n, _ in order]
    partners = _tied_partners(model, names)
    takes_lists = "List[nn.Module]" in (fully_shard.__doc__ or "")
    out: list[tuple[list[str], Any]] = []
    taken: set[str] = set()
    for name, mp in order:
        joined = [p for p in partners.get(name, []) if p not in taken]
        clash = [p for p in joined if p == "" or any(g != name and (_inside(p, g) or _inside(g, p)) for g in names)]
        if clash or (joined and not takes_lists):
            why = ("this torch's fully_shard takes one module at a time" if not clash else
                   f"{', '.join(repr(c) for c in clash)} is the root or lies in (or holds) another sharded module")
            raise ValueError(
                f"shard_in_low_precision(): {name!r} shares a parameter with {', '.join(repr(p) for p in joined)} (tied "
                f"weights), which fully_shard needs in one group, and {why}: untie them, or leave {name!r} out of the "
                "policy's float32 modules / the blocks (nothing was sharded)")
        taken.update(joined)
        out.append(([name, *joined], mp))
    return out


def shard_in_low_precision(model: nn.Module, backend: str | Backend | None = None, *, policy: Any = None,
                           blocks: Iterable[nn.Module] = (), dtype: torch.dtype | None = None,
                           reduce_dtype: torch.dtype = torch.float32, mesh: Any = None,
                           **fully_shard_kwargs: Any) -> ShardPlan:
    """``fully_shard`` ``model`` (and first each of ``blocks``, and each module ``policy`` keeps in float32)
    with MixedPrecisionPolicy from ``backend``: parameters all-gathered in ``dtype`` (None: the backend's
    ``default_dtype``), gradients reduced in ``reduce_dtype``, the root's output in float32; the
    float32 modules with param_dtype and reduce_dtype float32. A module whose parameter is tied to a
    module outside it (a GPT-2 head and its embedding) is sharded together with that module, in one
    group with its policy (the tied weight is one tensor: gathered in float32 for both). ``policy``: an
    :func:`amp_backends.precision_policy` handle (its ``selected`` names). Checked before anything is
    sharded: the library behind the mesh's group must gather ``dtype`` and reduce ``reduce_dtype``
    with SUM (and with AVG where this torch's fully_shard cannot be told to divide first)."""
    be = backend if isinstance(backend, Backend) else get(backend)
    fully_shard, MixedPrecisionPolicy = fsdp_api()
    dtype = be.default_dtype if dtype is None else dtype
    what = f"shard_in_low_precision(dtype={dtype_name(dtype)}, reduce_dtype={dtype_name(reduce_dtype)})"
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_in_low_precision() takes an nn.Module, got {type(model).__name__}")
    for name, d in (("dtype", dtype), ("reduce_dtype", reduce_dtype)):
        if d not in (torch.float16, torch.bfloat16, torch.float32):
            raise CollectiveError(f"{what}: {name} must be float16, bfloat16 or float32 (fp8 weights are gathered by "
                                  "the fp8 engine, amp_backends.precision_policy(fp8=...))")
    names = {m: n for n, m in model.named_modules()}
    fp32_names = sorted(getattr(policy, "selected", {}) or {}) if policy is not None else []
    params_of = {n: any(True for _ in m.parameters()) for n, m in model.named_modules()}
    fp32_names = [n for n in fp32_names if params_of.get(n, True)]  # a module without parameters has nothing to shard
    missing = [n for n in fp32_names if n not in dict(model.named_modules())]
    block_list = list(blocks)
    strangers = [type(b).__name__ for b in block_list if b not in names]
    if missing or strangers:
        raise ValueError(f"shard_in_low_precision(): {'policy names ' + ', '.join(missing) if missing else ''}"
                         f"{' and ' if missing and strangers else ''}"
                         f"{'blocks ' + ', '.join(strangers) if strangers else ''} are not modules of this model: "
                         "pass the policy made for this model and blocks taken from it")
    if _can_divide_then_sum() and fully_shard_kwargs.get("shard_placement_fn") is not None:
        raise ValueError("shard_in_low_precision(shard_placement_fn=...): the custom reduce-scatter that divides first "
                         "takes one parameter group per module, which shard_placement_fn can split: leave it out, or "
                         "use fully_shard with your own MixedPrecisionPolicy (nothing was sharded)")
    if mesh is not None and getattr(mesh, "ndim", 1) != 1:
        raise ValueError("shard_in_low_precision(mesh=...): a 1-D DeviceMesh (FSDP) only; HSDP's 2-D mesh is not "
                         "supported here (its replicate all-reduce would have to divide too): use fully_shard with "
                         "your own MixedPrecisionPolicy for HSDP (nothing was sharded)")
    group = mesh.get_group() if mesh is not None else None
    device_type = next((p.device.type for p in model.parameters()), be.device_type)
    library = library_of(be, group, device_type)
    divide_first = _can_divide_then_sum()
    way_out = "choose dtypes the library takes (its Collectives, amp_backends.devices.collectives), or leave FSDP2 in float32"
    require_gather(library, dtype, what, way_out)
    for d in {reduce_dtype, torch.float32} if fp32_names else {reduce_dtype}:
        require_reduce(library, d, "sum", what, way_out)
        if not divide_first and d in (torch.float32, torch.bfloat16):
            require_reduce(library, d, "avg", f"{what}: this torch's fully_shard reduces {dtype_name(d)} with AVG and "
                           "cannot be told to divide first", "use a torch whose FSDPModule has set_custom_reduce_scatter")

    low = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    full = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype, output_dtype=torch.float32)
    modules = dict(model.named_modules())
    order = [(n, full) for n in fp32_names if n] + [(names[b], low) for b in block_list if names[b]]
    order.sort(key=lambda item: -item[0].count("."))  # innermost first, as fully_shard needs
    plan = ShardPlan(library=library.library)
    kwargs = dict(fully_shard_kwargs, **({"mesh": mesh} if mesh is not None else {}))
    seen: set[str] = set()
    order = [(n, mp) for n, mp in order if not (n in seen or seen.add(n))]  # type: ignore[func-returns-value]  # set.add: None
    for group, mp in _grouped(model, order, fully_shard) + [([""], full if "" in fp32_names else root)]:
        fully_shard(modules[group[0]] if len(group) == 1 else [modules[n] for n in group], mp_policy=mp, **kwargs)
        plan.policies.update((n, mp) for n in group)
    if divide_first:
        size = mesh.size() if mesh is not None else dist.get_world_size()
        for name in plan.policies:
            module = modules[name]
            module.set_gradient_divide_factor(1.0)  # fully_shard divides nothing; the comm divides first
            module.set_force_sum_reduction_for_comms(True)
            module.set_custom_reduce_scatter(_divide_then_sum(size))
        plan.reduction = f"divide by {size}, then SUM"
    else:
        plan.reduction = "fully_shard's own: AVG (float32, bfloat16), pre- and post-divide with SUM (float16)"
    return plan
