"""A corpus of malformed and hostile inputs fed to the hook exactly as a runtime would.

The tests of it that need no root; those that do are in tests/integration/test_bad_input.py.
"""

from helpers.bad_inputs import CASES  # the corpus, shared with the root tests


def test_the_corpus_is_big_enough():
    assert len(CASES) >= 50
