"""Progress: the search's pass count against a target that never falls below the passes run."""

import types

from keras_amp.auto_precision.progress import Progress


def test_one_line_per_pass_and_the_target_follows_what_the_search_learns(capsys):
    progress = Progress(2, candidates=2, left_out=1, batches=3)
    errors = types.SimpleNamespace(loss=0.5, gradient=0.25, output=0.125)
    progress.step("every layer float32 (the reference)", None)
    for what in ("as is", "a alone", "b alone"):
        progress.step(what, errors)
    progress.expect(2)       # a prefix search of at most 2 passes
    progress.step("prefix", errors)
    progress.expect_total(3)  # below the 5 passes run: the target stays at the count
    progress.done()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("search_precision: 2 candidate layer(s) (1 without weights") and "3 batch(es)" in lines[0]
    assert lines[1] == "search_precision: pass 1/4, every layer float32 (the reference)"
    assert lines[2] == "search_precision: pass 2/4, as is: loss error 0.5, gradient error 0.25, output error 0.125"
    assert lines[5].startswith("search_precision: pass 5/6, prefix")
    assert len(lines) == 6 and progress.target == progress.passes == 5


def test_silent_at_verbose_0(capsys):
    progress = Progress(0, candidates=3, left_out=0, batches=1)
    progress.step("as is", None)
    progress.done()
    assert capsys.readouterr().out == ""
