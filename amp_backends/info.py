"""What ``amp-backends info`` reports: every backend, its state, and every plugin."""

from __future__ import annotations

import json
from typing import Any

import torch

from .registry import Registry, default_registry


def _dtype(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def collect(registry: Registry | None = None) -> dict[str, Any]:
    """Everything ``info`` shows, as plain data."""
    registry = registry or default_registry()
    rows = []
    for backend, record in registry.backends():
        try:
            reason = backend.unavailable_reason()
        except Exception as exc:  # noqa: BLE001
            reason = f"unavailable_reason() raised {type(exc).__name__}: {exc}"
        try:
            dtypes = [_dtype(d) for d in backend.supported_dtypes()]
        except Exception as exc:  # noqa: BLE001
            dtypes = [f"error: {exc}"]
        kernel_error = None
        try:
            kernel = backend.kernel.name
        except Exception as exc:  # noqa: BLE001
            kernel, kernel_error = "error", str(exc)
        rows.append(
            {
                "name": backend.name,
                "available": reason is None,
                "reason": reason,
                "device_type": backend.device_type,
                "default_dtype": _dtype(backend.default_dtype),
                "supported_dtypes": dtypes,
                "kernel": kernel,
                "kernel_error": kernel_error,
                "dist_backend": backend.dist_backend,
                "plugin": record.name,
                "package": record.package,
                "version": record.version,
                "builtin": record.builtin,
            }
        )
    duplicates = {
        name: [f"{r.package} ({r.name})" for r in records] for name, records in registry.duplicates().items()
    }
    try:
        best: str | None = registry.get().name
    except Exception:  # noqa: BLE001
        best = None
    return {
        "torch": torch.__version__,
        "best": best,
        "backends": rows,
        "duplicates": duplicates,
        "plugins": [r.as_dict() for r in registry.plugins()],
    }


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def render(data: dict[str, Any], verbose: bool = False) -> str:
    """The human-readable report."""
    out = [f"torch {data['torch']}; best available backend: {data['best'] or 'none'}", ""]
    rows = [
        [
            b["name"],
            "yes" if b["available"] else "no",
            b["device_type"],
            b["default_dtype"],
            ",".join(b["supported_dtypes"]),
            b["kernel"],
            b["dist_backend"],
            f"{b['package']} {b['version']}" + ("" if b["builtin"] else " (third-party)"),
        ]
        for b in data["backends"]
    ]
    out.append(_table(["backend", "available", "device", "default", "dtypes", "kernel", "dist", "package"], rows))
    missing = [b for b in data["backends"] if not b["available"]]
    if missing:
        out += ["", "Why not available:"] + [f"  {b['name']}: {b['reason']}" for b in missing]
    broken_kernels = [b for b in data["backends"] if b["kernel_error"]]
    if broken_kernels:
        out += ["", "Kernel problems:"] + [f"  {b['name']}: {b['kernel_error']}" for b in broken_kernels]
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
    data = collect()
    print(json.dumps(data, indent=2) if as_json else render(data, verbose))
    return 0
