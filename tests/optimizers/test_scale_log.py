"""keras_amp.optimizers.scale_log: rate-limited lines about scale changes and `on_min_scale`, on their
own (a stand-in optimizer) and through a LossScaleOptimizer in each execution mode."""

import logging as py_logging
import types

import pytest
import tensorflow as tf

from keras_amp.optimizers import LossScaleOptimizer, MinScaleError, scale_log
from tests.helpers import built_optimizer as _setup, step_runner as _runner

INF = float("inf")


class _Clock:
    """Stands in for `time.monotonic` inside scale_log."""

    def __init__(self, monkeypatch):
        self.now = 1000.0
        monkeypatch.setattr(scale_log.time, "monotonic", lambda: self.now)


def _opt(**overrides):
    """The attributes of a LossScaleOptimizer that ScaleLog reads."""
    fields = dict(name="lso", hysteresis=2, dynamic_growth_steps=100, log_lines_per_minute=2,
                  min_scale_patience=3, on_min_scale="warn", min_scale=1.0, dynamic=True)
    return types.SimpleNamespace(**{**fields, **overrides})


def _lines(caplog, level=py_logging.INFO):
    return [r.getMessage() for r in caplog.records if r.name == "absl" and r.levelno == level]


def test_rate_limiter_allows_per_minute_and_counts_the_rest(monkeypatch):
    clock = _Clock(monkeypatch)
    limiter = scale_log.RateLimiter(2)
    assert [limiter.allow() for _ in range(5)] == [True, True, False, False, False]
    assert limiter.suppressed == 3
    clock.now += 59.9  # still inside the rolling minute of both stamps
    assert not limiter.allow() and limiter.suppressed == 4
    clock.now += 0.1  # 60 s after the first two: both have left the window
    assert [limiter.allow() for _ in range(3)] == [True, True, False]


def test_event_logs_the_change_and_why(caplog):
    caplog.set_level(py_logging.INFO, logger="absl")
    log, opt = scale_log.ScaleLog(), _opt()
    log.event(opt, 0, 7, 8.0, 4.0, 2, 0)
    log.event(opt, 1, 107, 4.0, 8.0, 0, 0)
    assert _lines(caplog) == [
        "LossScaleOptimizer 'lso' step 7: loss scale 8 -> 4 (2 consecutive overflow(s), hysteresis=2)",
        "LossScaleOptimizer 'lso' step 107: loss scale 4 -> 8 (100 finite steps)",
    ]
    assert log.known_scale == 8.0


def test_event_without_a_change_logs_nothing_but_records_the_scale(caplog):
    caplog.set_level(py_logging.INFO, logger="absl")
    log = scale_log.ScaleLog()
    log.event(_opt(), 0, 3, 1.0, 1.0, 5, 0)  # an overflow at the floor: the scale cannot move
    assert _lines(caplog) == [] and log.known_scale == 1.0


def test_suppressed_changes_are_counted_in_the_next_line(caplog, monkeypatch):
    caplog.set_level(py_logging.INFO, logger="absl")
    clock = _Clock(monkeypatch)
    log, opt = scale_log.ScaleLog(), _opt(log_lines_per_minute=1)
    for step, (old, new) in enumerate([(8.0, 4.0), (4.0, 2.0), (2.0, 1.0)]):
        log.event(opt, 0, step, old, new, 1, 0)
    assert len(_lines(caplog)) == 1  # one line a minute
    clock.now += 60.0
    log.event(opt, 1, 9, 1.0, 2.0, 0, 0)
    assert _lines(caplog)[-1].endswith("(100 finite steps); 2 earlier change(s) not logged (rate limit)")


def test_check_logs_only_what_the_host_has_not_seen(caplog):
    caplog.set_level(py_logging.INFO, logger="absl")
    log, opt = scale_log.ScaleLog(), _opt()

    def check(scale, step):
        log.check(opt, {"loss_scale": scale, "total_steps": step, "overflows_at_min_scale": 0})

    check(64.0, 0)  # the first reading: nothing to compare with
    check(64.0, 5)
    check(16.0, 9)
    check(32.0, 20)
    assert _lines(caplog) == [
        "LossScaleOptimizer 'lso' step 9: loss scale 64 -> 16 (backed off after overflows (host check))",
        "LossScaleOptimizer 'lso' step 20: loss scale 16 -> 32 (grew after finite steps (host check))",
    ]
    assert log.known_scale == 32.0


@pytest.mark.parametrize("dynamic, where", [(True, "at min_scale=1"), (False, "at the static scale 128")],
                         ids=["dynamic", "static"])
def test_raise_from_patience_on_naming_where_it_overflowed(dynamic, where):
    log, opt = scale_log.ScaleLog(), _opt(on_min_scale="raise", dynamic=dynamic)
    log.event(opt, 0, 10, 128.0, 128.0, 2, 2)  # below patience (3): nothing
    with pytest.raises(MinScaleError, match=f"'lso': 3 consecutive steps overflowed {where} \\(step 11\\)"):
        log.event(opt, 0, 11, 128.0, 128.0, 3, 3)


@pytest.mark.parametrize("policy, warnings_expected", [("warn", 1), ("ignore", 0)])
def test_warn_warns_once_per_optimizer_and_ignore_never(caplog, policy, warnings_expected):
    caplog.set_level(py_logging.WARNING, logger="absl")
    log, opt = scale_log.ScaleLog(), _opt(on_min_scale=policy)
    for at_min in range(1, 8):
        log.check(opt, {"loss_scale": 1.0, "total_steps": at_min, "overflows_at_min_scale": at_min})
    warned = _lines(caplog, py_logging.WARNING)
    assert len(warned) == warnings_expected
    if warned:
        assert "3 consecutive steps overflowed at min_scale=1 (step 3)" in warned[0]


# ------------------------------------------------------------------- through a LossScaleOptimizer
def test_on_min_scale_raise_eager_and_tf_function():
    v, opt = _setup(initial_scale=1.0, min_scale=1.0, on_min_scale="raise")
    step = _runner(opt, v, "eager")
    for _ in range(LossScaleOptimizer.min_scale_patience - 1):
        step(INF)
    with pytest.raises(MinScaleError, match="float32.*NaN"):
        step(INF)
    v, opt = _setup(initial_scale=1.0, min_scale=1.0, on_min_scale="raise")
    step = _runner(opt, v, "tf_function")
    for _ in range(LossScaleOptimizer.min_scale_patience - 1):
        step(INF)
    with pytest.raises(tf.errors.OpError, match="MinScaleError"):
        step(INF)


def test_on_min_scale_warn_logs_once_and_ignore_is_silent(caplog):
    caplog.set_level(py_logging.WARNING, logger="absl")
    for policy, expected in (("warn", 1), ("ignore", 0)):
        caplog.clear()
        v, opt = _setup(initial_scale=4.0, min_scale=1.0, on_min_scale=policy)
        step = _runner(opt, v, "tf_function")
        for _ in range(2 + 3 * LossScaleOptimizer.min_scale_patience):
            step(INF)
        opt.host_check()
        assert int(opt.overflows_at_min_scale.numpy()) == 3 * LossScaleOptimizer.min_scale_patience
        hits = [r for r in caplog.records if "overflowed at min_scale" in r.getMessage()]
        assert len(hits) == expected


def test_xla_logs_scale_changes_from_host_check(caplog):
    caplog.set_level(py_logging.INFO, logger="absl")
    v, opt = _setup(initial_scale=8.0)
    step = _runner(opt, v, "xla")
    step(INF)
    assert not [r for r in caplog.records if "loss scale" in r.getMessage()]  # none in-graph
    state = opt.host_check()
    assert state["loss_scale"] == 4.0 and state["overflow_count"] == 1
    assert any("loss scale 8 -> 4" in r.getMessage() for r in caplog.records)


def test_tf_function_logs_each_change_in_graph(caplog):
    caplog.set_level(py_logging.INFO, logger="absl")
    v, opt = _setup(initial_scale=8.0, dynamic_growth_steps=1)
    step = _runner(opt, v, "tf_function")
    step(1.0)
    step(INF)
    msgs = [r.getMessage() for r in caplog.records if "loss scale" in r.getMessage()]
    assert len(msgs) == 2 and "step 1: loss scale 8 -> 16" in msgs[0]
    assert "step 2: loss scale 16 -> 8" in msgs[1]
    opt.host_check()  # already logged in-graph: no duplicate line
    assert len([r for r in caplog.records if "loss scale" in r.getMessage()]) == 2
