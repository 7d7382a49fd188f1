"""Store integrity: checksums, missing chunks, manifest validation, one writer, fresh readers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from jaxstream.stream import LayerStore
from jaxstream.stream.errors import (
    StoreCorruptError,
    StoreError,
    StoreLockedError,
    StoreMismatchError,
    StoreNonFiniteError,
    StoreStaleError,
)


def _params(layers=3, width=4):
    r = np.random.default_rng(0)
    return {"embed": {"w": r.standard_normal((5, width), dtype=np.float32)},
            "blocks": {"w": r.standard_normal((layers, width, width), dtype=np.float32)},
            "head": {"w": r.standard_normal((width, 2), dtype=np.float32)}}


def _open(path):
    import optax

    return LayerStore.open(path, optimizer=optax.adam(1e-3))


def _layer(v, width=4):
    return {"w": np.full((width, width), v, np.float32)}


def _chunk(root, kind, layer, slot, leaf=0):
    """The file of one chunk: <kind>/blocks/<leaf>/c/<layer>/<slot>[/0/0...]."""
    import glob

    base = os.path.join(root, kind, "blocks", str(leaf), "c", str(layer), str(slot))
    return base if os.path.isfile(base) else min(
        f for f in glob.glob(base + "/**", recursive=True) if os.path.isfile(f))


@pytest.fixture
def store_path(tmp_path):
    import optax

    path = str(tmp_path / "s")
    LayerStore.create(path, _params(), optimizer=optax.adam(1e-3))
    return path


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete_param", "delete_opt"])
def test_damaged_chunk_is_an_error_naming_leaf_and_layer(store_path, damage):
    import optax

    kind = "opt" if damage == "delete_opt" else "params"
    f = _chunk(store_path, kind, 1, 0, leaf=1 if kind == "opt" else 0)
    data = bytearray(Path(f).read_bytes())
    if damage == "flip":
        data[7] ^= 0x10
        Path(f).write_bytes(data)
    elif damage == "truncate":
        Path(f).write_bytes(data[:9])
    else:
        os.remove(f)
    store = LayerStore.open(store_path, optimizer=optax.adam(1e-3))
    read = store.read_opt if kind == "opt" else store.read
    with pytest.raises(StoreCorruptError, match=r"leaf .* of layer 1"):
        read(1).result()
    np.testing.assert_array_equal(store.read(0).result()["w"], _params()["blocks"]["w"][0])


def test_manifest_pointing_at_never_written_slot(store_path):
    m = json.loads(Path(store_path, "manifest.json").read_text())
    m["slots"]["blocks"][2] = 1
    _rewrite_manifest(store_path, m, fix_checksum=True)
    with pytest.raises(StoreCorruptError, match="layer 2 .*missing"):
        _open(store_path).read(2).result()


def _rewrite_manifest(path, m, fix_checksum):
    from jaxstream.stream.manifest import encode

    data = encode(m) if fix_checksum else json.dumps(m).encode()
    Path(path, "manifest.json").write_bytes(data)


@pytest.mark.parametrize("edit, match", [
    (lambda f: f.write_text(""), "manifest.json: not valid JSON"),
    (lambda f: f.write_text("{\"step\": 1,"), r"manifest.json: not valid JSON \(line 1"),
    ("step", r"manifest.json: field 'checksum'"),
    ({"step": -1}, r"manifest.json: field 'step' must be an integer >= 0"),
    ({"slots.blocks": [0, 2, 0]}, r"manifest.json: field 'slots.blocks\[1\]' must be 0 or 1"),
    ({"slots.embed": -1}, r"manifest.json: field 'slots.embed' must be 0 or 1"),
    ({"slots.blocks": [0]}, r"manifest.json: field 'slots.blocks' must be a list of num_layers=3"),
    ({"leaf_shape": [4, 5]}, r"field 'leaves.params.blocks\[0\]' says shape \[3, 2, 4, 5\]"),
])
def test_invalid_manifest_names_file_and_field(store_path, edit, match):
    f = Path(store_path) / "manifest.json"
    if callable(edit):
        edit(f)
    else:
        m = json.loads(f.read_text())
        if edit == "step":  # hand-edited without a new checksum
            m["step"] = 999
            f.write_text(json.dumps(m))
        else:
            for k, v in edit.items():
                if k == "leaf_shape":
                    m["leaves"]["params"]["blocks"][0]["shape"] = v
                elif k.startswith("slots."):
                    m["slots"][k.split(".")[1]] = v
                else:
                    m[k] = v
            _rewrite_manifest(store_path, m, fix_checksum=True)
    with pytest.raises(StoreCorruptError, match=match):
        _open(store_path)


def test_every_store_error_is_a_store_error():
    from jaxstream.stream import errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, Exception)]
    assert len(classes) >= 8 and all(issubclass(c, StoreError) for c in classes)
    assert issubclass(StoreMismatchError, ValueError)


def test_non_finite_params_are_never_staged(store_path):
    store = _open(store_path)
    store.write(0, _layer(1.0))
    with pytest.raises(StoreNonFiniteError, match="stays at step 0"):
        store.write(1, _layer(np.nan))
    store.commit(1)  # the failed step was dropped as a whole: nothing staged remains
    again = _open(store_path)
    assert again.step == 1
    np.testing.assert_array_equal(again.read(0).result()["w"], _params()["blocks"]["w"][0])


def test_second_writer_process_is_refused_naming_the_pid(store_path):
    store = _open(store_path)
    store.write(0, _layer(1.0))  # holds the writer lock until commit
    other = textwrap.dedent("""
        import sys, numpy as np
        from jaxstream.stream import LayerStore
        s = LayerStore.open(sys.argv[1])
        s.write(0, {"w": np.zeros((4, 4), np.float32)})
    """)
    out = subprocess.run([sys.executable, "-c", other, store_path], capture_output=True, text=True, check=False,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert out.returncode != 0
    assert f"pid {os.getpid()}" in out.stderr and "StoreLockedError" in out.stderr
    store.commit(1)


def test_writer_that_missed_another_commit_is_refused(store_path):
    a, b = _open(store_path), _open(store_path)
    a.write(0, _layer(1.0))
    a.commit(1)
    with pytest.raises(StoreStaleError, match="another writer .* step 1"):
        b.write(0, _layer(2.0))
    with pytest.raises(StoreLockedError):  # while a holds the lock mid-step
        a.write(0, _layer(3.0))
        _open(store_path).write(1, _layer(4.0))
    a.commit(2)


def test_reader_sees_its_step_or_an_error(store_path):
    reader = _open(store_path)
    writer = _open(store_path)
    for step in (1, 2):
        writer.write(0, _layer(float(step)))
        writer.commit(step)
    assert reader.step == 0
    with pytest.raises(StoreStaleError, match="opened at step 0"):
        reader.read(0).result()  # slot of step 0 was overwritten by step 2
    with pytest.raises(StoreStaleError):
        reader.read_params()
    np.testing.assert_array_equal(_open(store_path).read(0).result()["w"],
                                  _layer(2.0)["w"])


def test_reader_one_commit_behind_still_reads_untouched_slots(store_path):
    reader = _open(store_path)
    writer = _open(store_path)
    writer.write(0, _layer(1.0))
    writer.commit(1)
    # layer 1 was not rewritten: its slot is intact; layer 0 moved and may be overwritten next
    np.testing.assert_array_equal(reader.read(1).result()["w"], _params()["blocks"]["w"][1])
    with pytest.raises(StoreStaleError):
        reader.read(0).result()


@pytest.mark.parametrize("direct", [True, False], ids=["file-reads", "tensorstore-reads"])
def test_a_sound_chunk_that_is_not_what_was_committed_is_refused(store_path, direct, monkeypatch):
    """Every chunk carries a valid crc32c, so only the manifest's record of what each commit
    wrote can tell a swapped, copied-in or rolled-back chunk file from the committed one."""
    import shutil

    from jaxstream.stream import StoreNotCommittedError
    from jaxstream.stream.direct_read import FileChunks

    if not direct:
        monkeypatch.setattr(FileChunks, "of", classmethod(lambda cls, arr, lead: None))
    writer = _open(store_path)
    for step in (1, 2):  # layer 0: step 1 in slot 1, then step 2 in slot 0
        writer.write(0, _layer(float(step)))
        writer.commit(step)
    writer.close()
    np.testing.assert_array_equal(_open(store_path).read(0).result()["w"], _layer(2.0)["w"])
    committed = _chunk(store_path, "params", 0, 0)
    original = Path(committed).read_bytes()

    def refused(match=r"layer 0 \(slot 0\).*other values than the manifest committed"):
        with pytest.raises(StoreNotCommittedError, match=match):
            _open(store_path).read(0).result()
        with pytest.raises(StoreCorruptError):  # the whole tree too
            _open(store_path).read_params()

    shutil.copyfile(_chunk(store_path, "params", 0, 1), committed)  # rolled back to step 1
    refused()
    shutil.copyfile(_chunk(store_path, "params", 1, 0), committed)  # layer 1's chunk swapped in
    refused()
    other = Path(store_path).parent / "other"
    LayerStore.create(str(other), {**_params(), "blocks": {"w": -_params()["blocks"]["w"]}})
    shutil.copyfile(_chunk(str(other), "params", 0, 0), committed)  # from another store
    refused()
    Path(committed).write_bytes(original)  # the committed bytes back: read as before
    np.testing.assert_array_equal(_open(store_path).read(0).result()["w"], _layer(2.0)["w"])
    # a layer never rewritten is checked against what the store was created with
    np.testing.assert_array_equal(_open(store_path).read(1).result()["w"],
                                  _params()["blocks"]["w"][1])


def test_optimizer_state_chunks_are_bound_too(store_path):
    import shutil

    import jax

    from jaxstream.stream import StoreNotCommittedError

    writer = _open(store_path)
    moved = jax.tree.map(lambda x: x + 1 if x.dtype.kind == "f" else x, writer.read_opt(0).result())
    writer.write(0, _layer(1.0), moved)  # the moments of layer 0 now differ from layer 1's
    writer.commit(1)
    writer.close()
    shutil.copyfile(_chunk(store_path, "opt", 1, 0, leaf=1), _chunk(store_path, "opt", 0, 1, leaf=1))
    _open(store_path).read_opt(1).result()  # layer 1 was not touched: its chunk is intact
    with pytest.raises(StoreNotCommittedError, match="opt leaf"):
        _open(store_path).read_opt(0).result()


def test_rollback_returns_to_the_commit_before_the_last(store_path):
    writer = _open(store_path)
    for step in (1, 2):
        writer.write(0, _layer(float(step)))
        writer.write("head", {"w": np.full((4, 2), float(step), np.float32)})
        writer.commit(step, extra={"note": f"step {step}"})
    assert writer.rollback() == 1
    for store in (writer, _open(store_path)):  # this handle and a fresh one
        assert store.step == 1 and store.extra == {"note": "step 1"}
        np.testing.assert_array_equal(store.read(0).result()["w"], _layer(1.0)["w"])
        np.testing.assert_array_equal(store.read("head").result()["w"], np.full((4, 2), 1.0))
        np.testing.assert_array_equal(store.read(1).result()["w"], _params()["blocks"]["w"][1])
    with pytest.raises(StoreError, match="no earlier commit to roll back to"):
        writer.rollback()  # one step back only
    writer.write(0, _layer(5.0))  # training goes on from the rolled-back step
    writer.commit(2)
    np.testing.assert_array_equal(_open(store_path).read(0).result()["w"], _layer(5.0)["w"])


def test_rollback_over_a_step_that_began_since_is_refused(store_path):
    """A step's writes go to the slots of the commit before last: once one began (here killed
    before its commit), that commit is gone, and rolling back to it is refused by name."""
    writer = _open(store_path)
    for step in (1, 2):
        writer.write(0, _layer(float(step)))
        writer.commit(step)
    writer.write(0, _layer(9.0))
    writer._wait_for_writes("blocks/0")
    writer.abort()  # the step never commits, but its write landed in step 1's slot
    with pytest.raises(StoreError, match=r"cannot roll back to step 1: .*layer 0 \(slot 1\) was "
                                         r"overwritten.*stays at step 2"):
        _open(store_path).rollback()
    np.testing.assert_array_equal(_open(store_path).read(0).result()["w"], _layer(2.0)["w"])


@pytest.mark.parametrize("wait", [True, False])
def test_a_manifest_write_a_killed_writer_left_is_not_reused(store_path, wait):
    """A writer killed inside its manifest write leaves TensorStore's ``manifest.json.__lock``
    (the value written, not yet renamed over the manifest). The next commit, shorter than it,
    must still leave a manifest that is exactly its own: resumable, at the committed step."""
    stale = os.path.join(store_path, "manifest.json.__lock")
    Path(stale).write_bytes(Path(store_path, "manifest.json").read_bytes() + b" " + b"x" * 50_000)
    store = _open(store_path)
    store.write(0, _layer(1.0))
    store.commit(1, wait=wait)
    store.settle()
    again = _open(store_path)
    assert again.step == 1 and not os.path.exists(stale)
    np.testing.assert_array_equal(again.read(0).result()["w"], _layer(1.0)["w"])
    json.loads(Path(store_path, "manifest.json").read_bytes())  # nothing after the manifest


@pytest.mark.parametrize("damage, state", [("garbage", "is damaged"), ("delete", "is missing")])
def test_a_damaged_array_metadata_file_is_named_as_such(store_path, damage, state):
    """An array's zarr.json (its metadata, not a chunk): it was reported as a damaged or
    missing chunk."""
    meta = os.path.join(store_path, "params", "blocks", "0", "zarr.json")
    if damage == "garbage":
        Path(meta).write_text("{not json")
    else:
        os.remove(meta)
    with pytest.raises(StoreCorruptError, match=f"metadata file zarr.json {state}"):
        _open(store_path).read(0).result()
