"""Training checkpoints: model, optimizer and scaler in one file, checksummed, written atomically.

File layout: one header line ``amp-backends-checkpoint 3 <sha256 of the rest>\\n``, then the
``torch.save`` payload, streamed to the file and hashed in blocks both ways (neither ``save`` nor
``load`` holds the file in memory beside the state). ``save`` writes to a temporary file in the same
folder and renames it over the target, so a crash never leaves a half-written checkpoint; each
temporary file is named
after its host and process, and a later save removes only those whose process is gone (several
processes saving to one path never delete each other's); a symlink is followed; the keys the
file's own metadata uses cannot be overridden by the state; the file's mode follows the umask as
any new file's does. ``load`` verifies the checksum before unpickling (with
``torch.load(weights_only=True)``) and turns every way a file can be wrong into one
CheckpointError that names the file. What a state may hold, and how numpy values, paths, dates and
argument namespaces come back as they were, is :mod:`amp_backends.checkpoint.values`: a value
``load`` could not read back is refused by ``save``, before anything is written.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from . import values as checkpoint_values
from ..errors import AmpBackendsError, first_line

FORMAT = "amp-backends-checkpoint"
VERSION = 3  # 3: tagged values (numpy, paths, dates, namespaces); 2 is read too
_READS = (b"2", b"3")
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


def _shown(text: object) -> str:
    """``text`` with control characters (terminal escape codes in a file name or a message) escaped."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], str(text))


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _resolve(path: str | os.PathLike[str], action: str) -> Path:
    """``path`` as a Path, following a symlink to what it names; a clear error for an empty path or a
    symlink that never ends in a file (a loop)."""
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"the checkpoint path must be a str or a path, got {type(path).__name__}")
    if not os.fspath(path):
        raise CheckpointError(f"the checkpoint path is empty: give the file {action}")
    target = Path(path)
    if not target.is_symlink():
        return target
    try:
        resolved: Path | None = target.resolve(strict=target.exists())
    except (OSError, RuntimeError):  # a loop (RuntimeError before Python 3.13)
        resolved = None
    if resolved is None or resolved.is_symlink():
        raise CheckpointError(f"{_shown(path)} is a symlink that loops (it never names a file): replace the "
                              "link or give another path")
    return resolved


def check_destination(path: str | os.PathLike[str]) -> Path:
    """Make sure a checkpoint can be written at ``path`` (before any training is spent)."""
    target = _resolve(path, "to write")
    if target.is_dir():
        raise CheckpointError(f"{target} is a directory: give a file name inside it, e.g. {target / 'demo.ckpt'}")
    parent = target.parent
    for ancestor in (parent, *parent.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                raise CheckpointError(f"cannot write {_shown(target)}: {_shown(ancestor)} is a file, not a directory")
            break
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=_temp_name_prefix(target), suffix=".tmp", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise CheckpointError(f"cannot write {_shown(target)}: {exc.strerror or exc}") from None
    return target


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def save(path: str | os.PathLike[str], state: Mapping[str, Any], kind: str) -> Path:
    """Write ``state`` (tensors, numbers, strings, dicts, lists; numpy values, paths, dates and
    argument namespaces too) to ``path`` atomically. A value :func:`load` could not read back is
    refused first, naming where it is in the state; nothing is written then.

    Safe with several writers of one path (each writes its own temporary file; the last rename
    wins, whole). A symlink is followed: its target is replaced, the link stays."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"the state to save must be a mapping of names to values, e.g. {{'model': "
                              f"model.state_dict(), 'scaler': scaler.state_dict()}}; got {type(state).__name__}")
    reserved = [k for k in RESERVED_KEYS if k in state]
    if reserved:
        raise CheckpointError(f"the state to save uses {', '.join(map(repr, reserved))}, which the checkpoint's "
                              f"own metadata uses ({', '.join(RESERVED_KEYS)}): rename those keys")
    encoded = checkpoint_values.encode(dict(state), lambda m: CheckpointError(f"cannot save: {m}"))
    target = check_destination(path)
    for stale in target.parent.glob(f"{_temp_prefix(target)}*.tmp"):  # left by a killed save
        if _abandoned(stale, target):
            stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=_temp_name_prefix(target), suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w+b") as fh:  # streamed: the payload is never held in memory beside the state
            fh.write(_header(b"0" * 64))
            torch.save({"format": FORMAT, "version": VERSION, "kind": kind, **encoded}, fh)
            fh.flush()
            _refuse_unsafe(_body(fh))
            digest = _digest(_body(fh))
            fh.seek(0)
            fh.write(_header(digest.encode()))
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _header(digest: bytes) -> bytes:
    """The header line: fixed width (the digest is 64 hex digits), so it is written last, in place."""
    return b"%s %d %s\n" % (_MAGIC, VERSION, digest)


class _Window(io.RawIOBase):
    """A file from ``start`` on, as a file of its own (torch's zip reader seeks within the payload)."""

    def __init__(self, fh: Any, start: int) -> None:
        super().__init__()
        self.fh, self.start = fh, start
        fh.seek(start)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        position = self.fh.seek(self.start + offset) if whence == io.SEEK_SET else self.fh.seek(offset, whence)
        return position - self.start

    def tell(self) -> int:
        return self.fh.tell() - self.start

    def readinto(self, buffer: Any) -> int:
        return self.fh.readinto(buffer)


def _body(fh: Any, start: int | None = None) -> io.BufferedReader:
    """The payload of an open checkpoint file (after its header line), read in 1 MiB blocks."""
    return io.BufferedReader(_Window(fh, len(_header(b"0" * 64)) if start is None else start), 1 << 20)


def _digest(body: io.BufferedReader) -> str:
    """sha256 of the payload, read in blocks (never the whole file in memory)."""
    digest = hashlib.sha256()
    while block := body.read(1 << 20):
        digest.update(block)
    return digest.hexdigest()


def _refuse_unsafe(body: io.BufferedReader) -> None:
    """torch's own judgement (2.6+), read from the pickle without running it: anything weights-only
    loading would refuse (a tensor subclass it does not know) is refused now, not at resume."""
    scan = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if not callable(scan):
        return
    try:
        unsafe = scan(body)
    except Exception:  # noqa: BLE001 - the scan itself failing is not the state's fault
        unsafe = []
    if unsafe:
        raise CheckpointError(f"cannot save: the state holds {', '.join(unsafe)}, which checkpoint.load (weights-only, "
                              "safe) cannot read back; store plain values, or allowlist them with "
                              "torch.serialization.add_safe_globals([...]) before saving and loading")


def load(path: str | os.PathLike[str], kind: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save` for ``kind``; raise CheckpointError if it is unusable."""
    source = _resolve(path, "to resume from")
    if source.is_dir():
        raise CheckpointError(f"{_shown(source)} is a directory, not a checkpoint file: give the file inside it")
    if not source.is_file():
        raise CheckpointError(f"{_shown(source)}: no such checkpoint file")
    with open(source, "rb") as fh:  # read in blocks: the file is never held in memory beside what it holds
        header = fh.readline(256)
        parts = header.rstrip(b"\n").split(b" ")
        if not header.endswith(b"\n") or len(parts) != 3 or parts[0] != _MAGIC:
            raise CheckpointError(f"{_shown(source)} is not an amp-backends checkpoint (no checkpoint header)")
        if parts[1] not in _READS:
            raise CheckpointError(
                f"{_shown(source)} has checkpoint format version {_shown(parts[1].decode(errors='replace'))!r}; "
                f"this amp-backends reads versions {', '.join(v.decode() for v in _READS)}"
            )
        if _digest(_body(fh, len(header))).encode() != parts[2]:
            raise CheckpointError(
                f"{_shown(source)} is corrupt: its contents do not match the checksum written with them (the file "
                "was damaged or truncated after saving); resume from another checkpoint or start afresh"
            )
        try:
            payload = torch.load(_body(fh, len(header)), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any unreadable payload gets the same clear message
            raise CheckpointError(f"{_shown(source)} is not a readable checkpoint: {_why_unreadable(exc)}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{_shown(source)} is not an amp-backends checkpoint (it holds {type(payload).__name__} data)")
    if payload.get("kind") != kind:
        raise CheckpointError(f"{_shown(source)} is a {_shown(payload.get('kind'))!r} checkpoint, not {kind!r}")
    missing = [k for k in required if k not in payload]
    if missing:
        raise CheckpointError(f"{_shown(source)} lacks {', '.join(missing)}: it is incomplete")
    return checkpoint_values.decode(payload, lambda m: CheckpointError(f"{_shown(source)} {m}"))


#: Modules a checkpoint has no use for, whose globals torch's weights-only loading blocks (2.5+): a file
#: naming one is said to be possibly malicious, never to be allowlisted (torch 2.4 does not say so itself).
_BLOCKED_MODULES = frozenset({"sys", "os", "posix", "nt", "subprocess", "builtins", "shutil", "socket", "runpy"})


def _why_unreadable(exc: Exception) -> str:
    """torch's error in one line, without its terminal escape codes, and without its advice to load
    with ``weights_only=False`` (which this loader never does): the global it refused, and the safe way."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    blocked = re.search(r"unsupported GLOBAL ([\w.]+) whose module ([\w.]+) is blocked", text)
    refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if refused and refused.group(1).split(".")[0] in _BLOCKED_MODULES:  # (torch 2.4 names no blocklist)
        blocked = re.search(r"(([\w]+)\.[\w.]+)", refused.group(1))
    if blocked:
        return (f"it holds {blocked.group(1)}, which weights-only (safe) loading refuses outright (module "
                f"{blocked.group(2)} is blocked: a checkpoint has no use for it, so the file may be malicious); "
                "do not load it")
    if refused:
        return (f"it holds {refused.group(1)}, which weights-only (safe) loading refuses; if you trust the file, "
                f"allowlist it with torch.serialization.add_safe_globals([{refused.group(1).rsplit('.', 1)[-1]}])")
    unpickler = re.search(r"WeightsUnpickler error: ([^\n]+)", text)  # past torch's advice to load unsafely
    if unpickler:
        return f"weights-only (safe) loading refuses it: {_shown(unpickler.group(1)[:160])}"
    return f"{type(exc).__name__}: {_shown(first_line(text)[:160])}"
