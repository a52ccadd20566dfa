"""keras_amp.state: `enable()` / `config()` / `disable()` and what follows the config (op rules,
memory hooks, the multi-worker fit fix). The policy choice itself is tests/test_policy.py's."""

import keras
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import policy, state
from keras_amp.distribute import trainer_fix
from keras_amp.memory import hooks as memory_hooks
from tests.helpers import ZEN4, gpus


def test_config_off_until_enabled_and_after_disable():
    keras.config.set_dtype_policy("mixed_float16")  # set in Keras directly, not through keras_amp
    off = keras_amp.config()
    assert not off.enabled and off.requested == "off" and "not enabled" in off.reason
    assert (off.policy, off.compute_dtype, off.variable_dtype, off.loss_scaling) == (
        "mixed_float16", "float16", "float32", True)
    keras.config.set_dtype_policy("float32")
    assert keras_amp.config().policy == "float32" and not keras_amp.config().loss_scaling
    config = keras_amp.enable("mixed_bfloat16", device=ZEN4)
    assert keras_amp.config() is config and config.enabled
    keras_amp.disable()
    assert not keras_amp.config().enabled
    keras_amp.disable()  # a second disable is a no-op
    assert not keras_amp.config().enabled


def test_keras_amp_enable_installs_the_op_rules_in_a_plain_call():
    from keras_amp import op_rules, state
    from keras_amp.op_rules import installer

    assert installer.sync in state.FOLLOWERS
    keras_amp.enable("mixed_bfloat16", device=ZEN4)
    assert op_rules.installed() == "bfloat16"
    keras_amp.enable("float32", device=ZEN4)
    assert op_rules.installed() is None
    keras_amp.enable("mixed_float16", device=gpus((7, 0)))
    assert op_rules.installed() == "float16"
    keras_amp.disable()
    assert op_rules.installed() is None
    # policy.enable alone sets the policy and nothing else: no follower is registered anywhere.
    policy.enable("mixed_bfloat16", device=ZEN4)
    assert op_rules.installed() is None
    policy.disable()


def test_the_package_face_is_this_module():
    assert (keras_amp.enable, keras_amp.config, keras_amp.disable) == (state.enable, state.config, state.disable)


@pytest.mark.parametrize("tf32", [True, False], ids=["tf32_on", "tf32_off"])
def test_off_config_reads_the_global_policy_and_tf32_as_they_are_now(tf32):
    tf.config.experimental.enable_tensor_float_32_execution(tf32)
    keras.config.set_dtype_policy("mixed_bfloat16")
    off = state.off_config()
    assert (off.policy, off.compute_dtype, off.variable_dtype) == ("mixed_bfloat16", "bfloat16", "float32")
    assert off.loss_scaling is False and off.tf32 is tf32 and off.enabled is False  # bfloat16: no scaling
    keras.config.set_dtype_policy("float64")
    assert (state.off_config().compute_dtype, state.off_config().variable_dtype) == ("float64", "float64")


def test_memory_hooks_follow_enable_and_disable():
    assert not memory_hooks.installed()
    keras_amp.enable("mixed_bfloat16", device=ZEN4)
    assert memory_hooks.installed()
    keras_amp.enable("float32", device=ZEN4)  # any config keeps them: float32 frozen weights are a no-op
    assert memory_hooks.installed()
    keras_amp.disable()
    assert not memory_hooks.installed()


def test_disable_removes_the_fit_fix_a_new_config_keeps_it():
    keras_amp.enable("mixed_bfloat16", device=ZEN4)
    try:
        assert trainer_fix.install_fit_fix()  # what multi_worker() does
        keras_amp.enable("float32", device=ZEN4)
        assert trainer_fix.fit_fix_installed()
        keras_amp.disable()
        assert not trainer_fix.fit_fix_installed()
    finally:
        trainer_fix.uninstall_fit_fix()


def test_enable_warns_at_the_callers_line():
    # policy.enable's warnings are caught and said again with stacklevel=2: the user's line.
    with pytest.warns(keras_amp.AmpWarning, match="Faster here: 'mixed_bfloat16'") as record:
        keras_amp.enable("mixed_float16", device=ZEN4)
    amp = [w for w in record if issubclass(w.category, keras_amp.AmpWarning)]
    assert [w.filename for w in amp] == [__file__]


def test_enable_docstring_is_policy_enables_without_followers():
    assert "followers:" in policy.enable.__doc__  # the part state.enable removes is still there
    assert "followers" not in state.enable.__doc__
    assert "Args:" in state.enable.__doc__ and "op rules under a 16-bit compute dtype" in state.enable.__doc__
