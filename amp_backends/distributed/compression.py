"""DDP gradients reduced in a low-precision dtype: half the bytes of a float32 all-reduce.

    ddp = DDP(model)
    comm = amp_backends.distributed.reduce_in_low_precision(ddp, "cpu")   # bf16 on gloo; "cuda": fp16 on NCCL

A DDP communication hook: each gradient bucket is cast to the low dtype, divided by the world
size in that dtype, all-reduced with SUM (the one form every collective library takes; never AVG
or PREMUL_SUM, which gloo, CNCL, MCCL and Gaudi's HCCL refuse in part) and copied back into the
bucket in the gradient's dtype: torch's ``fp16_compress_hook`` recipe, for either dtype and any
process group whose library reduces it. The library is checked before training
(:func:`amp_backends.distributed.library.library_of`). With float16 and a loss scale, a bucket
that overflows float16 arrives as inf (or NaN) in every rank's identical result: the scaler finds
it and every rank skips the step.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..backend import Backend
from ..registry.registry import get
from .library import CollectiveError, dtype_name, library_of, require_reduce

__all__ = ["LOW_DTYPES", "LowPrecisionReduce", "reduce_in_low_precision"]

#: The dtypes a gradient bucket may travel in.
LOW_DTYPES = (torch.float16, torch.bfloat16)
_ATTR = "_amp_backends_low_precision_reduce"


@dataclass
class LowPrecisionReduce:
    """What :func:`reduce_in_low_precision` registered on a DDP model, and what its hook has sent.

    ``bytes_sent`` counts the tensors this rank handed to ``all_reduce`` (dtype size x elements);
    ``bytes_full`` what the same buckets would have sent in their own dtype."""

    dtype: torch.dtype
    library: str
    world_size: int
    group: dist.ProcessGroup | None = None
    all_reduces: int = 0
    bytes_sent: int = 0
    bytes_full: int = 0
    wire_dtypes: set[torch.dtype] = field(default_factory=set)

    def reset_counts(self) -> None:
        """Zero the counters (e.g. at the start of each step)."""
        self.all_reduces = self.bytes_sent = self.bytes_full = 0
        self.wire_dtypes = set()


# No "from __future__ import annotations" here: DDP checks the hook's annotations against the real types.
def _low_precision_hook(state: LowPrecisionReduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    low = buffer.to(state.dtype).div_(state.world_size)  # divide first: the sum of N scaled values stays in range
    state.all_reduces += 1
    state.bytes_sent += low.numel() * low.element_size()
    state.bytes_full += buffer.numel() * buffer.element_size()
    state.wire_dtypes.add(low.dtype)
    future = dist.all_reduce(low, group=state.group, async_op=True).get_future()  # SUM

    def back(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        buffer.copy_(fut.value()[0])  # into the bucket itself: gradient_as_bucket_view keeps its views
        return buffer

    return future.then(back)


def reduce_in_low_precision(ddp_model: torch.nn.parallel.DistributedDataParallel,
                            backend: str | Backend | None = None, dtype: torch.dtype | None = None,
                            group: dist.ProcessGroup | None = None) -> LowPrecisionReduce:
    """Make ``ddp_model`` all-reduce its gradient buckets in ``dtype`` (float16 or bfloat16; None: the
    backend's ``default_dtype``) over ``group`` (None: the group DDP was built with, else the default
    group). Everything is checked before the hook is registered: a model that is not DDP, one with a
    hook already, parameters already in a low dtype, a dtype or SUM the process group's library
    refuses (its :class:`~amp_backends.devices.collectives.Collectives`), and a library that would
    send float16 as float32 copies. Returns the hook's state, which counts what it sends."""
    be = backend if isinstance(backend, Backend) else get(backend)
    what = "reduce_in_low_precision"
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"{what}() takes a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}: wrap it first, DDP(model), then call {what}(ddp_model)")
    if getattr(ddp_model, _ATTR, None) is not None or getattr(ddp_model, "_comm_hooks", None):
        raise RuntimeError(f"{what}(): this DDP model has a communication hook already (DDP takes one): "
                           "build a new DDP(model) to change how its gradients are reduced")
    dtype = be.default_dtype if dtype is None else dtype
    if dtype not in LOW_DTYPES:
        raise CollectiveError(f"{what}(dtype={dtype}): gradients travel in float16 or bfloat16; for full precision "
                              "leave DDP as it is (it all-reduces in the gradients' own dtype)")
    grads = {p.dtype for p in ddp_model.parameters() if p.requires_grad}
    narrow = sorted(dtype_name(d) for d in grads if d in LOW_DTYPES or d.itemsize <= dtype.itemsize)
    if narrow:
        raise CollectiveError(f"{what}(dtype={dtype_name(dtype)}): the model has {', '.join(narrow)} parameters, whose "
                              "gradients DDP already reduces in that dtype: keep float32 parameters (autocast "
                              "computes in low precision) or leave DDP's own reduction")
    if group is None:
        group = getattr(ddp_model, "process_group", None)
    device_type = next((p.device.type for p in ddp_model.parameters()), be.device_type)
    library = library_of(be, group, device_type)
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    if library.reduces(other) and library.wire_dtype(other) == other:
        way_out = f"pass dtype=torch.{dtype_name(other)}, which {library.library} reduces, or leave DDP's float32 reduction"
    else:
        way_out = "leave DDP's float32 reduction (do not call reduce_in_low_precision)"
    require_reduce(library, dtype, "sum", f"{what}(dtype={dtype_name(dtype)})", way_out)
    if library.wire_dtype(dtype) != dtype:
        raise CollectiveError(f"{what}(dtype={dtype_name(dtype)}): {library.library} reduces {dtype_name(dtype)} through "
                              f"{dtype_name(library.wire_dtype(dtype))} copies, so nothing would be saved "
                              f"({library.source}); {way_out}")
    state = LowPrecisionReduce(dtype=dtype, library=library.library, world_size=dist.get_world_size(group),
                               group=group)
    ddp_model.register_comm_hook(state, _low_precision_hook)
    setattr(ddp_model, _ATTR, state)
    return state
