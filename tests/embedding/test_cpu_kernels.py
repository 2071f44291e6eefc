"""Building the CPU kernels: where they go, and a clear error when they cannot."""

import pytest

from embedding import _cpu_kernels


def test_a_failed_build_names_the_compiler_output(tmp_path, monkeypatch):
    source = tmp_path / "_cpu_kernels.cc"
    source.write_text("this is not C++\n")
    monkeypatch.setattr(_cpu_kernels, "_SOURCE", source)
    monkeypatch.setattr(_cpu_kernels, "_build_folders", lambda: [tmp_path / "out"])
    with pytest.raises(RuntimeError, match="(?s)building the CPU kernels failed:.*error: expected"):
        _cpu_kernels.build()
    assert not list((tmp_path / "out").glob("*.so"))


def test_no_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(_cpu_kernels, "_build_folders", lambda: [tmp_path])
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler .*no-such-compiler"):
        _cpu_kernels.build()


def test_a_rebuild_replaces_only_its_own_older_libraries(tmp_path, monkeypatch):
    monkeypatch.setattr(_cpu_kernels, "_build_folders", lambda: [tmp_path])
    older = tmp_path / "_cpu_kernels-0000000000000000.so"
    older.write_bytes(b"an earlier build")
    unrelated = tmp_path / "other.so"
    unrelated.write_bytes(b"not ours")
    built = _cpu_kernels.build()
    assert built.parent == tmp_path and built.exists()
    assert not older.exists() and unrelated.exists()
