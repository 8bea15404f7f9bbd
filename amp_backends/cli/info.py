"""What ``amp-backends info`` reports: every backend, its state, and every plugin."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import torch

from ..devices.contract import EVERY_KIND
from ..registry.registry import Registry, default_registry, probe, shadowing_message


def _installed(backend: Any, reason: str | None) -> bool:
    """Whether the device's extension is on this machine (an extension built for another torch
    usually fails to import: the mismatch is the likely cause). Else: whether it is available."""
    extension = getattr(backend, "extension", None)
    if extension:
        from ..extension import find_spec

        return find_spec(extension) is not None
    return reason is None


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def collect(registry: Registry | None = None) -> dict[str, Any]:
    """Everything ``info`` shows, as plain data."""
    registry = registry or default_registry()
    rows = []
    for backend, record in registry.backends():
        reason = probe(backend)  # bounded in time; a non-bool answer is a reason
        try:
            supported = backend.supported_dtypes()
            dtypes = [_dtype(d) for d in supported]
            native = backend.native_dtypes() if reason is None else supported
            native_names = [_dtype(d) for d in native]
            emulated = {_dtype(d): backend.emulation_reason(d) for d in supported if d not in native}
        except Exception as exc:  # noqa: BLE001 - a plugin's failure is shown in its row, not a crash
            dtypes, native_names, emulated = [f"error: {exc}"], [], {}
        kernel_error = None
        try:
            kernel = backend.kernel.name
        except Exception as exc:  # noqa: BLE001 - a plugin's failure is shown in its row, not a crash
            kernel, kernel_error = "error", str(exc)
        rejected = registry.kernel_rejections(backend.device_type)
        if rejected and kernel_error is None:
            kernel_error = "; ".join(rejected)
        try:
            described = backend.describe() if reason is None or getattr(backend, "generic", False) else None
        except Exception as exc:  # noqa: BLE001 - a description is never worth a crash
            described = f"(describe() failed: {type(exc).__name__}: {exc})"
        try:
            fp32_note = backend.fp32_note() if reason is None else None
        except Exception as exc:  # noqa: BLE001 - a plugin's failure is shown in its row, not a crash
            fp32_note = f"(fp32_note() failed: {type(exc).__name__}: {exc})"
        try:
            fp8_dtypes = [_dtype(d) for d in backend.fp8_dtypes()] if reason is None else []
            fp8_recipes = list(backend.fp8_recipes()) if fp8_dtypes else []
        except Exception as exc:  # noqa: BLE001 - a vendor's declaration failing costs only its fp8 column
            fp8_dtypes, fp8_recipes = [f"error: {type(exc).__name__}: {exc}"], []
        try:
            declared = backend.fused_found_inf or {}
            fused = {kind: (v if isinstance(v, str) else v[0]) for kind, v in declared.items()}
        except Exception as exc:  # noqa: BLE001 - a vendor's declaration failing costs only its column
            fused = {"error": f"{type(exc).__name__}: {exc}"}
        if EVERY_KIND in fused:
            fused = {"all": fused[EVERY_KIND]}
        built = backend.built_for_torch
        mismatch = None
        if built and built.split("+")[0] != torch.__version__.split("+")[0] and _installed(backend, reason):
            mismatch = (f"its device extension is built for torch {built}, and this is torch {torch.__version__}: "
                        f"install the extension's build for torch {torch.__version__.split('+')[0]}, or torch {built}")
        rows.append(
            {
                "name": backend.name,
                "built_for_torch": built,
                "torch_mismatch": mismatch,
                "available": reason is None,
                "reason": reason,
                "device_type": backend.device_type,
                "device": described,
                "generic": bool(getattr(backend, "generic", False)),
                "default_dtype": _dtype(backend.default_dtype),
                "supported_dtypes": dtypes,
                "native_dtypes": native_names,
                "emulated_dtypes": emulated,
                "kernel": kernel,
                "kernel_error": kernel_error,
                "dist_backend": backend.dist_backend,
                "fp32_note": fp32_note,
                "fused_optimizers": fused,
                "fp8_dtypes": fp8_dtypes,
                "fp8_recipes": fp8_recipes,
                "plugin": record.name,
                "package": record.package,
                "version": record.version,
                "builtin": record.builtin,
            }
        )
    duplicates = {
        name: [f"{r.package} ({r.name})" for r in records] for name, records in registry.duplicates().items()
    }
    shadowing = [
        {"backend": name, "plugin": rec.name, "package": rec.package, "overrides": override,
         "message": shadowing_message(name, rec, override)}
        for name, rec, override in registry.shadowing()
    ]
    best: str | None = None
    env_error: str | None = None
    try:
        with warnings.catch_warnings():  # an unusable accelerator's reason is in the table already
            warnings.filterwarnings("ignore", message="torch reports a usable", category=RuntimeWarning)
            best = registry.get().name
    except Exception as exc:  # noqa: BLE001 - no usable backend is reported, with why
        chosen = os.environ.get("AMP_BACKEND", "").strip()
        if chosen and chosen.lower() != "auto":
            env_error = str(exc) if str(exc).startswith("AMP_BACKEND=") else f"AMP_BACKEND={chosen!r} cannot be used: {exc}"
    from ..devices.hardware import cpu_summary

    return {
        "torch": torch.__version__,
        "fp8_engine": _fp8_engine(any(r["fp8_recipes"] for r in rows)),
        "cpu": cpu_summary(),
        "best": best,
        "env_error": env_error,
        "backends": rows,
        "duplicates": duplicates,
        "shadowing": shadowing,
        "plugins": [r.as_dict() for r in registry.plugins()],
    }


def _fp8_engine(needed: bool) -> dict[str, Any]:
    """torchao, the fp8 engine: its version, and whether it works with this torch (imported, so asked,
    only where a backend here has fp8 matmuls: the import takes a second or two)."""
    from ..precision.fp8.engine import torchao_version, unavailable_reason

    version = torchao_version()
    problem = None
    if version is None:
        problem = "torchao is not installed: pip install 'amp-backends[fp8]'"
    elif needed:
        problem = unavailable_reason()
    return {"torchao": version, "problem": problem, "checked": needed or version is None}


def render(data: dict[str, Any], verbose: bool = False) -> str:
    """The human-readable report."""
    from ..console import render_table

    out = [f"torch {data['torch']} ({data['cpu']}); best available backend: {data['best'] or 'none'}", ""]
    if data["env_error"]:
        out[0:0] = [f"error: {data['env_error']}", ""]
    rows = [
        [
            b["name"],
            "yes" if b["available"] else "no",
            b["device_type"],
            b["default_dtype"],
            ",".join(b["supported_dtypes"]),
            ",".join(b["native_dtypes"]) or "none",
            b["kernel"],
            b["dist_backend"] or "none",
            ",".join(d.replace("float8_", "") for d in b["fp8_dtypes"]) or "none",
            f"{b['package']} {b['version']}" + ("" if b["builtin"] else " (third-party)")
            + (" (generic)" if b["generic"] else ""),
        ]
        for b in data["backends"]
    ]
    out.append(render_table(["backend", "available", "device", "default", "dtypes", "native", "kernel", "dist", "fp8",
                             "package"], rows))
    devices = [b for b in data["backends"] if b["device"]]
    if devices:
        out += ["", "Devices:"] + [f"  {b['name']}: {b['device']}" for b in devices]
    notes = [b for b in data["backends"] if b["fp32_note"]]
    if notes:
        out += ["", "Float32 that may not be float32:"] + [f"  {b['name']}: {b['fp32_note']}" for b in notes]
    fused = [b for b in data["backends"] if b["available"]]
    if fused:
        out += ["", "Fused optimizers and found_inf (declared; other kinds probed on the device at first use):"]
        out += [f"  {b['name']}: " + (", ".join(f"{k} {v}" for k, v in b["fused_optimizers"].items()) or
                                       "none declared: probed") for b in fused]
    engine = data["fp8_engine"]
    fp8_rows = [b for b in data["backends"] if b["fp8_recipes"]]
    out += ["", "fp8 training (precision_policy(fp8=...)): engine "
            + (f"torchao {engine['torchao']}" if engine["torchao"] else "torchao, not installed")
            + (f" ({engine['problem']})" if engine["problem"] and engine["torchao"] else "")]
    out += [f"  {b['name']}: {', '.join(b['fp8_dtypes'])}; recipes {', '.join(b['fp8_recipes'])}" for b in fp8_rows]
    if not fp8_rows:
        out.append("  no backend here has fp8 matmuls (NVIDIA compute capability 8.9+, AMD MI300/MI350 have); "
                   "emulate=True runs fp8's numerics for tests")
    if engine["problem"] and not engine["torchao"]:
        out.append(f"  {engine['problem']}")
    slow = [(b["name"], d, why) for b in data["backends"] if b["available"] for d, why in b["emulated_dtypes"].items()]
    if slow:
        out += ["", "Emulated (slower than float32 here):"] + [f"  {n} {d}: {why}" for n, d, why in slow]
    missing = [b for b in data["backends"] if not b["available"]]
    if missing:
        out += ["", "Why not available:"] + [f"  {b['name']}: {b['reason']}" for b in missing]
    broken_kernels = [b for b in data["backends"] if b["kernel_error"]]
    if broken_kernels:
        out += ["", "Kernel problems:"] + [f"  {b['name']}: {b['kernel_error']}" for b in broken_kernels]
    mismatched = [b for b in data["backends"] if b["torch_mismatch"]]
    if mismatched:
        out += ["", "Warning, torch version mismatch:"] + [f"  {b['name']}: {b['torch_mismatch']}" for b in mismatched]
    if data["shadowing"]:
        out += ["", "Built-in backends and third-party plugins:"] + [f"  {s['message']}" for s in data["shadowing"]]
    for name, owners in data["duplicates"].items():
        out.append(f"\nDuplicate backend {name!r} registered by {' and '.join(owners)}: neither is used.")
    trouble = [p for p in data["plugins"] if p["status"] != "loaded"]
    if trouble:
        out += ["", "Plugins not loaded:"]
        for p in trouble:
            out.append(f"  {p['name']} ({p['package']} {p['version']}): {p['status']}: {p['error']}")
            if p["status"] == "failed":
                out.append(f"    disable with AMP_BACKENDS_DISABLE_PLUGINS={p['name']}")
    if verbose:
        out += ["", "Plugins:"] + [
            f"  {p['name']:<12} {p['status']:<9} {p['package']} {p['version']}  "
            f"backends={','.join(p['backends']) or '-'} kernels={','.join(p['kernels']) or '-'}"
            for p in data["plugins"]
        ]
    return "\n".join(out)


def main(as_json: bool = False, verbose: bool = False) -> int:
    """Print the report; exit status 1 when AMP_BACKEND names a backend that cannot be used."""
    data = collect()
    print(json.dumps(data, indent=2) if as_json else render(data, verbose))
    return 1 if data["env_error"] else 0
