"""The one-process lock of a store's writer and of a run directory: a copy of the directory
made with hard links (``cp -al``) locks apart from the original."""

from __future__ import annotations

import os

from jaxstream.pidlock import PidLock


def test_a_hard_linked_copy_locks_apart_from_the_original(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "writer.lock").write_text("")
    os.link(a / "writer.lock", b / "writer.lock")  # cp -al
    original = PidLock(a / "writer.lock")
    assert original.acquire() is None
    copy, again = PidLock(b / "writer.lock"), PidLock(b / "writer.lock")
    assert copy.acquire() is None  # before: "held by pid N" (the original's holder)
    assert again.acquire() is not None  # the copy's own lock still holds one process
    assert PidLock(a / "writer.lock").acquire() is not None  # and the original's
    assert os.stat(a / "writer.lock").st_ino != os.stat(b / "writer.lock").st_ino
    for lock in (original, copy):
        lock.release()


def test_a_shared_lock_file_held_now_is_left_to_name_its_holder(tmp_path):
    """Linked while held: the file is not replaced under its holder (two processes would both
    hold the directory's lock), so another process is refused, naming the holder."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    holder = PidLock(a / "writer.lock")
    assert holder.acquire() is None
    os.link(a / "writer.lock", b / "writer.lock")  # cp -al while it is held
    for path in (a / "writer.lock", b / "writer.lock"):
        refused = PidLock(path).acquire()
        assert refused is not None and str(os.getpid()) in refused
    assert os.stat(a / "writer.lock").st_ino == os.stat(b / "writer.lock").st_ino
    holder.release()
