"""Checkpoints resume what they saved: every value a training script keeps (numpy metrics and RNG state,
argument namespaces, paths, dates, sets, bytes) comes back equal and of its own type through the
weights-only loader; what cannot come back is refused by ``save``, naming where it is and what to save
instead, with nothing written; a bad path or a foreign file is one clear CheckpointError."""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import io
import os
import pathlib
import random

import numpy as np
import pytest
import torch

from amp_backends import GradScaler, checkpoint
from amp_backends.checkpoint import CheckpointError


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, argparse.Namespace):
        return _same(vars(a), vars(b))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


VALUES = {
    "np-float64": np.float64(0.9375),          # sklearn's accuracy_score
    "np-float32": np.float32(1.5),
    "np-int64": np.int64(-3),
    "np-bool": np.bool_(True),
    "np-nan": np.float64("nan"),
    "np-array": np.arange(6, dtype=np.float32).reshape(2, 3),
    "np-array-empty": np.zeros((0, 4), dtype=np.int16),
    "np-array-fortran": np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
    "np-rng": np.random.RandomState(3).get_state(),
    "py-rng": random.Random(5).getstate(),
    "namespace": argparse.Namespace(lr=0.1, out=pathlib.Path("runs/a"), seed=np.int64(1)),
    "path": pathlib.Path("data/train"),
    "datetime": datetime.datetime(2026, 11, 24, 10, 30, 1, 5),
    "aware-datetime": datetime.datetime(2026, 11, 24, 10, 30, tzinfo=datetime.timezone.utc),
    "date": datetime.date(2026, 1, 2),
    "timedelta": datetime.timedelta(days=1, seconds=5, microseconds=7),
    "set": {1, 2, 3},
    "frozenset": frozenset({"a"}),
    "complex": 1.5 - 2j,
    "bytes": b"\x00\xffab",
    "bytes-empty": b"",
    "nested": {"metrics": [np.float64(0.5), {"best": np.float32(2.0)}], "t": (1, torch.ones(2))},
    "ordered": collections.OrderedDict(b=1, a=2),
}


@pytest.mark.parametrize("name", list(VALUES))
def test_a_value_a_training_script_keeps_comes_back_as_it_was(tmp_path, name):
    path = tmp_path / "c.ckpt"
    checkpoint.save(path, {"value": VALUES[name]}, kind="t")
    back = checkpoint.load(path, kind="t")["value"]
    assert _same(VALUES[name], back), (VALUES[name], back)


def test_the_documented_resume_path_with_a_metric_and_the_rng_states(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    scaler = GradScaler("cpu", init_scale=256.0)
    np.random.seed(0)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
             "best_accuracy": np.float64(0.81), "numpy_rng": np.random.get_state(), "torch_rng": torch.get_rng_state(),
             "args": argparse.Namespace(epochs=3, data=pathlib.Path("d")), "saved_at": datetime.datetime(2026, 1, 1)}
    checkpoint.save(tmp_path / "c.ckpt", state, kind="train")
    expected = np.random.rand(3)
    np.random.rand(5)
    back = checkpoint.load(tmp_path / "c.ckpt", kind="train", required=("model", "scaler"))
    np.random.set_state(back["numpy_rng"])
    assert np.array_equal(np.random.rand(3), expected), "the numpy RNG resumes where it was saved"
    GradScaler("cpu").load_state_dict(back["scaler"])
    assert back["best_accuracy"] == 0.81 and type(back["best_accuracy"]) is np.float64


class _Config:
    pass


@pytest.mark.parametrize(("value", "words"), [
    (GradScaler("cpu"), "state['x'] is a GradScaler object: save its state_dict()"),
    (torch.nn.Linear(2, 2), "is a Linear object: save its state_dict()"),
    (_Config(), "test_checkpoint_values._Config, which checkpoint.load (weights-only, safe) cannot read back"),
    (np.array([object()]), "numpy array of Python objects"),
    (collections.namedtuple("P", "a")(1), "cannot read back"),
    ({object(): 1}, "has a key of type object"),
], ids=["scaler-object", "module-object", "custom-class", "object-array", "namedtuple", "object-key"])
def test_what_cannot_come_back_is_refused_when_saving_and_nothing_is_written(tmp_path, value, words):
    path = tmp_path / "c.ckpt"
    checkpoint.save(path, {"x": 1}, kind="t")
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match="cannot save") as info:
        checkpoint.save(path, {"x": value}, kind="t")
    assert words in str(info.value)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["c.ckpt"]


def test_an_allowlisted_type_is_kept_as_it_is(tmp_path):
    if not hasattr(torch.serialization, "safe_globals"):
        pytest.skip(f"torch.serialization.safe_globals arrived in torch 2.5; this is torch {torch.__version__}")
    with torch.serialization.safe_globals([_Allowed]):
        checkpoint.save(tmp_path / "c.ckpt", {"x": _Allowed()}, kind="t")
        assert type(checkpoint.load(tmp_path / "c.ckpt", kind="t")["x"]) is _Allowed


class _Allowed:
    pass


@pytest.mark.parametrize(("state", "words"), [
    ([1, 2], "must be a mapping of names to values"),
    ("model", "must be a mapping of names to values"),
])
def test_a_state_that_is_not_a_mapping_is_refused(tmp_path, state, words):
    with pytest.raises(CheckpointError, match=words):
        checkpoint.save(tmp_path / "c.ckpt", state, kind="t")


def test_bad_paths_are_clear_errors(tmp_path):
    (tmp_path / "afile").write_text("x")
    os.symlink(tmp_path / "loop1", tmp_path / "loop2")
    os.symlink(tmp_path / "loop2", tmp_path / "loop1")
    cases = [
        (lambda: checkpoint.save("", {}, kind="t"), "the checkpoint path is empty"),
        (lambda: checkpoint.save(tmp_path / "afile" / "c.ckpt", {}, kind="t"), "afile is a file, not a directory"),
        (lambda: checkpoint.save(tmp_path, {}, kind="t"), "is a directory: give a file name inside it"),
        (lambda: checkpoint.save(tmp_path / "loop1", {}, kind="t"), "is a symlink that loops"),
        (lambda: checkpoint.save(3, {}, kind="t"), "must be a str or a path, got int"),
        (lambda: checkpoint.load("", kind="t"), "the checkpoint path is empty"),
        (lambda: checkpoint.load(tmp_path, kind="t"), "is a directory, not a checkpoint file"),
        (lambda: checkpoint.load(tmp_path / "loop1", kind="t"), "is a symlink that loops"),
    ]
    for call, words in cases:
        with pytest.raises(CheckpointError) as info:
            call()
        assert words in str(info.value)
    assert os.path.islink(tmp_path / "loop1") and os.path.islink(tmp_path / "loop2"), "the links are left alone"


def test_a_symlink_to_a_checkpoint_is_followed_and_kept(tmp_path):
    real = tmp_path / "real.ckpt"
    link = tmp_path / "latest.ckpt"
    checkpoint.save(real, {"x": 1}, kind="t")
    os.symlink(real, link)
    checkpoint.save(link, {"x": 2}, kind="t")
    assert os.path.islink(link) and checkpoint.load(real, kind="t")["x"] == 2


def _foreign(path: pathlib.Path, payload: dict, version: bytes = b"2") -> None:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    body = buffer.getvalue()
    path.write_bytes(b"amp-backends-checkpoint " + version + b" " + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)


def test_a_file_weights_only_loading_refuses_names_the_global_and_the_safe_way(tmp_path):
    """A checkpoint written elsewhere with an object in it: the error names the global and
    add_safe_globals, never torch's weights_only=False advice (load never takes it), and has no
    terminal escape codes (from torch's message or the file name)."""
    path = tmp_path / "bad\x1b[31m.ckpt"
    _foreign(path, {"format": "amp-backends-checkpoint", "kind": "t", "x": _Config()})
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path, kind="t")
    message = str(info.value)
    assert "test_checkpoint_values._Config" in message and "add_safe_globals" in message
    assert "weights_only=False" not in message and "\x1b" not in message and "bad\\x1b[31m.ckpt" in message


def test_version_2_checkpoints_still_load(tmp_path):
    path = tmp_path / "v2.ckpt"
    _foreign(path, {"format": "amp-backends-checkpoint", "version": 2, "kind": "t", "x": torch.ones(2)})
    assert torch.equal(checkpoint.load(path, kind="t")["x"], torch.ones(2))
    _foreign(path, {"format": "amp-backends-checkpoint", "kind": "t"}, version=b"9")
    with pytest.raises(CheckpointError, match="reads versions 2, 3"):
        checkpoint.load(path, kind="t")
