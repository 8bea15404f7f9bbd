"""Training checkpoints: model, optimizer and scaler in one file, written atomically.

``save`` writes to a temporary file in the same folder and renames it over the target,
so a crash never leaves a half-written checkpoint. ``load`` reads with
``torch.load(weights_only=True)`` and turns every way a file can be wrong (truncated,
not a checkpoint, another program's, another format version) into one CheckpointError.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .errors import AmpBackendsError

FORMAT = "amp-backends-checkpoint"
VERSION = 1

__all__ = ["CheckpointError", "save", "load"]


class CheckpointError(AmpBackendsError, ValueError):
    """A checkpoint that cannot be used."""


def save(path: str | os.PathLike[str], state: Mapping[str, Any], kind: str) -> Path:
    """Write ``state`` (tensors, numbers, strings, dicts, lists) to ``path`` atomically."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, "kind": kind, **state}
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(payload, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load(path: str | os.PathLike[str], kind: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` for ``kind``; raise CheckpointError if it is unusable."""
    source = Path(path)
    if not source.is_file():
        raise CheckpointError(f"{source}: no such checkpoint file")
    try:
        payload = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same clear message
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        detail = f"{type(exc).__name__}: {first.split('. ')[0][:160]}"
        raise CheckpointError(
            f"{source} is not a readable checkpoint (truncated, or not written by torch.save): {detail}"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{source} is not an amp-backends checkpoint (it holds {type(payload).__name__} data)")
    if payload.get("version") != VERSION:
        raise CheckpointError(
            f"{source} has checkpoint format version {payload.get('version')!r}; this amp-backends reads version {VERSION}"
        )
    if payload.get("kind") != kind:
        raise CheckpointError(f"{source} is a {payload.get('kind')!r} checkpoint, not {kind!r}")
    missing = [k for k in required if k not in payload]
    if missing:
        raise CheckpointError(f"{source} lacks {', '.join(missing)}: it is incomplete")
    return payload
