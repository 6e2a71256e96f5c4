"""A full disk while a checkpoint is written, for real: ``nas train`` writes its run folder on a small tmpfs.

The first checkpoint fits; replacing it needs room for two copies, which the tmpfs does not have, so
the second write fails with ``ENOSPC``. The command must stop with one line naming the file and the
fix (exit 2), keep the previous checkpoint loadable, leave no temporary file, and, once there is room
again, resume from that checkpoint to the same weights as an uninterrupted run.

Needs root (``mount -t tmpfs``), as the test machines have; skipped elsewhere.
"""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from nas.errors import DiskFullError
from nas.atomic import atomic_path, atomic_write_bytes, disk_full_errno
from nas.model.io import load_model
from nas.builders import prepare_sweep_data
from nas.space import parse_spec
from tests.conftest import tiny_spec_dict
from trainers import train_supernet


@pytest.fixture
def small_disk(tmp_path):
    """Mount a tmpfs at ``tmp_path / "disk"``; yields ``resize(bytes)`` (remount at that size) and the folder."""
    mount = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount.mkdir()

    def resize(size: int) -> None:
        verb = ["-o", f"remount,size={size}"] if os.path.ismount(mount) else ["-o", f"size={size}"]
        done = subprocess.run(["mount", "-t", "tmpfs", *verb, "tmpfs", str(mount)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")

    resize(64 * 1024)
    yield resize, mount
    subprocess.run(["umount", str(mount)], capture_output=True)


def _fill(folder: Path, leave: int) -> None:
    """Fill ``folder``'s disk until about ``leave`` bytes are free."""
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    (folder / "ballast").write_bytes(b"\0" * max(free - leave, 0))


def test_a_full_disk_keeps_the_old_file_and_names_it(small_disk):
    resize, disk = small_disk
    target = disk / "weights.bin"
    atomic_write_bytes(target, b"old" * 1000)
    _fill(disk, leave=8 * 1024)
    with pytest.raises(DiskFullError) as err:
        atomic_write_bytes(target, b"new" * 100_000)  # 300 kB: cannot fit beside the old file
    message = str(err.value)
    assert "weights.bin" in message and "No space left on device" in message and "is kept" in message
    assert "MiB free" in message and "\n" not in message
    assert err.value.errno == 28
    assert target.read_bytes() == b"old" * 1000
    assert sorted(p.name for p in disk.iterdir()) == ["ballast", "weights.bin"]  # no temporary file left


def test_a_rust_writers_full_disk_is_recognised(small_disk):
    """safetensors raises its own error type with no errno: the code is read from its message."""
    from safetensors.torch import save_file

    resize, disk = small_disk
    with pytest.raises(DiskFullError) as err:
        with atomic_path(disk / "model.safetensors") as tmp:
            save_file({"w": torch.zeros(100_000)}, str(tmp))  # 400 kB on a 64 kB disk
    assert "nothing was written" in str(err.value)
    assert list(disk.iterdir()) == []


def test_other_errors_are_not_called_a_full_disk():
    assert disk_full_errno(OSError(13, "Permission denied")) is None
    assert disk_full_errno(RuntimeError("enforce fail: unexpected pos 576 vs 534")) is None
    assert disk_full_errno(RuntimeError("I/O error: No space left on device (os error 28)")) == 28
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = OSError(122, "Disk quota exceeded")
    assert disk_full_errno(wrapped) == 122


@pytest.mark.slow
def test_nas_train_on_a_full_disk_keeps_its_checkpoint_and_resumes(multi30k, tmp_path, small_disk):
    resize, disk = small_disk
    raw = tiny_spec_dict(multi30k, tmp_path)
    raw["train"] |= {"steps": 6, "checkpoint_every": 2, "keep_last": 0, "precision": "fp32", "log_every": 1,
                     "stage_eval": False}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    spec = parse_spec(raw)
    data = prepare_sweep_data(spec, progress=False)
    train_supernet(spec, data, tmp_path / "straight", progress=False)
    size = (tmp_path / "straight" / "checkpoint.pt").stat().st_size
    resize(int(size * 1.5))  # room for one checkpoint, not for its replacement beside it

    out = disk / "run"
    cmd = [sys.executable, "-m", "nas.cli", "train", str(path), "--out", str(out)]
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    full = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert full.returncode == 2, full.stderr[-3000:]
    last = full.stderr.strip().splitlines()[-1]
    assert "checkpoint.pt" in last and "No space left on device" in last and "is kept" in last, last
    assert "Traceback" not in full.stderr
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["state"]["step"] == 2  # the first checkpoint, intact
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]

    resize(int(size * 8))  # room again: the same command resumes from step 2
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    straight = load_model(tmp_path / "straight", "supernet").state_dict()
    for name, p in load_model(out, "supernet").state_dict().items():
        assert torch.allclose(p, straight[name], atol=1e-6), name
