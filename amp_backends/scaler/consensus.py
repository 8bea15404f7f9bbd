"""found_inf agreed on across ranks: an all-reduce over the scaler's process group, and a device-wide
overflow status (torch_npu's) held for the whole iteration and agreed on over the default group."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["agree", "check_group_ready", "named_group", "ranks_agree_on_status", "share_status"]


def named_group(process_group: Any) -> Any:
    """The ``process_group`` a scaler was given, as torch.distributed takes it (``"world"``: None)."""
    return None if process_group == "world" else process_group


def check_group_ready(process_group: Any) -> None:
    """Refuse ``"world"`` while torch.distributed has no default group, before any gradient is touched
    (the all-reduce after the unscale would raise with the gradients divided and the stage not moved)."""
    if process_group != "world":
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("GradScaler(process_group='world'): torch.distributed has no default process group: "
                           "call torch.distributed.init_process_group(...) before the first step, or build the "
                           "scaler with process_group=None in a single process (nothing was unscaled)")


def agree(found: dict[torch.device, torch.Tensor], process_group: Any, checked: bool = True) -> None:
    """MAX-reduce each device's found_inf over ``process_group`` (ranks holding different gradients).
    ``checked``: whether this rank had gradients to check. A rank without any learns, in the same
    all-reduce, whether any rank had some; where none had, every rank raises torch's assertion (a loss
    that reaches no parameter), as torch's scaler raises it in one process. Ranks with gradients read
    nothing on the host."""
    import torch.distributed as dist

    group = named_group(process_group)
    for i, tensor in enumerate(found.values()):
        if i:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
            continue
        both = torch.stack([tensor.reshape(()).float(), torch.full((), float(checked), device=tensor.device)])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        tensor.copy_(both[0].reshape(tensor.shape))
        if not checked and not bool(both[1].item()):
            raise AssertionError("No inf checks were recorded for this optimizer.")


def _status_group(process_group: Any) -> Any:
    """The group a device-wide overflow status is agreed over: the scaler's ``process_group``, else
    the default group when one is initialised (torch_npu's rule), else False (one process)."""
    if process_group is not None:
        return named_group(process_group)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return None
    return False


def ranks_agree_on_status(process_group: Any) -> bool:
    """Whether a device-wide overflow status is agreed on across ranks (several processes)."""
    return _status_group(process_group) is not False


def share_status(found: dict[torch.device, torch.Tensor], seen: bool, process_group: Any) -> bool:
    """A device-wide overflow status holds for the whole iteration, as torch_npu's ``_has_overflow``
    does: reading it resets the register, so what one optimizer's op read (``seen``) is kept for every
    later optimizer of the iteration, and agreed on across ranks (the status is set only on the rank
    whose backward saturated; after DDP's all-reduce the others hold finite saturated gradients and a
    clear status). The status read is a host read already, so agreeing costs no extra device sync.
    Returns the iteration's overflow; sets every found_inf to it."""
    overflow = seen or any(bool(t.item()) for t in found.values())
    group = _status_group(process_group)
    if group is not False:
        import torch.distributed as dist

        where = "cpu" if dist.get_backend(group) == "gloo" else next(iter(found))
        flag = torch.tensor(float(overflow), device=where)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        overflow = bool(flag.item())
    if overflow:
        for t in found.values():
            t.fill_(1.0)
    return overflow
