"""The /proc/driver/nvidia mask, in a private mount namespace over a fake container /proc.

The tests of it that need no root; those that do are in tests/integration/test_proc_mask.py.
"""



def test_params_rewrite_adds_the_line_when_missing():
    from gpuhook.apply.run import _no_device_files

    assert _no_device_files(b"A: 1\nModifyDeviceFiles: 1\n") == b"A: 1\nModifyDeviceFiles: 0\n"
    assert _no_device_files(b"A: 1\n") == b"A: 1\nModifyDeviceFiles: 0\n"
