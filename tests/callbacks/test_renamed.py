"""renamed: an argument's old name works for one release, with a DeprecationWarning naming the new one."""

import warnings

import pytest

from keras_amp.callbacks import renamed


def test_new_name_alone_is_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert renamed.resolve("Cb", "update_freq", 5, 100, log_every=None) == ("update_freq", 5)


def test_old_name_warns_at_the_callers_line_and_is_returned_for_validation():
    def construct():
        return renamed.resolve("Cb", "update_freq", 100, 100, log_every=7)

    with pytest.warns(DeprecationWarning, match=r"Cb: `log_every` is deprecated .*use `update_freq` instead") as caught:
        assert construct() == ("log_every", 7)
    assert caught[0].filename == __file__  # the line that called the constructor


def test_ambiguous_combinations_are_refused():
    with pytest.raises(ValueError, match=r"pass only `update_freq` \(`log_every`, `check_every` are its old "
                                         r"names\)\. Received: log_every=3, check_every=4"):
        renamed.resolve("Cb", "update_freq", 100, 100, log_every=3, check_every=4)
    with pytest.raises(ValueError, match=r"Received: update_freq=5, log_every=3"):
        renamed.resolve("Cb", "update_freq", 5, 100, log_every=3)


def test_alias_reads_the_new_attribute_with_a_warning():
    class Cb:
        update_freq = 9
        log_every = renamed.alias("log_every", "update_freq", "Cb")

    with pytest.warns(DeprecationWarning, match="`log_every` is deprecated") as caught:
        assert Cb().log_every == 9
    assert caught[0].filename == __file__
