"""keras_amp.diagnostics.user_site: warnings at the user's own line, errors in one line."""

import concurrent.futures
import os
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp.diagnostics import user_site


def test_find_is_the_innermost_frame_outside_the_libraries():
    site, line = user_site.find(), sys._getframe().f_lineno
    assert (site.filename, site.lineno) == (os.path.abspath(__file__), line)
    assert site.module_globals is globals()


def test_a_thread_with_no_user_frame_has_no_site_and_warns_where_it_is():
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(user_site.find).result() is None  # threading and futures are the stdlib's
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pool.submit(user_site.warn, "from a worker", UserWarning).result()
    (w,) = caught
    assert str(w.message) == "from a worker" and os.path.basename(w.filename) == "thread.py"


def test_warn_issues_at_the_given_site_or_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        user_site.warn("kept site", RuntimeWarning, user_site.Site(__file__, 7, globals()))
        line = sys._getframe().f_lineno + 1
        user_site.warn("here", UserWarning)
    assert [(str(w.message), w.category, w.filename, w.lineno) for w in caught] == [
        ("kept site", RuntimeWarning, __file__, 7), ("here", UserWarning, os.path.abspath(__file__), line)]


def test_a_repeated_warning_at_one_site_is_shown_once_under_the_default_filter():
    module = {"__name__": "user_module"}
    site = user_site.Site("/somewhere/train.py", 12, module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            user_site.warn("once", UserWarning, site)
    assert [(w.filename, w.lineno) for w in caught] == [("/somewhere/train.py", 12)]
    assert module["__warningregistry__"]  # the site's own registry, as for a warning raised there


def test_one_line_keeps_the_error_and_drops_tensorflows_frames():
    @tf.function
    def gather(i):
        return tf.gather(tf.range(10), i)

    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        gather(tf.constant([99]))
    assert 'File "' in str(raised.value) and "Detected at node" in str(raised.value)  # guard: framed
    assert user_site.one_line(raised.value) == "InvalidArgumentError: indices[0] = 99 is not in [0, 10)"
    inp = keras.Input((4,), dtype="int32")
    model = keras.Model(inp, keras.layers.Embedding(10, 2)(inp))
    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        model.predict(np.full((2, 4), 99, "int32"), verbose=0)
    assert user_site.one_line(raised.value) == "InvalidArgumentError: indices[0,0] = 99 is not in [0, 10)"


def test_one_line_of_python_errors():
    assert user_site.one_line(ValueError("first line\nsecond line")) == "ValueError: first line"
    keras_text = ("Exception encountered when calling Dense.call().\n\n"
                  "Could not compute it.\n\nArguments received by Dense.call():\n  • inputs=tf.Tensor(...)")
    assert user_site.one_line(ValueError(keras_text)) == "ValueError: Could not compute it."
    nested = RuntimeError("in user code:\n\n    File \"model.py\", line 3, in call\n        y = f(x)\n\n"
                          "    ValueError: the inner problem\n")
    assert user_site.one_line(nested) == "RuntimeError: the inner problem"
    assert len(user_site.one_line(ValueError("x" * 1000))) == 400
