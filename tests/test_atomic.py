"""nas.atomic: atomic writes leave the old file or the new one, never a torn one or a temporary file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nas import atomic
from nas.errors import OutputPathError


def test_atomic_write_text_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a" / "b.json"
    atomic.atomic_write_text(path, "old")
    atomic.atomic_write_text(path, "new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in path.parent.iterdir()) == ["b.json"]
    assert oct(path.stat().st_mode & 0o777) == oct(0o644)


def test_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    path = tmp_path / "b.bin"
    atomic.atomic_write_bytes(path, b"old")

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic.atomic_write_bytes(path, b"new")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["b.bin"]


def test_atomic_path_fsyncs_before_the_rename(tmp_path, monkeypatch):
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    with atomic.atomic_path(tmp_path / "w.bin") as tmp:
        tmp.write_bytes(b"x" * 10)
        assert not (tmp_path / "w.bin").exists()
    assert (tmp_path / "w.bin").read_bytes() == b"x" * 10
    assert synced  # the file (and its folder) were fsync-ed


def test_atomic_path_removes_the_temporary_when_the_block_raises(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic.atomic_path(tmp_path / "w.bin") as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("writer crashed")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- output folders and files


def _folder(path, files: dict[str, str]):
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def _contents(path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(path.iterdir())}


def test_output_dir_replaces_an_earlier_output_and_leaves_no_sibling(tmp_path):
    out = _folder(tmp_path / "out", {"done.json": "old", "weights": "old"})
    with atomic.output_dir(out, marker="done.json") as new:
        assert new.parent == tmp_path and new.name.startswith(".out.")
        assert _contents(out) == {"done.json": "old", "weights": "old"}  # untouched until the swap
        _folder(new, {"done.json": "new"})
    assert _contents(out) == {"done.json": "new"}
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def _killed_between_the_renames(out: Path) -> Path:
    """What a kill after ``output_dir`` renamed ``out`` aside, before it renamed the new folder in, leaves."""
    aside = out.with_name(f".{out.name}.0badc0de.old")
    out.rename(aside)
    _folder(out.with_name(f".{out.name}.feedf00d.tmp"), {"done.json": "half"})
    return aside


def test_an_output_left_aside_by_a_kill_is_renamed_back_before_anything_else(tmp_path, capsys):
    """Failed before: ``out`` stayed missing, the user's earlier export hidden as ``.out.*.old``."""
    out = _folder(tmp_path / "out", {"done.json": "old", "weights": "old"})
    _killed_between_the_renames(out)
    with pytest.raises(KeyError):
        with atomic.output_dir(out, marker="done.json"):
            raise KeyError("the writer failed")
    assert _contents(out) == {"done.json": "old", "weights": "old"}
    assert "restored from .out.0badc0de.old" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.feedf00d.tmp", "out"]  # a writer's tmp is not ours


def test_recovery_removes_an_earlier_output_left_aside_but_keeps_a_forced_one(tmp_path):
    out = _folder(tmp_path / "out", {"done.json": "old"})
    ours = _folder(tmp_path / ".out.00000001.old", {"done.json": "older"})
    forced = _folder(tmp_path / ".out.00000002.old", {"notes.txt": "the user's"})
    with atomic.output_dir(out, marker="done.json") as new:
        _folder(new, {"done.json": "new"})
    assert _contents(out) == {"done.json": "new"}
    assert not ours.exists()
    assert _contents(forced) == {"notes.txt": "the user's"}


def test_recovery_renames_nothing_back_when_several_outputs_lie_aside(tmp_path):
    first = _folder(tmp_path / ".out.00000001.old", {"done.json": "1"})
    second = _folder(tmp_path / ".out.00000002.old", {"done.json": "2"})
    lines = atomic.recover_output_dir(tmp_path / "out", marker="done.json")
    assert len(lines) == 1 and "2 earlier outputs" in lines[0] and "rename the one to keep back" in lines[0]
    assert first.is_dir() and second.is_dir() and not (tmp_path / "out").exists()


def test_output_dir_refuses_a_folder_with_other_files_and_names_them_unless_forced(tmp_path):
    out = _folder(tmp_path / "mine", {f"note{i}.txt": "keep" for i in range(7)})
    with pytest.raises(OutputPathError, match=r"mine is not empty and is no earlier output \(it has no done.json\): "
                                                 r"note0.txt, note1.txt, note2.txt, note3.txt, note4.txt, "
                                                 r"\.\.\. \(7 entries\); .* pass --force"):
        with atomic.output_dir(out, marker="done.json"):
            pytest.fail("the block must not run")
    assert len(_contents(out)) == 7 and [p.name for p in tmp_path.iterdir()] == ["mine"]
    with atomic.output_dir(out, marker="done.json", force=True) as new:
        _folder(new, {"done.json": "new"})
    assert _contents(out) == {"done.json": "new"}


def test_output_dir_accepts_a_missing_or_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    for name in ("empty", "missing/deeper"):
        with atomic.output_dir(tmp_path / name, marker="done.json") as new:
            _folder(new, {"done.json": name})
        assert _contents(tmp_path / name) == {"done.json": name}


@pytest.mark.parametrize("path", [".", "..", "/", "sub/..", "CWD", "HOME"])
def test_output_dir_never_replaces_the_cwd_its_ancestors_or_home_even_with_force(tmp_path, monkeypatch, path):
    cwd = _folder(tmp_path / "work", {"done.json": "an earlier output, even"})
    (cwd / "sub").mkdir()
    home = _folder(tmp_path / "home", {"done.json": "mine"})
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    path = {"CWD": str(cwd), "HOME": str(home)}.get(path, path)
    with pytest.raises(OutputPathError, match=r"refusing to replace .*: it is (the|an|your) .*not even with --force"):
        with atomic.output_dir(path, marker="done.json", force=True):
            pytest.fail("the block must not run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home", "work"]
    assert sorted(p.name for p in cwd.iterdir()) == ["done.json", "sub"] and _contents(home) == {"done.json": "mine"}


def test_output_dir_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("data")
    with pytest.raises(OutputPathError, match=r"f is a file, not a folder"):
        with atomic.output_dir(tmp_path / "f", marker="done.json", force=True):
            pytest.fail("the block must not run")
    assert (tmp_path / "f").read_text() == "data"


def test_a_failed_write_or_swap_keeps_the_earlier_output_and_cleans_the_new_folder(tmp_path, monkeypatch):
    out = _folder(tmp_path / "out", {"done.json": "old"})
    with pytest.raises(RuntimeError, match="writer crashed"):
        with atomic.output_dir(out, marker="done.json") as new:
            _folder(new, {"done.json": "half"})
            raise RuntimeError("writer crashed")
    assert _contents(out) == {"done.json": "old"} and [p.name for p in tmp_path.iterdir()] == ["out"]

    real = os.rename
    calls: list[str] = []

    def second_rename_fails(src, dst):
        calls.append(os.path.basename(dst))
        if len(calls) == 2:  # the old folder is aside, the new one not yet in place
            assert not os.path.exists(out)
            raise OSError("rename failed")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", second_rename_fails)
    with pytest.raises(OSError, match="rename failed"):
        with atomic.output_dir(out, marker="done.json") as new:
            _folder(new, {"done.json": "new"})
    monkeypatch.undo()
    assert calls[1] == "out" and calls[2] == "out"  # renamed aside, failed, renamed back
    assert _contents(out) == {"done.json": "old"} and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_output_dir_requires_the_writer_to_leave_its_marker(tmp_path):
    with pytest.raises(RuntimeError, match="left no done.json"):
        with atomic.output_dir(tmp_path / "out", marker="done.json") as new:
            (new / "other").write_text("x")
    assert list(tmp_path.iterdir()) == []


def test_a_file_write_onto_a_folder_is_refused_with_one_line(tmp_path):
    (tmp_path / "dir").mkdir()
    with pytest.raises(OutputPathError, match=r"dir is a folder, not a file; give the path of a file"):
        atomic.atomic_write_text(tmp_path / "dir", "x")
    assert [p.name for p in tmp_path.iterdir()] == ["dir"] and list((tmp_path / "dir").iterdir()) == []
