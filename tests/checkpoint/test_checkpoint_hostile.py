"""Checkpoints under a hostile review: a state_dict's module versions (``_metadata``) survive the round
trip as torch's own does; a user dict whose key is the tag name comes back as it was; a pickle that
calls a blocked function is refused as malicious, without torch's advice to load it unsafely; save and
load stream the file (never held in memory beside the state); a resumed state is bitwise the saved
one and a truncated file is refused as corrupt."""

from __future__ import annotations

import collections
import hashlib
import io
import os
import pathlib
import pickle
import struct
import zipfile
from typing import Any

import pytest
import torch

from amp_backends import GradScaler, checkpoint
from amp_backends.checkpoint import CheckpointError
from conftest import run_python

TAG = "__amp_backends_value__"


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types, dict keys in the same order, tensors bitwise with their dtype."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _torch_round_trip(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` through torch.save and weights-only torch.load (the reference)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, map_location="cpu", weights_only=True)


def _write_checkpoint(path: pathlib.Path, body: bytes) -> None:
    """``body`` (a torch.save payload) as a checkpoint file: a valid version-3 header and checksum."""
    path.write_bytes(b"amp-backends-checkpoint 3 " + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)


# -- 1. a state_dict's _metadata ---------------------------------------------------------------------


class _Scaled(torch.nn.Module):
    """Version 2 stores ``log_scale``; version 1 (no version in the metadata) stored the scale itself,
    converted on load: a checkpoint that loses the version is misread."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.log_scale = torch.nn.Parameter(torch.tensor(0.5))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              *args: Any) -> None:
        if local_metadata.get("version") is None:  # an old checkpoint: convert
            state_dict[prefix + "log_scale"] = state_dict[prefix + "log_scale"].log()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def _versioned_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(_Scaled(), torch.nn.BatchNorm1d(3))


def _loaded_into_fresh(state_dict: dict[str, Any]) -> torch.nn.Module:
    model = _versioned_model()
    with torch.no_grad():
        model[0].log_scale.fill_(9.0)
    model.load_state_dict(state_dict)
    return model


def test_a_state_dicts_metadata_survives_save_and_load(tmp_path: pathlib.Path) -> None:
    """A module that converts an old format by its version loads the same value through
    checkpoint.save/load as through torch.save/torch.load; BatchNorm's _metadata is torch's."""
    source = _versioned_model()
    state = {"model": source.state_dict(), "nested": {"models": [source.state_dict()]}}
    checkpoint.save(tmp_path / "m.ckpt", state, kind="t")
    back = checkpoint.load(tmp_path / "m.ckpt", kind="t")
    reference = _torch_round_trip(state)
    for ours, theirs in ((back["model"], reference["model"]), (back["nested"]["models"][0], reference["nested"]["models"][0])):
        assert getattr(ours, "_metadata", None) == theirs._metadata, "the module versions torch's round trip keeps"
        assert ours._metadata[""] == {"version": 1} and ours._metadata["0"] == {"version": 2}
        assert ours._metadata["1"] == theirs._metadata["1"] == {"version": torch.nn.BatchNorm1d._version}
        got, expected = _loaded_into_fresh(ours), _loaded_into_fresh(theirs)
        assert torch.equal(got[0].log_scale, expected[0].log_scale)
        assert got[0].log_scale.item() == 0.5, "a current checkpoint is not converted as an old one"
        assert _same(dict(got.state_dict()), dict(expected.state_dict()))


# -- 2. the tag name as a user's key -------------------------------------------------------------------


COLLIDING = {
    "tag-names-a-decoder": {TAG: "path", "value": "/etc"},
    "unknown-tag": {TAG: "v1", "n": 1},
    "looks-escaped": {TAG: "escaped", "ordered": True, "items": [["a", 1]]},
    "tag-not-a-string": {TAG: 3, "x": [1, 2]},
    "with-tagged-values": {TAG: "dict", "p": pathlib.Path("runs/a"), "s": {1, 2}, "b": b"\x00\xff"},
    "nested": {"outer": [{TAG: "set", "value": [1, 2]}, ({TAG: "numpy.generic"},)],
               "inner": {"deeper": {TAG: "path", "value": {TAG: "date", "value": "2026-01-02"}}}},
    "ordered": collections.OrderedDict([("z", 1), (TAG, "namespace"), ("a", collections.OrderedDict([(TAG, "x"), ("b", 2)]))]),
    "ordered-inside-list": [collections.OrderedDict([("b", 0), (TAG, "bytes"), ("a", torch.arange(3))])],
}


@pytest.mark.parametrize("name", list(COLLIDING))
def test_a_user_dict_keyed_by_the_tag_name_comes_back_as_it_was(tmp_path: pathlib.Path, name: str) -> None:
    """A dict whose own key is the tag name (a decoder's tag, an unknown tag, nested, ordered) comes back
    equal: same types, keys in the same order, same values."""
    value = COLLIDING[name]
    checkpoint.save(tmp_path / "c.ckpt", {"meta": value, "around": {"x": [value]}}, kind="t")
    back = checkpoint.load(tmp_path / "c.ckpt", kind="t")
    assert _same(back["meta"], value), (value, back["meta"])
    assert _same(back["around"], {"x": [value]})


# -- 3. a malicious pickle ---------------------------------------------------------------------------


def _text(s: str) -> bytes:
    data = s.encode()
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _pickle_holding(x: bytes) -> bytes:
    """By hand, opcode by opcode: ``{"format": ..., "version": 3, "kind": "t", "x": <the opcodes x>}``."""
    return (pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.MARK
            + _text("format") + _text("amp-backends-checkpoint")
            + _text("version") + pickle.BININT1 + b"\x03"
            + _text("kind") + _text("t")
            + _text("x") + x
            + pickle.SETITEMS + pickle.STOP)


def _call(module: str, name: str, argument: str) -> bytes:
    """The opcodes of ``module.name(argument)`` (nothing here imports or calls the function)."""
    return pickle.GLOBAL + f"{module}\n{name}\n".encode() + _text(argument) + pickle.TUPLE1 + pickle.REDUCE


def _torch_file_holding(pickled: bytes) -> bytes:
    """A torch.save zip file whose data.pkl is ``pickled`` (the other records torch's own)."""
    buffer = io.BytesIO()
    torch.save({}, buffer)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        for info in source.infolist():
            zf.writestr(info, pickled if info.filename.endswith("/data.pkl") else source.read(info))
    return out.getvalue()


class _UserThing:
    pass


def test_a_pickle_calling_a_blocked_function_is_refused_as_malicious(tmp_path: pathlib.Path) -> None:
    """A file that would call os.system: refused naming posix.system (nt.system) as blocked, without
    advice to load it with weights_only=False or to re-run; nothing runs. A user class still names
    add_safe_globals."""
    module = os.system.__module__  # posix, or nt
    marker = tmp_path / "ran"
    path = tmp_path / "evil.ckpt"
    _write_checkpoint(tmp_path / "plain.ckpt", _torch_file_holding(_pickle_holding(_text("plain"))))
    assert checkpoint.load(tmp_path / "plain.ckpt", kind="t")["x"] == "plain", "the file built by hand is a valid checkpoint"
    _write_checkpoint(path, _torch_file_holding(_pickle_holding(_call(module, "system", f"touch {marker}"))))
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path, kind="t")
    message = str(info.value)
    assert not marker.exists(), "the pickle's call never ran"
    assert f"{module}.system" in message and "blocked" in message, message
    assert "weights_only=False" not in message and "Re-running" not in message and "add_safe_globals" not in message, message
    assert "\n" not in message and "\x1b" not in message

    buffer = io.BytesIO()
    torch.save({"format": "amp-backends-checkpoint", "version": 3, "kind": "t", "x": _UserThing()}, buffer)
    _write_checkpoint(tmp_path / "user.ckpt", buffer.getvalue())
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(tmp_path / "user.ckpt", kind="t")
    message = str(info.value)
    assert "test_checkpoint_hostile._UserThing" in message and "add_safe_globals([_UserThing])" in message, message
    assert "weights_only=False" not in message and "Re-running" not in message, message


# -- 4. memory ---------------------------------------------------------------------------------------


_MEASURE = """
import gc, resource, sys
import torch
torch.set_num_threads(1)
from amp_backends import checkpoint

mode, path = MODE, PATH
checkpoint.save(path + ".warm", {"w": torch.ones(4)}, kind="m")  # imports and first-call work, unmeasured
checkpoint.load(path + ".warm", kind="m")
unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
if mode == "save":
    state = {"w": torch.ones(NUMEL)}  # written: its pages are resident before the baseline
else:
    state = None
gc.collect()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if mode == "save":
    checkpoint.save(path, state, kind="m")
else:
    state = checkpoint.load(path, kind="m")
    assert state["w"].numel() == NUMEL
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * unit)
"""

_NUMEL = 16 * 2**20  # float32: 64 MiB


def _extra_peak_bytes(mode: str, path: pathlib.Path) -> int:
    """The rise of the peak resident size over ``mode`` (save or load of ``path``), in a fresh process."""
    code = _MEASURE.replace("NUMEL", str(_NUMEL)).replace("MODE", repr(mode)).replace("PATH", repr(str(path)))
    proc = run_python(code, env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip().splitlines()[-1])


def test_save_and_load_do_not_hold_the_file_in_memory_beside_the_state(tmp_path: pathlib.Path) -> None:
    """Peak resident size: checkpoint.save of a 64 MiB state adds under half of it (streamed, hashed in
    blocks), checkpoint.load under 1.5x (the loaded state is 1x, as torch.load's own)."""
    pytest.importorskip("resource")
    size = _NUMEL * 4
    path = tmp_path / "big.ckpt"
    saved = _extra_peak_bytes("save", path)
    assert path.stat().st_size > size
    loaded = _extra_peak_bytes("load", path)
    rises = (f"peak rose {saved / 2**20:.1f} MiB in checkpoint.save, {loaded / 2**20:.1f} MiB in checkpoint.load, "
             f"for a {size / 2**20:.0f} MiB state")
    assert saved < 0.5 * size and loaded < 1.5 * size, rises


# -- 5. resume bitwise; truncated is corrupt ---------------------------------------------------------


def _training_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 3).to(torch.bfloat16))
    head = torch.nn.Linear(3, 2).half()
    opt = torch.optim.AdamW([*model[:2].parameters()], lr=1e-2)
    h = model[:2](torch.randn(4, 5))
    model[2](h.bfloat16()).float().square().mean().backward()
    opt.step()
    return {"model": model.state_dict(), "head": head.state_dict(), "optimizer": opt.state_dict(),
            "scaler": GradScaler("cpu", init_scale=256.0).state_dict(), "step": 7,
            "strided": torch.arange(12.0).reshape(3, 4).t(), "ints": torch.arange(5, dtype=torch.int64),
            "flags": torch.tensor([True, False]), "rng": torch.get_rng_state()}


def test_a_saved_state_resumes_bitwise_and_a_truncated_copy_is_corrupt(tmp_path: pathlib.Path) -> None:
    """Save then load: every tensor bitwise with its dtype, the rest equal (regression guard for the
    streamed checksum); a copy cut short anywhere, or with a byte flipped, is refused as corrupt."""
    state = _training_state()
    path = tmp_path / "c.ckpt"
    checkpoint.save(path, state, kind="train")
    back = checkpoint.load(path, kind="train")
    assert {k: v for k, v in back.items() if k not in ("format", "version", "kind")}.keys() == state.keys()
    for key, value in state.items():
        assert _same(back[key], value), key
    assert back["model"]["2.weight"].dtype == torch.bfloat16 and back["head"]["weight"].dtype == torch.float16
    assert torch.equal(back["strided"], state["strided"])

    data = path.read_bytes()
    header = data.index(b"\n") + 1
    cuts = [len(data) - 1, len(data) // 2, header + 1, header]
    for n, cut in enumerate(cuts):
        short = tmp_path / f"short{n}.ckpt"
        short.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match="is corrupt: its contents do not match the checksum"):
            checkpoint.load(short, kind="train")
    flipped = bytearray(data)
    flipped[(header + len(data)) // 2] ^= 0x01
    (tmp_path / "flipped.ckpt").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="is corrupt"):
        checkpoint.load(tmp_path / "flipped.ckpt", kind="train")
    (tmp_path / "longer.ckpt").write_bytes(data + b"\0")
    with pytest.raises(CheckpointError, match="is corrupt"):
        checkpoint.load(tmp_path / "longer.ckpt", kind="train")
