"""The object store on its own, over real files in a temporary directory: an object is
stored without ever writing through a symlink; counting stored objects by listing a
directory agrees with asking path by path; a dry run's census of stored and unsafe paths;
a batch's digests bound as one array value. (temp_file_cleanup, which hashes and unlinks
the objects, is tested in qo_ops_tests/jobs/test_temp_file_cleanup.py.)

Tests ``qo_ops.platform.calls.object_store``.
"""

from __future__ import annotations

import hashlib

import pytest

from qo_ops.platform.calls import object_store


def test_storing_an_object_never_writes_through_a_symlink(tmp_path):
    """ObjectStore.put (the demo data's writer) creates its directories and replaces an
    object in place, and refuses a path that leaves the store or goes through a symlink."""
    root, outside = tmp_path / "objects", tmp_path / "outside"
    outside.mkdir()
    (outside / "x.bin").write_bytes(b"keep")
    with object_store.ObjectStore(root) as store:
        assert store.put("tmp/t/a.bin", b"first") is True  # root and directories created
        assert store.put("tmp/t/a.bin", b"2nd") is False  # replaced, cut to its new size
        (root / "tmp" / "link").symlink_to(outside, target_is_directory=True)
        (root / "tmp" / "t" / "b.bin").symlink_to(outside / "x.bin")
        for path in ("tmp/link/x.bin", "tmp/t/b.bin", "../outside/x.bin", "tmp//a.bin"):
            with pytest.raises(object_store.ObjectStoreError, match="cannot store an object"):
                store.put(path, b"overwritten")
    assert (root / "tmp" / "t" / "a.bin").read_bytes() == b"2nd"
    assert (outside / "x.bin").read_bytes() == b"keep" and sorted(outside.iterdir()) == [
        outside / "x.bin"
    ]


def test_counting_stored_objects_by_listing_agrees_with_exists_path_by_path(tmp_path, monkeypatch):
    """count_stored (the deleted_objects_gone check) lists a directory with many paths to
    look for instead of a stat per path: it must count exactly what exists() finds, paths
    leaving the store or going through a symlinked directory as nothing stored, a path given
    twice twice — whether it lists or stats (a big directory)."""
    root, outside = tmp_path / "objects", tmp_path / "outside"
    outside.mkdir()
    (outside / "x000.bin").write_bytes(b"not an object")
    names = [f"x{i:03d}.bin" for i in range(80)]
    with object_store.ObjectStore(root) as store:
        for name in names[::3]:
            store.put(f"tmp/many/{name}", b"left")
        store.put("top.bin", b"left")
        store.put("tmp/few/x001.bin", b"left")
    (root / "tmp" / "link").symlink_to(outside, target_is_directory=True)
    (root / "tmp" / "many" / "x001.bin").symlink_to(outside / "x000.bin")  # a link is stored
    paths = [f"tmp/many/{n}" for n in names] + ["tmp/many/x000.bin"]  # one path twice
    paths += [f"tmp/link/{n}" for n in names] + [f"tmp/gone/{n}" for n in names]
    paths += ["top.bin", "tmp/few/x001.bin", "tmp/few/x002.bin", "/top.bin", "../top.bin"]
    paths += [f"tmp//many/{n}" for n in names] + ["tmp/many/", "tmp/many/."] * 20
    with object_store.ObjectStore(root) as store:
        expected = sum(1 for p in paths if store.exists(p))
    assert expected == len(names[::3]) + 1 + 1 + 2  # in tmp/many (+ a link), x000 again, top, few

    listings: list[int] = []
    real_listdir = object_store.os.listdir

    def listdir(fd: int) -> list[str]:
        listings.append(fd)
        return real_listdir(fd)

    monkeypatch.setattr(object_store.os, "listdir", listdir)
    with object_store.ObjectStore(root) as store:
        assert store.count_stored(iter(paths)) == expected
    assert len(listings) == 1  # tmp/many only: the others are unsafe, gone or few
    monkeypatch.setattr(object_store, "_LIST_BYTES_PER_PATH", 0)  # every directory too big to list
    with object_store.ObjectStore(root) as store:
        assert store.count_stored(paths) == expected
    assert len(listings) == 1


def test_a_batchs_digests_go_as_one_array_value_and_nothing_but_hex_goes_in():
    """The intents' checksums are bound as one array literal: a digest (or NULL for an object
    already gone) round-trips through PostgreSQL unchanged, and a value that is not a hex
    digest is refused before it could change the literal's shape."""
    sha = hashlib.sha256(b"x").hexdigest()
    literal = object_store.digest_array([sha, None])
    assert literal == '{"' + sha + '",NULL}'
    for bad in ['a","b', "ABC", "1,2", "{}"]:
        with pytest.raises(ValueError):
            object_store.digest_array([bad])


def test_census_counts_stored_and_unsafe_paths(tmp_path):
    """A dry run's preview of the objects execute would unlink: stored, unsafe, gone."""
    root = tmp_path / "objects"
    with object_store.ObjectStore(root) as store:
        store.put("t/a.bin", b"a")
        assert store.census(["t/a.bin", "t/gone.bin", "../escape.bin", "/abs.bin"]) == (1, 2)
