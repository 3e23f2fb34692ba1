"""What gpuhook prints and logs cannot be turned against the operator: no forged lines, no.

The tests of it that need no root; those that do are in tests/integration/test_output_hygiene.py.
"""

from gpuhook.errors import InputError, printable


def test_error_lines_carry_no_control_characters():
    err = InputError("pod \x1b]0;owned\x07name\nFAKE LINE\r\u202eevil")
    line = err.one_line()
    assert "\n" not in line and "\x1b" not in line and "\r" not in line and "\u202e" not in line
    assert line.startswith("pod ?]0;owned?name FAKE LINE")


def test_printable_keeps_ordinary_text():
    assert printable("GPU 0 (GPU-abc) ünïcode 中") == "GPU 0 (GPU-abc) ünïcode 中"
