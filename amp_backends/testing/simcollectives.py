"""Simulated collective libraries: a real process group (gloo) that refuses what a vendor's library refuses.

    with simulated_library(collectives.CNCL):     # Cambricon's CNCL, as torch_mlu binds it
        loss.backward()                           # DDP / FSDP2 collectives: float8, PREMUL_SUM refused

Nobody here has an MLU, an Ascend NPU or a Gaudi: their collective libraries are simulated by a
``TorchDispatchMode`` that checks each c10d op this thread dispatches against the library's
declaration (:class:`amp_backends.devices.collectives.Collectives`, read from the vendor's
source) and raises where the library would, before gloo runs it. Reductions are checked for
dtype and reduce op (the op where torch shows it to Python, 2.5+; torch 2.4 hides it), gathers and
broadcasts for dtype. What it does not simulate: the vendor's arithmetic (CNCL's and HCCL's AVG,
Gaudi's float32 copies) and the device's tensors (the ranks hold CPU tensors).
"""

from __future__ import annotations

from typing import Any


from ..devices.collectives import OPS, Collectives
from ..distributed.counting import reduce_op_name
from ..torch_private import TorchDispatchMode

__all__ = ["REDUCTIONS", "SimulatedCollectiveError", "simulated_library"]

#: c10d ops that reduce (their tensors: the first argument, or the second where the first is an output).
REDUCTIONS = {"allreduce_": 0, "allreduce_coalesced_": 0, "reduce_": 0, "reduce_scatter_": 1,
              "_reduce_scatter_base_": 1, "reduce_scatter_tensor_coalesced_": 1}
#: c10d ops that move tensors without reducing them.
MOVES = {"allgather_": 1, "_allgather_base_": 1, "allgather_coalesced_": 1, "allgather_into_tensor_coalesced_": 1,
         "broadcast_": 0, "gather_": 1, "scatter_": 1, "alltoall_base_": 1}


class SimulatedCollectiveError(RuntimeError):
    """A collective the simulated library refuses, as the real one would at this call."""


def _tensors(arg: Any) -> list[Any]:
    if hasattr(arg, "dtype") and hasattr(arg, "numel"):
        return [arg]
    if isinstance(arg, (list, tuple)):
        return [t for a in arg for t in _tensors(a)]
    return []


class simulated_library(TorchDispatchMode):  # noqa: N801 - a context manager, as torch's modes
    """Within it, c10d collectives of this thread are refused where ``library`` refuses them."""

    def __init__(self, library: Collectives) -> None:
        super().__init__()
        if not isinstance(library, Collectives):
            raise TypeError(f"simulated_library() takes a Collectives (amp_backends.devices.collectives), got "
                            f"{type(library).__name__}")
        self.library = library
        #: What it refused, in order (the messages raised).
        self.refused: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        qualified = getattr(func.overloadpacket, "_qualified_op_name", "")
        if qualified.startswith("c10d::"):
            name = qualified.split("::", 1)[1]
            why = None
            if name in REDUCTIONS:
                op = (next((reduce_op_name(a) for a in args if callable(getattr(a, "op", None))), None) or "sum").lower()
                op = op if op in OPS else "sum"  # bitwise ops: not declared, not checked
                for t in _tensors(args[REDUCTIONS[name]]):
                    if t.dtype.is_floating_point:
                        why = why or self.library.reduce_refusal(t.dtype, op)
            elif name in MOVES:
                for t in _tensors(args[MOVES[name]]):
                    why = why or self.library.gather_refusal(t.dtype)
            if why is not None:
                message = f"simulated {self.library.library}, c10d::{name}: {why}"
                self.refused.append(message)
                raise SimulatedCollectiveError(message)
        return func(*args, **(kwargs or {}))
