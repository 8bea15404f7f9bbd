"""Compile every specialisation of the gradient kernel ahead of time, for GPUs this machine need not have.

    TRITON_INTERPRET=0 python -m amp_backends_plugins.triton.aot            # a table
    TRITON_INTERPRET=0 python -m amp_backends_plugins.triton.aot --json out.json
    TRITON_INTERPRET=0 python -m amp_backends_plugins.triton.aot --sweep --targets sm_90   # launch shapes

For each target (sm_80, sm_90 and gfx942 by default) and each specialisation that ``run()`` and
``run_flat()`` launch, with each dtype's block size and warps (fp32, fp16 and bf16-as-int16 gradients; unscale, check, unscale+norm,
check+norm; base pointer 16-byte aligned or not), it reports the widest global load and store
in the assembly (PTX ``ld.global.v4``, SASS ``LDG.E.128``, AMD ``*_load_dwordx4``; the block
table's 64-bit offsets count too), the registers and the spills (local memory and stack in
``cuobjdump -res-usage``; the AMD assembly's own counts). Triton's own ``ptxas`` makes the cubin
and its ``cuobjdump`` reads it (both ship in the wheel): no GPU and no CUDA install are needed.

Triton 3.0 links AMD code with ROCm's ``ld.lld``; where none is found, ``--stand-in-linker``
lets the compile finish at the AMD assembly (what is checked) with a linker that writes an
empty object. Triton 3.1 and later link in-process.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: (name, backend, arch, warp size)
TARGETS = {"sm_80": ("cuda", 80, 32), "sm_90": ("cuda", 90, 32), "gfx942": ("hip", "gfx942", 64)}
#: (SCALE, WRITE, NORM) as the ops launch them
OPS = {"unscale": (True, True, False), "check": (False, False, False),
       "unscale+norm": (True, True, True), "check+norm": (False, False, True)}
POINTERS = {"float32": ("fp32", 4), "float16": ("fp16", 2), "bfloat16": ("i16", 2)}
_ARGS = ("base", "block_offsets", "block_lengths", "inv_scale_ptr", "found_inf_ptr", "partial_ptr")


@dataclass
class Variant:
    target: str
    dtype: str
    op: str
    aligned: bool
    block: int = 0
    num_warps: int = 0
    load_bits: int = 0
    store_bits: int = 0
    sass_load_bits: int | None = None
    registers: int | None = None
    spills: int | None = None
    #: NVIDIA: programs resident per SM that the registers allow
    ctas_per_sm: int | None = None
    error: str | None = None


def _version(triton: Any) -> tuple[int, int]:
    return tuple(int(x) for x in triton.__version__.split(".")[:2])  # type: ignore[return-value]  # two numbers: sliced to two


def _source(triton: Any, fn: Any, ptr: str, vec: int, aligned: bool, scale: bool, write: bool, norm: bool,
            block: int) -> Any:
    from triton.compiler import ASTSource

    names = list(inspect.signature(fn.fn).parameters)
    const = {"BLOCK": block, "VEC": vec, "ALIGNED": aligned, "BF16": ptr == "i16",
             "SCALE": scale, "WRITE": write, "NORM": norm}
    types = dict(zip(_ARGS, ["*" + ptr, "*i64", "*i32", "*fp32", "*fp32", "*fp32"]))
    # what the launcher specialises: every pointer 16-byte divisible except an unaligned base
    divisible = [i for i, name in enumerate(_ARGS) if name != "base" or aligned]
    if _version(triton) >= (3, 3):
        signature = {**types, **{k: "constexpr" for k in const}}
        attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
        return ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    from triton.compiler.compiler import AttrsDescriptor

    signature = {i: types[name] for i, name in enumerate(_ARGS)}
    return ASTSource(fn, signature, constants={names.index(k): v for k, v in const.items()},
                     attrs=AttrsDescriptor(divisible_by_16=tuple(divisible), equal_to_1=()))


def _nvidia_tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} is not in this Triton wheel ({path})")
    return str(path)


def _widest(pattern: str, text: str) -> int:
    widths = {"": 1, ".v2": 2, ".v4": 4, "x2": 2, "x3": 3, "x4": 4}
    found = [widths.get(m, 1) for m in re.findall(pattern, text)]
    return max(found, default=0)


def _inspect_nvidia(v: Variant, compiled: Any) -> None:
    ptx = compiled.asm["ptx"]
    # ld.global(.nc)(.v4).b32 / .b16 ...: vector width times the element width of the instruction
    loads = re.findall(r"ld\.global(?:\.[a-z]+)*?(\.v[24])?\.(?:b|f|u|s)(\d+)", ptx)
    stores = re.findall(r"st\.global(?:\.[a-z]+)*?(\.v[24])?\.(?:b|f|u|s)(\d+)", ptx)
    v.load_bits = max(((int(w[2]) if w else 1) * int(b) for w, b in loads), default=0)
    v.store_bits = max(((int(w[2]) if w else 1) * int(b) for w, b in stores), default=0)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "k.cubin")
        cubin.write_bytes(compiled.asm["cubin"])  # made by the ptxas Triton picks for the target
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "-res-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    v.registers = int(regs.group(1)) if regs else None
    # spilled registers live in local memory (and a stack frame): both must be empty
    v.spills = sum(int(x) for x in re.findall(r"(?:LOCAL|STACK):(\d+)", usage))
    sizes = [int(s) if s else 32 for s in re.findall(r"LDG\.E(?:\.[A-Z]+)*?(?:\.(64|128))?(?:\.[A-Z]+)*\s", sass)]
    v.sass_load_bits = max(sizes, default=0)


def _inspect_amd(v: Variant, compiled: Any) -> None:
    gcn = compiled.asm["amdgcn"]
    v.load_bits = 32 * _widest(r"(?:global|buffer)_load_(?:dword|b32)(x[234])?\b", gcn)
    v.store_bits = 32 * _widest(r"(?:global|buffer)_store_(?:dword|b32)(x[234])?\b", gcn)
    if not v.load_bits:  # 16-bit elements loaded one at a time
        v.load_bits = 16 if re.search(r"_load_(?:ushort|short|u16|b16)", gcn) else 0
    if not v.store_bits:
        v.store_bits = 16 if re.search(r"_store_(?:short|b16)", gcn) else 0
    vgpr = re.search(r"\.vgpr_count:\s*(\d+)", gcn) or re.search(r"NumVgprs:\s*(\d+)", gcn)
    v.registers = int(vgpr.group(1)) if vgpr else None
    spills = [int(x) for x in re.findall(r"\.(?:vgpr|sgpr)_spill_count:\s*(\d+)", gcn)]
    scratch = [int(x) for x in re.findall(r"ScratchSize:\s*(\d+)", gcn)]
    v.spills = sum(spills) + sum(scratch)


def _compile(triton: Any, target: str, dtype: str, op: str, aligned: bool, block: int, num_warps: int) -> Variant:
    """One specialisation, inspected; a failure is recorded on it."""
    from triton.backends.compiler import GPUTarget

    from . import _kernels

    backend, arch, warp = TARGETS[target]
    ptr, size = POINTERS[dtype]
    scale, write, norm = OPS[op]
    v = Variant(target, dtype, op, aligned, block=block, num_warps=num_warps)
    try:
        src = _source(triton, _kernels._grad_kernel, ptr, 16 // size, aligned, scale, write, norm, block)
        options = {"num_warps": num_warps, "enable_fp_fusion": False}
        if backend == "cuda":  # as the launch passes them on NVIDIA
            options["maxnreg"] = _kernels.MAXNREG
        compiled = triton.compile(src, target=GPUTarget(backend, arch, warp), options=options)
        if backend == "cuda":
            _inspect_nvidia(v, compiled)
            v.ctas_per_sm = _ctas_per_sm(v.registers, num_warps)
        else:
            _inspect_amd(v, compiled)
    except Exception as exc:  # noqa: BLE001 - recorded, reported, and failed on by the caller
        v.error = f"{type(exc).__name__}: {str(exc)[:400]}"
    return v


def _ctas_per_sm(registers: int | None, num_warps: int) -> int | None:
    """Programs resident per SM on sm_80/sm_90 (64K registers, 64 warps, 32 blocks; registers
    allocated per warp in units of 256): the register file, not shared memory, limits these kernels."""
    if not registers:
        return None
    per_warp = -(-registers * 32 // 256) * 256
    return min(65536 // per_warp // num_warps, 64 // num_warps, 32)


def compile_all(targets: list[str], tunings: dict[int, tuple[int, int]] | None = None) -> list[Variant]:
    """Compile every specialisation for ``targets`` with each dtype's launch shape (``tunings``:
    element size to (block, num_warps); the launches' own by default)."""
    import triton

    from . import _kernels

    if _kernels.INTERPRET:
        raise RuntimeError("TRITON_INTERPRET is set: compiling needs the real compiler (run with TRITON_INTERPRET=0)")
    shapes = tunings or {size: (t.block, t.num_warps) for size, t in _kernels.TUNING.items()}
    out = []
    for name in targets:
        for dtype, (_, size) in POINTERS.items():
            block, warps = shapes[size]
            for op in OPS:
                for aligned in (True, False):
                    out.append(_compile(triton, name, dtype, op, aligned, block, warps))
    return out


def sweep(target: str, block_bytes: list[int], warps: list[int], op: str = "unscale") -> list[Variant]:
    """The aligned ``op`` for every dtype, block size (bytes per program) and warp count: what each
    shape costs in registers, so programs per SM and bytes in flight (a model) can be compared
    before a GPU times them (``bench/unscale.py --sweep``)."""
    import triton

    out = []
    for dtype, (_, size) in POINTERS.items():
        for nbytes in block_bytes:
            for w in warps:
                out.append(_compile(triton, target, dtype, op, True, nbytes // size, w))
    return out


def _stand_in_linker(directory: str) -> str:
    path = Path(directory, "ld.lld")
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "LLD 0 (stand-in: no ROCm linker here)"; exit 0; fi\n'
        'while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then : > "$2"; fi; shift; done\n'
    )
    path.chmod(0o755)
    return str(path)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m amp_backends_plugins.triton.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated: " + ", ".join(TARGETS))
    parser.add_argument("--json", help="write every variant here")
    parser.add_argument("--stand-in-linker", action="store_true",
                        help="Triton 3.0 without ROCm's ld.lld: finish AMD compiles at the assembly")
    parser.add_argument("--sweep", action="store_true",
                        help="instead: the aligned unscale per dtype at each --block-bytes and --warps, on the first target")
    parser.add_argument("--block-bytes", type=_ints, default=[8192, 16384, 32768], help="with --sweep (comma-separated)")
    parser.add_argument("--warps", type=_ints, default=[4, 8, 16], help="with --sweep (comma-separated)")
    args = parser.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}: choose from {', '.join(TARGETS)}")
    import triton

    with tempfile.TemporaryDirectory() as tmp:
        if args.stand_in_linker and not (shutil.which("ld.lld") or os.environ.get("TRITON_HIP_LLD_PATH")):
            os.environ["TRITON_HIP_LLD_PATH"] = _stand_in_linker(tmp)
        variants = sweep(targets[0], args.block_bytes, args.warps) if args.sweep else compile_all(targets)
    print(f"triton {triton.__version__}: {len(variants)} specialisations")
    print(f"{'target':7} {'dtype':9} {'op':13} {'aligned':7} {'block':>6} {'warps':>5} {'load':>5} {'store':>5} "
          f"{'sass':>5} {'regs':>5} {'spills':>6} {'CTA/SM':>6} {'KiB/SM':>6}")
    for v in variants:
        if v.error:
            print(f"{v.target:7} {v.dtype:9} {v.op:13} {str(v.aligned):7} ERROR {v.error}")
            continue
        in_flight = v.ctas_per_sm * v.block * POINTERS[v.dtype][1] // 1024 if v.ctas_per_sm else "-"
        print(f"{v.target:7} {v.dtype:9} {v.op:13} {str(v.aligned):7} {v.block:>6} {v.num_warps:>5} {v.load_bits:>5} "
              f"{v.store_bits or '-':>5} {v.sass_load_bits if v.sass_load_bits is not None else '-':>5} "
              f"{v.registers or '-':>5} {v.spills:>6} {v.ctas_per_sm or '-':>6} {in_flight:>6}")
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__,
                                               "variants": [asdict(v) for v in variants]}, indent=1))
    return 1 if any(v.error for v in variants) else 0


if __name__ == "__main__":
    sys.exit(main())
