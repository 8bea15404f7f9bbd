"""What a checkpoint may hold, and how the values weights-only loading refuses are carried through it.

``torch.load(weights_only=True)`` reads tensors, numbers, strings, None, dicts, lists, tuples and a
few torch types. Training states hold more: numpy scalars (metrics), numpy's RNG state, an
``argparse.Namespace`` of the run's arguments, a ``Path``, a ``datetime``. ``encode`` turns each of
those into a tagged dict of plain values that ``decode`` turns back into the same value; anything
else is refused when saving, with where it is and what to save instead, never when resuming.
A type the user allowlisted with ``torch.serialization.add_safe_globals`` is kept as it is.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
from collections import OrderedDict
from typing import Any, Callable

import torch

__all__ = ["decode", "encode"]

TAG = "__amp_backends_value__"
_PLAIN = (str, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)


def _safe_globals() -> set[type]:
    get = getattr(torch.serialization, "get_safe_globals", None)
    try:
        found = get() if callable(get) else []
    except Exception:  # noqa: BLE001 - no allowlist known
        found = []
    entries = (g[0] if isinstance(g, tuple) else g for g in found)  # (type, "name") pairs or types
    return {g for g in entries if isinstance(g, type)}


def _where(path: str) -> str:
    return f"state{path}" if path else "the state"


def _numpy(value: Any) -> Any:
    """numpy's module where ``value`` is a numpy scalar or array, else None (numpy never imported here)."""
    module = type(value).__module__
    if module != "numpy" and not module.startswith("numpy."):
        return None
    import numpy

    return numpy if isinstance(value, (numpy.generic, numpy.ndarray)) else None


def _byte_tensor(data: bytes | bytearray) -> torch.Tensor:
    """``data`` as a uint8 tensor of its own (torch.frombuffer refuses an empty buffer)."""
    return torch.frombuffer(bytearray(data) or bytearray(1), dtype=torch.uint8)[: len(data)].clone()


def encode(value: Any, error: Callable[[str], Exception], path: str = "") -> Any:
    """``value`` with every non-plain leaf tagged; raises ``error(message)`` naming the first leaf that
    cannot be carried."""
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:
        return value
    np = _numpy(value)
    if np is not None:
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise error(f"{_where(path)} is a numpy array of Python objects, which a checkpoint cannot carry "
                            "safely: convert it to numbers or strings first")
            return {TAG: "numpy.ndarray", "dtype": value.dtype.str, "shape": list(value.shape),
                    "data": _byte_tensor(np.ascontiguousarray(value).tobytes())}
        return {TAG: "numpy.generic", "data": encode(np.asarray(value), error, path)}
    if isinstance(value, complex):
        return {TAG: "complex", "real": value.real, "imag": value.imag}
    if isinstance(value, (bytes, bytearray)):
        return {TAG: type(value).__name__, "data": _byte_tensor(value)}
    if isinstance(value, pathlib.PurePath):
        return {TAG: "path", "value": str(value)}
    if isinstance(value, datetime.datetime):
        return {TAG: "datetime", "value": value.isoformat()}
    if isinstance(value, datetime.date):
        return {TAG: "date", "value": value.isoformat()}
    if isinstance(value, datetime.time):
        return {TAG: "time", "value": value.isoformat()}
    if isinstance(value, datetime.timedelta):
        return {TAG: "timedelta", "value": [value.days, value.seconds, value.microseconds]}
    if isinstance(value, argparse.Namespace):
        return {TAG: "namespace", "value": encode(vars(value), error, path)}
    if isinstance(value, (set, frozenset)):
        return {TAG: type(value).__name__, "value": [encode(v, error, f"{path}{{...}}") for v in value]}
    if isinstance(value, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(value, OrderedDict) else {}
        for key, item in value.items():
            if not (type(key) in _PLAIN or isinstance(key, tuple)):
                raise error(f"{_where(path)} has a key of type {type(key).__name__} ({key!r}): use str or int keys")
            out[key] = encode(item, error, f"{path}[{key!r}]")
        metadata = getattr(value, "_metadata", None)
        if isinstance(out, OrderedDict) and isinstance(metadata, dict):  # a state_dict's module versions
            out._metadata = encode(metadata, error, f"{path}._metadata")  # type: ignore[attr-defined]  # as torch's state_dict carries it
        if TAG in out:  # the user's own key named as the tag: its items carried as pairs, never read as a tag
            return {TAG: "escaped", "ordered": isinstance(out, OrderedDict), "items": [[k, v] for k, v in out.items()]}
        if type(value) not in (dict, OrderedDict):
            return {TAG: "dict", "value": out}  # a dict subclass (a defaultdict) comes back a dict
        return out
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(encode(v, error, f"{path}[{i}]") for i, v in enumerate(value))
    if type(value) in _safe_globals():
        return value  # the user allowlisted it for weights-only loading
    if callable(getattr(value, "state_dict", None)):
        raise error(f"{_where(path)} is a {type(value).__name__} object: save its state_dict() (and restore it "
                    "with load_state_dict), not the object")
    raise error(f"{_where(path)} is a {type(value).__module__}.{type(value).__name__}, which checkpoint.load "
                "(weights-only, safe) cannot read back: store plain values (numbers, strings, tensors, dicts, lists), "
                "or allowlist the type with torch.serialization.add_safe_globals([...]) before saving and loading")


def decode(value: Any, error: Callable[[str], Exception]) -> Any:
    """The values :func:`encode` tagged, as they were."""
    if isinstance(value, dict):
        tag = value.get(TAG)
        if tag is None:
            out = type(value)() if isinstance(value, OrderedDict) else {}
            for key, item in value.items():
                out[key] = decode(item, error)
            metadata = getattr(value, "_metadata", None)
            if isinstance(out, OrderedDict) and metadata is not None:
                out._metadata = decode(metadata, error)  # type: ignore[attr-defined]  # as torch's state_dict carries it
            return out
        return _DECODERS[tag](value, error) if tag in _DECODERS else _unknown(tag, error)
    if isinstance(value, list):
        return [decode(v, error) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(decode(v, error) for v in value)
    return value


def _unknown(tag: Any, error: Callable[[str], Exception]) -> Any:
    raise error(f"holds a value tagged {tag!r}, which this amp-backends cannot read: upgrade amp-backends")


def _np(error: Callable[[str], Exception]) -> Any:
    try:
        import numpy
    except ImportError:
        raise error("holds numpy values: install numpy to load it") from None
    return numpy


def _array(v: dict[str, Any], error: Callable[[str], Exception]) -> Any:
    np = _np(error)
    raw = v["data"].numpy().tobytes()
    return np.frombuffer(raw, dtype=np.dtype(v["dtype"])).reshape(v["shape"]).copy()


_DECODERS: dict[str, Callable[[dict[str, Any], Callable[[str], Exception]], Any]] = {
    "numpy.ndarray": _array,
    "numpy.generic": lambda v, e: _array(v["data"], e)[()],
    "complex": lambda v, e: complex(v["real"], v["imag"]),
    "bytes": lambda v, e: bytes(v["data"].tolist()),
    "bytearray": lambda v, e: bytearray(v["data"].tolist()),
    "path": lambda v, e: pathlib.Path(v["value"]),
    "datetime": lambda v, e: datetime.datetime.fromisoformat(v["value"]),
    "date": lambda v, e: datetime.date.fromisoformat(v["value"]),
    "time": lambda v, e: datetime.time.fromisoformat(v["value"]),
    "timedelta": lambda v, e: datetime.timedelta(*v["value"]),
    "namespace": lambda v, e: argparse.Namespace(**decode(v["value"], e)),
    "set": lambda v, e: {decode(x, e) for x in v["value"]},
    "frozenset": lambda v, e: frozenset(decode(x, e) for x in v["value"]),
    "dict": lambda v, e: decode(v["value"], e),
    "escaped": lambda v, e: (OrderedDict if v.get("ordered") else dict)((k, decode(x, e)) for k, x in v["items"]),
}
