"""Bytes handed to collectives, counted as they are dispatched.

    with count_collectives() as log:
        loss.backward()                 # DDP's all-reduces, FSDP2's all-gathers and reduce-scatters
    log.bytes("allreduce_")             # payload bytes this rank handed to all-reduces

A ``TorchDispatchMode`` that sees every ``c10d`` op this thread dispatches (DDP's reducer and
FSDP2 call them through the dispatcher) and records its payload: op, dtype, elements, bytes.
The payload is what the rank hands the library, not the bytes on the wire, which depend on the
algorithm (a ring all-reduce sends about twice the payload; gloo's reduce-scatter is a full
all-reduce). Gathers, scatters and all-to-alls count their input (a scatter's only on its root);
a broadcast counts its one buffer on every rank (the library takes it in place: the root's is sent,
the others' received into); a barrier and a receive count nothing. Dispatch modes are thread-local:
collectives issued from other threads are not seen.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..torch_private import TorchDispatchMode

__all__ = ["CollectiveLog", "CollectiveRecord", "count_collectives", "reduce_op_name"]

#: Which argument holds what a rank sends, for the ops whose first argument is an output.
_INPUT_ARG = {"_allgather_base_": 1, "_reduce_scatter_base_": 1, "allgather_": 1, "reduce_scatter_": 1,
              "allgather_into_tensor_coalesced_": 1, "reduce_scatter_tensor_coalesced_": 1, "alltoall_base_": 1,
              "allgather_coalesced_": 1, "alltoall_": 1, "gather_": 1, "scatter_": 1}
#: c10d ops that carry no payload (a barrier's tensor is a placeholder; a receive hands nothing over).
_NO_PAYLOAD = {"barrier", "recv_", "recv_any_source_", "monitored_barrier_"}


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as dispatched: the c10d op's name and the payload this rank handed it."""

    op: str
    dtype: torch.dtype
    numel: int
    nbytes: int
    #: The reduce op ("SUM", "AVG", "PREMUL_SUM" ...) where torch shows it to Python (2.5+ c10d ops), else None.
    reduce_op: str | None = None


def _tensors(arg: Any) -> Iterator[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        yield arg
    elif isinstance(arg, (list, tuple)):
        for a in arg:
            yield from _tensors(a)


@dataclass
class CollectiveLog:
    """What :func:`count_collectives` saw, in order."""

    records: list[CollectiveRecord] = field(default_factory=list)

    def of(self, op: str | Sequence[str] | None = None) -> list[CollectiveRecord]:
        """The records of ``op`` (a c10d op name such as ``"allreduce_"``, or several), or all."""
        ops = (op,) if isinstance(op, str) else op
        return [r for r in self.records if ops is None or r.op in ops]

    def bytes(self, op: str | Sequence[str] | None = None) -> int:
        """Payload bytes of ``op``'s records (all where None)."""
        return sum(r.nbytes for r in self.of(op))

    def dtypes(self, op: str | Sequence[str] | None = None) -> set[torch.dtype]:
        return {r.dtype for r in self.of(op)}

    def bytes_by_dtype(self, op: str | Sequence[str] | None = None) -> dict[str, int]:
        """Payload bytes of ``op``'s records per dtype name ("float32", "bfloat16" ...)."""
        out: dict[str, int] = {}
        for r in self.of(op):
            key = str(r.dtype).replace("torch.", "")
            out[key] = out.get(key, 0) + r.nbytes
        return out

    def reduce_ops(self, op: str | Sequence[str] | None = None) -> set[str | None]:
        return {r.reduce_op for r in self.of(op)}


def reduce_op_name(reduce_op: Any) -> str | None:
    """The name of a c10d op's ReduceOp argument ("SUM", "AVG" ...), or None where torch does not show it (2.4, 2.8)."""
    import torch.distributed as dist

    names = {int(v): n for n, v in dist.ReduceOp.RedOpType.__members__.items()}
    try:
        return names.get(int(reduce_op.op()))
    except (TypeError, ValueError, RuntimeError):
        return None


class _Counter(TorchDispatchMode):
    def __init__(self, log: CollectiveLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        packet = func.overloadpacket
        if getattr(packet, "_qualified_op_name", "").startswith("c10d::"):
            name = packet._qualified_op_name.split("::", 1)[1]
            arg = args[_INPUT_ARG.get(name, 0)] if args and name not in _NO_PAYLOAD else None
            reduce_op = next((reduce_op_name(a) for a in args if callable(getattr(a, "op", None))), None)
            for t in _tensors(arg):
                self.log.records.append(
                    CollectiveRecord(name, t.dtype, t.numel(), t.numel() * t.element_size(), reduce_op))
        return func(*args, **(kwargs or {}))


class count_collectives:  # noqa: N801 - used as a context manager, like torch's modes
    """Context manager recording every c10d collective dispatched in this thread into a :class:`CollectiveLog`."""

    def __init__(self) -> None:
        self.log = CollectiveLog()
        self._mode = _Counter(self.log)

    def __enter__(self) -> CollectiveLog:
        self._mode.__enter__()
        return self.log

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
