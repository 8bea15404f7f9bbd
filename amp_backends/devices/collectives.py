"""What a device's collective library moves and reduces: a declarative fact of the device contract.

A :class:`Collectives` says which floating dtypes the library behind a backend's process group
reduces (all-reduce, reduce-scatter), which it only moves (all-gather, broadcast), which reduce ops
it takes and how it computes AVG. :mod:`amp_backends.distributed` reads it before training: it
asks every library for the one form each of them takes (divide, then SUM), and refuses a dtype or
op the library would refuse at the first collective. The presets below are read from each
library's torch bindings (file and line in each ``source``; docs/distributed.md has the table).
A backend declares one as :attr:`amp_backends.devices.contract.Device.collectives`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AVG_DIVIDE_THEN_SUM", "AVG_NATIVE", "AVG_REFUSED", "AVG_SUM_THEN_DIVIDE", "CNCL", "Collectives",
           "FLOAT8", "GAUDI_HCCL", "GLOO", "HCCL", "MCCL", "NCCL", "OPS", "PRESETS", "XCCL", "preset"]

#: How a library computes ReduceOp.AVG: natively; as a SUM divided afterwards (a float16 sum can
#: overflow before the division); as a division of each input before a SUM; or not at all.
AVG_NATIVE, AVG_SUM_THEN_DIVIDE, AVG_DIVIDE_THEN_SUM, AVG_REFUSED = (
    "native", "sum, then divide", "divide, then sum", "refused")
#: Reduce ops by the names used here (``torch.distributed.ReduceOp`` members, lower case).
OPS = ("sum", "avg", "premul_sum", "max", "min", "product")
#: The float8 dtypes torch has (fp8 weights are all-gathered in one of them).
FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
               if hasattr(torch, n))
_F16, _BF16, _F32, _F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
_E4M3, _E5M2 = (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
_OCP_FP8 = tuple(d for d in (_E4M3, _E5M2) if d is not None)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Collectives:
    """A collective library's floating dtypes and reduce ops, as its torch bindings take them."""

    #: The library as users know it, e.g. ``"NCCL/RCCL"``.
    library: str
    #: The process-group backend name it registers (``torch.distributed.init_process_group``'s).
    process_group: str
    #: Floating dtypes its reductions (all-reduce, reduce-scatter) take and reduce in that dtype.
    reduce_dtypes: tuple[torch.dtype, ...]
    #: Floating dtypes its all-gather and broadcast move (fp8 listed only where they take it).
    gather_dtypes: tuple[torch.dtype, ...]
    #: Reduce ops it takes (:data:`OPS` names).
    reduce_ops: tuple[str, ...]
    #: How it computes AVG (:data:`AVG_NATIVE` ...); :data:`AVG_REFUSED` where "avg" is not in ``reduce_ops``.
    avg: str
    #: Where the facts are read from (repository, file, function or line).
    source: str
    #: Dtypes it accepts for reductions but reduces through float32 copies: float32 travels.
    upcast_dtypes: tuple[torch.dtype, ...] = ()
    #: What a user of this library should know beyond the fields (versions, build flags, chips).
    notes: tuple[str, ...] = ()

    def reduces(self, dtype: torch.dtype, op: str = "sum") -> bool:
        return self.reduce_refusal(dtype, op) is None

    def reduce_refusal(self, dtype: torch.dtype, op: str = "sum") -> str | None:
        """Why the library would refuse to reduce ``dtype`` tensors with ``op``, or None where it takes them."""
        op = op.lower()
        if op not in OPS:
            raise ValueError(f"unknown reduce op {op!r}: one of {', '.join(OPS)}")
        if op not in self.reduce_ops:
            return (f"{self.library} does not take ReduceOp.{op.upper()} (it takes "
                    f"{', '.join(o.upper() for o in self.reduce_ops)}; {self.source})")
        if dtype not in self.reduce_dtypes and dtype not in self.upcast_dtypes:
            return (f"{self.library} does not reduce {_name(dtype)} tensors (it reduces "
                    f"{', '.join(map(_name, self.reduce_dtypes))}; {self.source})")
        return None

    def gather_refusal(self, dtype: torch.dtype) -> str | None:
        """Why the library would refuse to all-gather ``dtype`` tensors, or None where it moves them."""
        if dtype in self.gather_dtypes or not dtype.is_floating_point:
            return None
        return (f"{self.library} does not all-gather or broadcast {_name(dtype)} tensors (it moves "
                f"{', '.join(map(_name, self.gather_dtypes))}; {self.source})")

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype that travels when ``dtype`` tensors are reduced: float32 where the library upcasts."""
        return torch.float32 if dtype in self.upcast_dtypes else dtype

    def describe(self) -> str:
        """One line: what it reduces, moves, and which ops it takes."""
        up = f", {'/'.join(map(_name, self.upcast_dtypes))} through float32" if self.upcast_dtypes else ""
        return (f"{self.library} ({self.process_group}): reduces {'/'.join(map(_name, self.reduce_dtypes))}{up}; "
                f"gathers {'/'.join(map(_name, self.gather_dtypes))}; ops {'/'.join(self.reduce_ops)}; AVG {self.avg}")


_FLOATS = (_F16, _BF16, _F32, _F64)

#: gloo (torch's CPU collectives). Run on 2 CPU ranks with torch 2.13 and read from torch 2.4's
#: ``libtorch_cpu.so``: fp16/bf16/fp32 reduce; float8 is refused by every collective, gathers included
#: ("Invalid scalar type", the dtype switch in ``ProcessGroupGloo.cpp``); PREMUL_SUM refused ("Cannot use
#: ReduceOp.PREMUL_SUM with Gloo"). AVG is refused by torch 2.4 ("Cannot use ReduceOp.AVG with Gloo"),
#: accepted since pytorch PR 149781 (a SUM, then a division), and averaged nothing in reduce-scatter
#: until pytorch PR 171458 (issue 162338): it is not declared, never relied on.
GLOO = Collectives(
    library="gloo", process_group="gloo", reduce_dtypes=_FLOATS, gather_dtypes=_FLOATS,
    reduce_ops=("sum", "max", "min", "product"), avg=AVG_REFUSED,
    source="pytorch torch/csrc/distributed/c10d/ProcessGroupGloo.cpp (run on 2 CPU ranks, torch 2.13)",
    notes=("AVG: refused by torch 2.4; a SUM then a division from pytorch PR 149781, wrong in reduce-scatter "
           "until PR 171458 (issue 162338); not relied on",
           "reduce-scatter runs as a full all-reduce and a local copy (reduce_scatter_tensor_coalesced): "
           "twice the traffic of a ring reduce-scatter",
           "float8 refused by every collective ('Invalid scalar type'); a uint8 view of the bytes gathers"))

#: NCCL (and RCCL, which serves "nccl" on ROCm builds). ``ProcessGroupNCCL.cpp`` ``getNcclDataType`` /
#: ``getNcclReduceOp`` and ``NCCLUtils.hpp``: bf16 from NCCL 2.10 (``HAS_NCCL_BF16_DATATYPE``); AVG native
#: (``ncclAvg``, NCCL 2.10); PREMUL_SUM native (NCCL 2.11; torch 2.4 takes half/float/double only);
#: float8 e4m3fn/e5m2 reduce only when torch is built with NCCL 2.24+ on SM 90+, else they travel as
#: uint8 for gathers and reductions are refused ("Float8 dtypes are not currenlty supported for NCCL
#: reductions", as the source spells it).
NCCL = Collectives(
    library="NCCL/RCCL", process_group="nccl", reduce_dtypes=_FLOATS, gather_dtypes=_FLOATS + _OCP_FP8,
    reduce_ops=OPS, avg=AVG_NATIVE,
    source="pytorch torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp getNcclDataType/getNcclReduceOp, NCCLUtils.hpp",
    notes=("bf16 needs NCCL 2.10+; PREMUL_SUM needs NCCL 2.11+ and in torch 2.4 takes no bf16",
           "float8 reduces only with torch built on NCCL 2.24+ and SM 90+; else gathered as uint8 bytes",
           "RCCL on MI355X was reported to refuse fp8 for every collective (ROCm/iris benchmark notes; not verified)"))

#: Huawei Ascend HCCL through torch_npu (Ascend/pytorch master 9e73e708,
#: ``torch_npu/csrc/distributed/ProcessGroupHCCL.cpp``): ``checkSupportedDataType`` (l.170) lets reductions
#: take int8/16/32/64, fp16, fp32, bf16 (fp64 from Ascend950) and refuses the rest ("HCCL <op>: Unsupported
#: data type"); ``getHcclReduceOp`` (l.136) runs AVG as HCCL_REDUCE_SUM and divides the output afterwards
#: (l.4808): an fp16 sum can overflow before the division; PREMUL_SUM is a multiply of the input, then a
#: SUM. ``HCCLUtils.cpp`` (l.49) maps float8 e4m3fn/e5m2 for all-gather and broadcast.
HCCL = Collectives(
    library="HCCL (Ascend, torch_npu)", process_group="hccl", reduce_dtypes=(_F16, _BF16, _F32),
    gather_dtypes=_FLOATS + _OCP_FP8, reduce_ops=OPS, avg=AVG_SUM_THEN_DIVIDE,
    source="Ascend/pytorch torch_npu/csrc/distributed/ProcessGroupHCCL.cpp getHcclReduceOp l.136, "
           "checkSupportedDataType l.170; HCCLUtils.cpp l.49",
    notes=("AVG is a SUM divided afterwards: a float16 sum can overflow first",
           "PREMUL_SUM is emulated: the input multiplied, then a SUM",
           "float64 reductions only on Ascend950 (Atlas A5)"))

#: Cambricon CNCL through torch_mlu (r2.4_develop 9e95f972,
#: ``torch_mlu/csrc/framework/distributed/process_group_cncl.cpp``): ``cncl_data_type`` (l.194) has fp16,
#: bf16, fp32 and no float8, and serves all-gather and broadcast too ("Unsupported data type for CNCL process
#: group"); float64 maps to cnclFloat (not declared); ``cncl_op`` (l.184) maps AVG to a SUM after
#: ``procReduceInput`` (l.348) divides floating inputs; PREMUL_SUM is refused ("Unhandled ReduceOp").
CNCL = Collectives(
    library="CNCL (Cambricon, torch_mlu)", process_group="cncl", reduce_dtypes=(_F16, _BF16, _F32),
    gather_dtypes=(_F16, _BF16, _F32), reduce_ops=("sum", "avg", "max", "min", "product"),
    avg=AVG_DIVIDE_THEN_SUM,
    source="Cambricon/torch_mlu torch_mlu/csrc/framework/distributed/process_group_cncl.cpp cncl_op l.184, "
           "cncl_data_type l.194, procReduceInput l.348",
    notes=("no float8 in any collective, gathers included; a uint8 view of the bytes gathers",
           "float64 is mapped to cnclFloat: not declared"))

#: Moore Threads MCCL through torch_musa (main 8b583b3f, ``torch_musa/csrc/distributed/ProcessGroupMCCL.cpp``
#: l.25-96): fp16, fp32, fp64; bf16 only in builds for MARCH_TYPE >= 220 (``ProcessGroupMCCL.h`` l.37),
#: float8 only for MARCH_TYPE >= 310 (not declared); AVG native (``mcclAvg``); PREMUL_SUM refused
#: ("Unexpected ReduceOp").
MCCL = Collectives(
    library="MCCL (Moore Threads, torch_musa)", process_group="mccl", reduce_dtypes=_FLOATS,
    gather_dtypes=_FLOATS, reduce_ops=("sum", "avg", "max", "min", "product"), avg=AVG_NATIVE,
    source="MooreThreads/torch_musa torch_musa/csrc/distributed/ProcessGroupMCCL.cpp mcclDataType/mcclOp l.25-96",
    notes=("bf16 only in torch_musa builds for MARCH_TYPE >= 220 (MCCL_BF16_SUPPORTED)",
           "float8 only in builds for MARCH_TYPE >= 310 (MCCL_FP8_SUPPORTED): not declared"))

#: Intel XCCL (oneCCL) through torch-xpu-ops (``src/xccl/xccl.h`` l.86-232): fp16, bf16, fp32, fp64; float8
#: sent as uint8 "for non-reduction op like allgather", refused by reductions; AVG native (``onecclAvg``;
#: with oneCCL < 2021.15 a SUM, then a division); PREMUL_SUM refused in the torch 2.8-era code ("Cannot use
#: ReduceOp.PREMUL_SUM with XCCL"), emulated from 2026-04 (not declared).
XCCL = Collectives(
    library="XCCL (Intel oneCCL)", process_group="xccl", reduce_dtypes=_FLOATS, gather_dtypes=_FLOATS + _OCP_FP8,
    reduce_ops=("sum", "avg", "max", "min", "product"), avg=AVG_NATIVE,
    source="intel/torch-xpu-ops src/xccl/xccl.h l.86-232, ProcessGroupXCCL.cpp applyPreMulSumIfNeeded l.85",
    notes=("oneCCL can fail AVG on its scheduler path (intel/torch-xpu-ops issue 2361)",
           "PREMUL_SUM refused in the 2025 code, emulated (a multiply, then a SUM) from 2026-04"))

#: Intel Gaudi HCCL through the Gaudi PyTorch bridge (v1.19.0, 5a56187e): ``collective_utils.cpp``
#: ``getHCCLReduceOp`` (l.39-66) maps MIN, MAX, SUM, PRODUCT and refuses AVG and PREMUL_SUM ("Unsupported
#: ReduceOp for HCCL process group"); ``process_group_hccl_base.cpp`` ``is_valid_hccl_dtype`` (l.233) takes
#: bf16 and fp32, and ``allreduce`` (l.412) / ``_reduce_scatter_base`` (l.1463) reduce every other dtype,
#: fp16 included, through a float32 copy; ``hccl_kernels.cpp`` sends float8 as hcclUint8 for gathers.
GAUDI_HCCL = Collectives(
    library="HCCL (Intel Gaudi)", process_group="hccl", reduce_dtypes=(_BF16, _F32),
    gather_dtypes=(_F16, _BF16, _F32) + _OCP_FP8, reduce_ops=("sum", "max", "min", "product"), avg=AVG_REFUSED,
    upcast_dtypes=(_F16,),
    source="HabanaAI/gaudi-pytorch-bridge backend/helpers/collective_utils.cpp getHCCLReduceOp l.39-66, "
           "process_group_hccl_base.cpp is_valid_hccl_dtype l.233, allreduce l.412, _reduce_scatter_base l.1463",
    notes=("fp16 is reduced through float32 copies: float32 travels, nothing is saved",
           "newer bridges map AVG to a SUM, then a division (seen in code search, version unknown)"))

#: The presets by the name of the process-group backend they serve. "hccl" is both Ascend's and
#: Gaudi's: the backend's own declaration decides, never this table.
PRESETS: dict[str, Collectives] = {c.process_group: c for c in (GLOO, NCCL, CNCL, MCCL, XCCL)}


def preset(process_group: str) -> Collectives | None:
    """The preset for a process-group backend name where that name says which library it is
    (gloo, nccl, cncl, mccl, xccl); None for others ("hccl" is two libraries)."""
    return PRESETS.get(process_group.lower())
