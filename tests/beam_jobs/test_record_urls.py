"""Record files named by fsspec URLs: listing, and the local copies the readers open."""

import pytest

from beam_jobs import _record_urls


def test_urls_list_record_files_in_order_and_local_paths_pass_through(tmp_path):
    for name in ("b.tfrecord", "a.array_record", "notes.txt", ".hidden.tfrecord"):
        (tmp_path / name).write_bytes(name.encode())
    listed = _record_urls.list_files([f"file://{tmp_path}", str(tmp_path / "b.tfrecord")])
    assert listed == [
        f"file://{tmp_path}/a.array_record",
        f"file://{tmp_path}/b.tfrecord",
        str(tmp_path / "b.tfrecord"),
    ]
    with _record_urls.local_copy(listed[1]) as local:
        assert local != listed[1] and open(local, "rb").read() == b"b.tfrecord"
    with _record_urls.local_copy(listed[2]) as local:
        assert local == listed[2]


@pytest.mark.parametrize(
    "entries, message",
    [
        (["file:///nowhere/*.tfrecord"], "No record files .* match 'file:///nowhere/"),
        (["file://{d}/x.tfrecord", "file://{d}/x.tfrecord"], "listed twice"),
    ],
)
def test_bad_url_entries_are_named(tmp_path, entries, message):
    (tmp_path / "x.tfrecord").write_bytes(b"")
    with pytest.raises(ValueError, match=message):
        _record_urls.list_files([entry.format(d=tmp_path) for entry in entries])


def test_a_file_that_cannot_be_fetched_is_named(tmp_path):
    url = f"file://{tmp_path}/gone.tfrecord"
    with pytest.raises(ValueError, match=f"{url}: cannot fetch"):
        with _record_urls.local_copy(url):
            pass
