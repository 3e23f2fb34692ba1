"""gpuhook.kernel.files.read_regular_file and the no-GPU path's copy in gpuhook.prescan give the
same answers: the fast path and everything after it read the same files the same way."""

import errno
import os

import pytest

from gpuhook import prescan
from gpuhook.kernel import files

READERS = [pytest.param(files.read_regular_file, id="kernel.files"),
           pytest.param(prescan.read_regular_file, id="prescan")]


@pytest.mark.parametrize("read", READERS)
def test_a_regular_file_is_read_up_to_its_limit(tmp_path, read):
    path = tmp_path / "config.json"
    path.write_bytes(b"0123456789")
    assert read(str(path), 4) == b"0123"
    data, st = read(str(path), 100, with_stat=True)
    assert (data, st.st_size, st.st_ino) == (b"0123456789", 10, os.stat(path).st_ino)


@pytest.mark.parametrize("read", READERS)
def test_a_fifo_is_refused_without_blocking(tmp_path, read):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    with pytest.raises(OSError) as err:
        read(str(fifo), 100)
    assert err.value.errno == errno.EINVAL


@pytest.mark.parametrize("read", READERS)
def test_a_directory_is_refused(tmp_path, read):
    with pytest.raises(OSError) as err:
        read(str(tmp_path), 100)
    assert err.value.errno == errno.EINVAL


@pytest.mark.parametrize("read", READERS)
def test_a_symlink_is_followed_unless_the_caller_says_nofollow(tmp_path, read):
    (tmp_path / "real").write_bytes(b"data")
    os.symlink("real", tmp_path / "link")
    assert read(str(tmp_path / "link"), 100) == b"data"
    with pytest.raises(OSError) as err:
        read(str(tmp_path / "link"), 100, os.O_NOFOLLOW)
    assert err.value.errno == errno.ELOOP


@pytest.mark.parametrize("read", READERS)
def test_a_missing_file_is_file_not_found(tmp_path, read):
    with pytest.raises(FileNotFoundError):
        read(str(tmp_path / "none"), 100)
