"""Training checkpoints: model, optimizer and scaler in one file, checksummed, written atomically.

File layout: one header line ``amp-backends-checkpoint 2 <sha256 of the rest>\\n``, then the
``torch.save`` payload. ``save`` writes to a temporary file in the same folder and renames it
over the target, so a crash never leaves a half-written checkpoint; each temporary file is named
after its host and process, and a later save removes only those whose process is gone (several
processes saving to one path never delete each other's); a symlink is followed; the keys the
file's own metadata uses cannot be overridden by the state; the file's mode follows the umask as
any new file's does. ``load`` verifies the checksum before unpickling (with
``torch.load(weights_only=True)``) and turns every way a file can be wrong into one
CheckpointError that names the file.
"""

from __future__ import annotations

import hashlib
import io
import os
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .errors import AmpBackendsError

FORMAT = "amp-backends-checkpoint"
VERSION = 2
_MAGIC = FORMAT.encode()

__all__ = ["CheckpointError", "check_destination", "load", "save"]


class CheckpointError(AmpBackendsError, ValueError):
    """A checkpoint that cannot be used, or a place a checkpoint cannot be written."""


_HOST = socket.gethostname().replace(".", "-") or "host"
#: Keys the file's own metadata uses: a state may not override them.
RESERVED_KEYS = ("format", "version", "kind")


def _temp_prefix(target: Path) -> str:
    return f".{target.name}."


def _temp_name_prefix(target: Path) -> str:
    """This process's temporary files for ``target``: ``.<name>.<host>.<pid>.<random>.tmp``, so a
    writer can tell whose a temporary file is, and whether its writer is gone."""
    return f"{_temp_prefix(target)}{_HOST}.{os.getpid()}."


def _abandoned(temp: Path, target: Path) -> bool:
    """Whether ``temp`` was left by a save that can no longer finish: written on this host by a
    process that no longer exists. Another host's or a live process's file is left alone."""
    rest = temp.name[len(_temp_prefix(target)):].split(".")
    if len(rest) < 3 or rest[0] != _HOST or not rest[1].isdigit():
        return False
    pid = int(rest[1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # exists, owned by someone else
        return False
    return False


def check_destination(path: str | os.PathLike[str]) -> Path:
    """Make sure a checkpoint can be written at ``path`` (before any training is spent)."""
    target = Path(path)
    if not str(path):
        raise CheckpointError("the checkpoint path is empty: give a file name")
    if target.is_dir():
        raise CheckpointError(f"{target} is a directory: give a file name inside it, e.g. {target / 'demo.ckpt'}")
    parent = target.parent
    for ancestor in (parent, *parent.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                raise CheckpointError(f"cannot write {target}: {ancestor} is a file, not a directory")
            break
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=_temp_name_prefix(target), suffix=".tmp", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise CheckpointError(f"cannot write {target}: {exc.strerror or exc}") from None
    return target


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def save(path: str | os.PathLike[str], state: Mapping[str, Any], kind: str) -> Path:
    """Write ``state`` (tensors, numbers, strings, dicts, lists) to ``path`` atomically.

    Safe with several writers of one path (each writes its own temporary file; the last rename
    wins, whole). A symlink is followed: its target is replaced, the link stays."""
    reserved = [k for k in RESERVED_KEYS if k in state]
    if reserved:
        raise CheckpointError(f"the state to save uses {', '.join(map(repr, reserved))}, which the checkpoint's "
                              f"own metadata uses ({', '.join(RESERVED_KEYS)}): rename those keys")
    target = Path(path)
    if target.is_symlink():
        target = Path(os.path.realpath(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f"{_temp_prefix(target)}*.tmp"):  # left by a killed save
        if _abandoned(stale, target):
            stale.unlink(missing_ok=True)
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, "kind": kind, **state}, buffer)
    body = buffer.getvalue()
    header = b"%s %d %s\n" % (_MAGIC, VERSION, hashlib.sha256(body).hexdigest().encode())
    fd, tmp = tempfile.mkstemp(prefix=_temp_name_prefix(target), suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(header)
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load(path: str | os.PathLike[str], kind: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` for ``kind``; raise CheckpointError if it is unusable."""
    source = Path(path)
    if not str(path):
        raise CheckpointError("the checkpoint path is empty: give the file to resume from")
    if not source.is_file():
        raise CheckpointError(f"{source}: no such checkpoint file")
    data = source.read_bytes()
    header, newline, body = data.partition(b"\n")
    parts = header.split(b" ")
    if not newline or len(parts) != 3 or parts[0] != _MAGIC:
        raise CheckpointError(f"{source} is not an amp-backends checkpoint (no checkpoint header)")
    if parts[1] != str(VERSION).encode():
        raise CheckpointError(
            f"{source} has checkpoint format version {parts[1].decode(errors='replace')!r}; "
            f"this amp-backends reads version {VERSION}"
        )
    if hashlib.sha256(body).hexdigest().encode() != parts[2]:
        raise CheckpointError(
            f"{source} is corrupt: its contents do not match the checksum written with them (the file was "
            "damaged or truncated after saving); resume from another checkpoint or start afresh"
        )
    try:
        payload = torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable payload gets the same clear message
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"{source} is not a readable checkpoint: {type(exc).__name__}: {first[:160]}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{source} is not an amp-backends checkpoint (it holds {type(payload).__name__} data)")
    if payload.get("kind") != kind:
        raise CheckpointError(f"{source} is a {payload.get('kind')!r} checkpoint, not {kind!r}")
    missing = [k for k in required if k not in payload]
    if missing:
        raise CheckpointError(f"{source} lacks {', '.join(missing)}: it is incomplete")
    return payload
