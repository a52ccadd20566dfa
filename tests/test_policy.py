"""keras_amp.enable() / config() / disable() and AmpConfig."""

import json
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import hardware, model_graph, policy
from keras_amp.hardware import DeviceInfo
from tests.helpers import ZEN4, gpus

SAPPHIRE = DeviceInfo(cpu_model="Xeon", cpu_flags=frozenset({"amx_bf16", "amx_tile"}), onednn_enabled=True)
BF16_NO_ONEDNN = DeviceInfo(cpu_model="AMD EPYC", cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=False)
PLAIN_CPU = DeviceInfo(cpu_model="old", cpu_flags=frozenset({"avx2", "fma"}), onednn_enabled=True)
TPU = DeviceInfo(tpu_count=8)


# (device, expected policy, expect a float32 warning)
AUTO_CASES = {
    "h100_cc90": (gpus((9, 0)), "mixed_bfloat16", False),
    "a100_cc80": (gpus((8, 0)), "mixed_bfloat16", False),
    "t4_cc75": (gpus((7, 5)), "mixed_float16", False),
    "v100_cc70": (gpus((7, 0)), "mixed_float16", False),
    "mixed_a100_v100_weakest_decides": (gpus((8, 0), (7, 0)), "mixed_float16", False),
    "p100_cc60": (gpus((6, 0)), "float32", True),
    "gpu_unknown_cc": (gpus(None), "float32", True),
    "tpu": (TPU, "mixed_bfloat16", False),
    "cpu_avx512_bf16": (ZEN4, "mixed_bfloat16", False),
    "cpu_amx": (SAPPHIRE, "mixed_bfloat16", False),
    "cpu_bf16_onednn_off": (BF16_NO_ONEDNN, "float32", True),
    "cpu_plain": (PLAIN_CPU, "float32", True),
}


@pytest.mark.parametrize("case", sorted(AUTO_CASES))
def test_auto_branches(case):
    device, expected, warns = AUTO_CASES[case]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = keras_amp.enable("auto", device=device)
    amp_warnings = [w for w in caught if issubclass(w.category, keras_amp.AmpWarning)]
    assert config.policy == expected
    assert keras.config.dtype_policy().name == expected
    assert config.requested == "auto"
    assert config.variable_dtype == "float32"
    assert config.compute_dtype == {"mixed_bfloat16": "bfloat16", "mixed_float16": "float16", "float32": "float32"}[expected]
    assert config.loss_scaling is (expected == "mixed_float16")
    assert config.device == device.summary()
    assert config.reason
    assert len(amp_warnings) == (1 if warns else 0)
    if warns:
        assert "float32" in str(amp_warnings[0].message) and config.reason in str(amp_warnings[0].message)


def test_auto_on_this_machine_matches_its_hardware():
    device = hardware.detect()
    if device.gpus or device.tpu_count:
        pytest.skip("expectation below is for CPU-only machines (CI and development machines)")
    # Derived from the raw flags, not from choose_policy: a CPU with AVX512-BF16/AMX and oneDNN on
    # runs bfloat16 natively, so auto must pick mixed_bfloat16 there.
    _, flags = hardware.read_cpuinfo()
    bf16 = ("avx512_bf16" in flags or "amx_bf16" in flags) and hardware.onednn_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_amp.AmpWarning)
        config = keras_amp.enable()
    assert config.policy == ("mixed_bfloat16" if bf16 else "float32")


@pytest.mark.parametrize(
    "device,requested,faster",
    [
        pytest.param(ZEN4, "mixed_float16", "mixed_bfloat16", id="fp16_on_bf16_cpu"),
        pytest.param(PLAIN_CPU, "mixed_float16", "float32", id="fp16_on_plain_cpu"),
        pytest.param(gpus((7, 5)), "mixed_bfloat16", "mixed_float16", id="bf16_on_t4"),
    ],
)
def test_explicit_slow_policy_warns_naming_the_faster_choice(device, requested, faster):
    with pytest.warns(keras_amp.AmpWarning, match=f"Faster here: '{faster}'"):
        config = keras_amp.enable(requested, device=device)
    assert config.policy == requested
    assert config.reason == "requested explicitly"
    assert keras.config.dtype_policy().name == requested


def test_bfloat16_on_a_cpu_that_emulates_it_warns_of_float32_s_speed_not_a_faster_choice():
    # keras_amp's float32 kernels bring an emulated bfloat16 step near float32's, faster or slower
    # by model (2-core Zen 4 with oneDNN off: Transformer LM 0.8x, CNN 1.0x, LSTM 1.2x).
    with pytest.warns(keras_amp.AmpWarning, match="no fast bfloat16 path") as record:
        config = keras_amp.enable("mixed_bfloat16", device=PLAIN_CPU)
    message = str(record[0].message)
    assert "near float32's" in message and "'auto' picks 'float32'" in message and "Faster here" not in message
    assert config.policy == "mixed_bfloat16"


@pytest.mark.parametrize(
    "device,requested",
    [
        pytest.param(gpus((7, 0)), "mixed_float16", id="fp16_on_v100"),
        pytest.param(gpus((8, 0)), "mixed_float16", id="fp16_on_a100"),
        pytest.param(ZEN4, "mixed_bfloat16", id="bf16_on_zen4"),
        pytest.param(PLAIN_CPU, "float32", id="fp32_anywhere"),
    ],
)
def test_explicit_fast_policy_does_not_warn(device, requested):
    with warnings.catch_warnings():
        warnings.simplefilter("error", keras_amp.AmpWarning)
        assert keras_amp.enable(requested, device=device).policy == requested


def test_dtype_policy_object_accepted():
    config = keras_amp.enable(keras.DTypePolicy("mixed_bfloat16"), device=ZEN4)
    assert config.policy == "mixed_bfloat16" and config.requested == "mixed_bfloat16"


@pytest.mark.parametrize(
    "bad,error,match",
    [
        pytest.param("fp16", ValueError, r"Received: policy='fp16'. Allowed: auto, mixed_float16", id="unknown_string"),
        pytest.param("float16", ValueError, r"Received: policy='float16'", id="pure_float16_string"),
        pytest.param("Mixed_Float16", ValueError, r"Allowed:", id="wrong_case"),
        pytest.param(16, TypeError, r"Received: policy=16 of type int", id="int"),
        pytest.param(None, TypeError, r"Received: policy=None", id="none"),
        pytest.param(keras.DTypePolicy("float16"), ValueError, r"float policies", id="policy_float16"),
        pytest.param(keras.DTypePolicy("bfloat16"), ValueError, r"float policies", id="policy_bfloat16"),
    ],
)
def test_bad_policy(bad, error, match):
    before = keras.config.dtype_policy().name
    with pytest.raises(error, match=match):
        keras_amp.enable(bad, device=ZEN4)
    assert not keras_amp.config().enabled
    assert keras.config.dtype_policy().name == before


@pytest.mark.parametrize("bad", [1, 0, "yes", "true"], ids=repr)
def test_bad_tf32(bad):
    with pytest.raises(TypeError, match=r"`tf32` must be True or False. Received: tf32="):
        keras_amp.enable("float32", tf32=bad, device=ZEN4)
    assert not keras_amp.config().enabled


def test_bad_device():
    with pytest.raises(TypeError, match=r"`device` must be a keras_amp.hardware.DeviceInfo"):
        keras_amp.enable("float32", device="cpu")


def test_disable_restores_state_from_before_the_first_enable():
    keras.config.set_dtype_policy("float64")
    tf.config.experimental.enable_tensor_float_32_execution(False)
    keras_amp.enable("mixed_bfloat16", tf32=True, device=ZEN4)
    assert tf.config.experimental.tensor_float_32_execution_enabled()
    second = keras_amp.enable("float32", tf32=False, device=ZEN4)  # replaces the config
    assert keras_amp.config() is second and not second.tf32
    third = keras_amp.enable("mixed_float16", device=gpus((7, 0)))
    assert keras_amp.config() is third and third.policy == "mixed_float16"
    assert keras.config.dtype_policy().name == "mixed_float16"
    keras_amp.disable()
    assert keras.config.dtype_policy().name == "float64"
    assert tf.config.experimental.tensor_float_32_execution_enabled() is False


@pytest.mark.parametrize("initial", [True, False], ids=["tf32_on", "tf32_off"])
def test_tf32_none_leaves_tensorflow_alone(initial):
    tf.config.experimental.enable_tensor_float_32_execution(initial)
    config = keras_amp.enable("mixed_bfloat16", device=ZEN4)
    assert config.tf32 is initial
    # The user changes TF32 themselves; disable() must not undo what enable() did not do.
    tf.config.experimental.enable_tensor_float_32_execution(not initial)
    keras_amp.disable()
    assert tf.config.experimental.tensor_float_32_execution_enabled() is (not initial)


@pytest.mark.parametrize("value", [True, False], ids=["tf32_on", "tf32_off"])
def test_tf32_set_and_recorded(value):
    tf.config.experimental.enable_tensor_float_32_execution(not value)
    config = keras_amp.enable("mixed_bfloat16", tf32=value, device=ZEN4)
    assert config.tf32 is value
    assert tf.config.experimental.tensor_float_32_execution_enabled() is value
    keras_amp.disable()
    assert tf.config.experimental.tensor_float_32_execution_enabled() is (not value)


def test_amp_config_is_frozen():
    config = keras_amp.enable("mixed_bfloat16", device=ZEN4)
    with pytest.raises(AttributeError):
        config.policy = "float32"


def test_fingerprint_is_stable_and_covers_the_settings_that_must_match():
    a = keras_amp.enable("mixed_bfloat16", tf32=False, device=ZEN4)
    assert a.fingerprint() == a.fingerprint()
    assert len(a.fingerprint()) == 64 and set(a.fingerprint()) <= set("0123456789abcdef")
    # The device summary is not part of it: workers may differ in hardware, not in settings.
    b = keras_amp.enable("mixed_bfloat16", tf32=False, device=SAPPHIRE)
    assert b.device != a.device and b.fingerprint() == a.fingerprint()
    assert keras_amp.enable("mixed_float16", tf32=False, device=gpus((7, 0))).fingerprint() != a.fingerprint()
    assert keras_amp.enable("mixed_bfloat16", tf32=True, device=ZEN4).fingerprint() != a.fingerprint()
    no_xla = keras_amp.enable("mixed_bfloat16", tf32=False, device=ZEN4, xla_scores=False)
    assert a.xla_scores is True and no_xla.xla_scores is False and keras_amp.config() is no_xla
    assert no_xla.fingerprint() != a.fingerprint()
    fields = a.fingerprint_fields()
    assert fields["tensorflow"] == ".".join(tf.__version__.split(".")[:2])
    assert fields["keras"] == ".".join(keras.__version__.split(".")[:2])
    assert set(fields) == {"policy", "compute_dtype", "variable_dtype", "loss_scaling", "tf32", "xla_scores",
                           "frozen_weights", "tensorflow", "keras"}
    frozen32 = keras_amp.enable("mixed_bfloat16", tf32=True, device=ZEN4, frozen_weights="float32")
    assert frozen32.fingerprint() != a.fingerprint()


def test_fingerprint_is_the_same_in_another_process():
    config = keras_amp.enable("mixed_bfloat16", tf32=False, device=ZEN4)
    code = (
        "import keras_amp; from keras_amp.hardware import DeviceInfo;"
        "print(keras_amp.enable('mixed_bfloat16', tf32=False, device=DeviceInfo()).fingerprint())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == config.fingerprint()


def test_fingerprint_includes_optimizer_and_layer_policies():
    config = keras_amp.enable("mixed_float16", device=gpus((7, 0)))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2, dtype="float32")])
    plain = keras.optimizers.SGD()
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=2.0**10)
    scaled_other = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=2.0**12)
    fields = config.fingerprint_fields(layers=model_graph.walk(model), optimizer=scaled)
    # The recipes' layer list (model_graph.walk): paths below the model, in model order.
    assert json.loads(fields["layer_policies"]) == [[path, layer.dtype_policy.name]
                                                    for path, layer in model_graph.walk(model)]
    assert json.loads(fields["layer_policies"])[-1][1] == "float32"
    assert json.loads(fields["loss_scale"])["initial_scale"] == 2.0**10
    assert config.fingerprint_fields(optimizer=plain)["loss_scale"] == "none"
    assert config.fingerprint(optimizer=scaled) != config.fingerprint(optimizer=scaled_other)
    other_model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    assert (config.fingerprint(layers=model_graph.walk(model))
            != config.fingerprint(layers=model_graph.walk(other_model)))
    with pytest.raises(TypeError, match=r"`layers` must be an iterable of \(path, layer\) pairs"):
        config.fingerprint_fields(layers=model)  # the model itself, not its walk


def _build_and_call(layer, x):
    y = layer(x)
    return layer, y


LAYERS = {
    "dense": (lambda: keras.layers.Dense(8), np.ones((2, 4), "float32")),
    "conv2d": (lambda: keras.layers.Conv2D(8, 3), np.ones((2, 6, 6, 3), "float32")),
    "embedding": (lambda: keras.layers.Embedding(10, 8), np.array([[1, 2, 3]], "int32")),
}


@pytest.mark.parametrize("policy_name", ["float32", "mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("layer_name", sorted(LAYERS))
def test_layers_built_after_enable_compute_in_the_chosen_dtype(policy_name, layer_name):
    device = gpus((8, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_amp.AmpWarning)
        config = keras_amp.enable(policy_name, device=device)
    make, x = LAYERS[layer_name]
    layer, y = _build_and_call(make(), x)
    assert layer.compute_dtype == config.compute_dtype
    assert keras.backend.standardize_dtype(y.dtype) == config.compute_dtype
    assert layer.variable_dtype == "float32"
    assert layer.weights and all(keras.backend.standardize_dtype(w.dtype) == "float32" for w in layer.weights)


# --- followers and atomic enable() (issue 14; explicit state, issue 25) ---


class _Log(list):
    def record(self, config):
        self.append(None if config is None else config.policy)


def test_followers_see_every_enable_and_disable():
    log = _Log()
    policy.enable("mixed_bfloat16", device=ZEN4, followers=(log.record,))
    policy.enable("float32", device=ZEN4, followers=(log.record,))
    policy.disable((log.record,))
    policy.disable((log.record,))  # no-op: nothing enabled, followers not called
    assert log == ["mixed_bfloat16", "float32", None]


def test_followers_must_be_callables():
    with pytest.raises(TypeError, match=r"`followers\[0\]` must be callable. Received: followers\[0\]=3"):
        policy.enable("float32", device=ZEN4, followers=(3,))
    with pytest.raises(TypeError, match=r"`followers` must be a tuple of callables"):
        policy.disable(followers=print)


class _FollowerFailure(RuntimeError):
    pass


@pytest.mark.parametrize("tf32_before", [True, False], ids=["tf32_on", "tf32_off"])
def test_enable_is_all_or_nothing_when_a_follower_raises(tf32_before):
    tf.config.experimental.enable_tensor_float_32_execution(tf32_before)
    keras.config.set_dtype_policy("float64")
    log = _Log()
    first = policy.enable("mixed_bfloat16", device=ZEN4, followers=(log.record,))
    calls = []

    def failing(config):
        calls.append(None if config is None else config.policy)
        if config is not None and config.policy == "mixed_float16":
            raise _FollowerFailure("cannot install")

    with pytest.raises(_FollowerFailure, match="cannot install"):
        policy.enable("mixed_float16", tf32=not tf32_before, device=gpus((7, 0)), followers=(log.record, failing))
    # Nothing changed: policy, TF32, config, and every follower is back on the old config.
    assert keras_amp.config() is first
    assert keras.config.dtype_policy().name == "mixed_bfloat16"
    assert tf.config.experimental.tensor_float_32_execution_enabled() is tf32_before
    assert log == ["mixed_bfloat16", "mixed_float16", "mixed_bfloat16"]
    assert calls == ["mixed_float16", "mixed_bfloat16"]
    # The tf32 attempt left no trace in what disable() restores.
    keras_amp.disable()
    assert keras.config.dtype_policy().name == "float64"
    assert tf.config.experimental.tensor_float_32_execution_enabled() is tf32_before


def test_first_enable_rolls_back_to_not_enabled():
    keras.config.set_dtype_policy("float64")
    log = _Log()

    def failing(config):
        raise _FollowerFailure("no")

    with pytest.raises(_FollowerFailure):
        policy.enable("mixed_bfloat16", tf32=True, device=ZEN4, followers=(log.record, failing))
    assert not keras_amp.config().enabled
    assert keras.config.dtype_policy().name == "float64"
    assert log == ["mixed_bfloat16", None]


def test_failing_rollback_is_noted_on_the_original_error():
    def always_fails(config):
        raise _FollowerFailure(f"config={config}")

    with pytest.raises(_FollowerFailure) as info:
        policy.enable("float32", device=ZEN4, followers=(always_fails,))
    assert "rolling back follower" in "".join(info.value.__notes__)
    assert not keras_amp.config().enabled


def test_disable_is_all_or_nothing_when_a_follower_raises():
    config = keras_amp.enable("mixed_bfloat16", device=ZEN4)

    def refuses_none(new):
        if new is None:
            raise _FollowerFailure("cannot uninstall")

    with pytest.raises(_FollowerFailure):
        policy.disable((refuses_none,))
    assert keras_amp.config() is config
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


# --- threads (issue 22): Keras's policy is per thread, keras_amp's state per process ---


def test_enable_and_disable_from_another_thread_are_refused():
    import threading

    keras_amp.enable("mixed_bfloat16", device=ZEN4)
    errors = {}

    def worker(name, call):
        try:
            call()
        except RuntimeError as e:
            errors[name] = str(e)

    threads = [threading.Thread(target=worker, args=("enable", lambda: keras_amp.enable("float32", device=ZEN4)),
                                name="builder-1"),
               threading.Thread(target=worker, args=("disable", keras_amp.disable), name="builder-2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "keras_amp.enable() must be called from the main thread" in errors["enable"]
    assert "'builder-1'" in errors["enable"]
    assert "keras_amp.disable() must be called from the main thread" in errors["disable"]
    # Nothing changed: the config, Keras's policy in this thread and the rules agree.
    from keras_amp import op_rules

    assert keras_amp.config().policy == "mixed_bfloat16"
    assert keras.config.dtype_policy().name == "mixed_bfloat16" and op_rules.installed() == "bfloat16"


def test_a_model_built_in_the_main_thread_follows_the_config():
    # Stock Keras, for contrast: a thread that builds gets its own (float32) policy, whatever
    # the main thread set; keras_amp documents "build in the main thread" and refuses the
    # call that would make its config and Keras's policy disagree.
    import threading

    config = keras_amp.enable("mixed_bfloat16", device=ZEN4)
    seen = {}

    def build():
        seen["thread"] = keras.layers.Dense(2).dtype_policy.name

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert keras.layers.Dense(2).dtype_policy.name == config.policy
    assert seen["thread"] == "float32"


def test_failure_describing_the_device_changes_nothing(monkeypatch):
    def broken_detect():
        raise OSError("no /proc")

    monkeypatch.setattr(hardware, "detect", broken_detect)
    before = keras.config.dtype_policy().name
    with pytest.raises(OSError, match="no /proc"):
        keras_amp.enable("mixed_bfloat16", tf32=True)
    assert not keras_amp.config().enabled
    assert keras.config.dtype_policy().name == before


def test_failure_in_device_summary_changes_nothing():
    # Before the fix, summary() ran after the global policy was written.
    class BrokenSummary(DeviceInfo):
        def summary(self):
            raise RuntimeError("summary failed")

    before = keras.config.dtype_policy().name
    with pytest.raises(RuntimeError, match="summary failed"):
        keras_amp.enable("mixed_bfloat16", device=BrokenSummary(cpu_flags=frozenset({"avx512_bf16"}), onednn_enabled=True))
    assert not keras_amp.config().enabled
    assert keras.config.dtype_policy().name == before


def _config_fields(**overrides):
    fields = dict(policy="mixed_float16", compute_dtype="float16", variable_dtype="float32", loss_scaling=True,
                  tf32=False, device="", requested="mixed_float16", reason="test")
    return {**fields, **overrides}


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        pytest.param(dict(policy="bogus"), ValueError, r"Received: policy='bogus'", id="unknown_policy"),
        pytest.param(dict(policy=16), TypeError, r"`policy` must be a string", id="policy_int"),
        pytest.param(dict(compute_dtype="bfloat16"), ValueError, r"`compute_dtype` must match", id="compute_mismatch"),
        pytest.param(dict(loss_scaling=False), ValueError, r"`loss_scaling` must match", id="scaling_mismatch"),
        pytest.param(dict(tf32="no"), TypeError, r"tf32='no'", id="tf32_string"),
        pytest.param(dict(reason=None), TypeError, r"`reason` must be a string", id="reason_none"),
    ],
)
def test_amp_config_validates_fields(overrides, error, match):
    with pytest.raises(error, match=match):
        policy.AmpConfig(**_config_fields(**overrides))


def test_amp_config_describes_any_keras_float_policy():
    # distribute describes a global Keras policy keras_amp did not set, e.g. float64.
    config = policy.AmpConfig(**_config_fields(policy="float64", compute_dtype="float64", variable_dtype="float64",
                                               loss_scaling=False, tf32=np.bool_(True)))
    assert config.tf32 is True


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param(dict(layers="x"), r"`layers` must be an iterable of \(path, layer\) pairs.*Received: layers='x'",
                     id="layers_string"),
        pytest.param(dict(layers=[("a", 1)]), r"`layers` must .*Received an element: \('a', 1\)", id="layers_element"),
        pytest.param(dict(optimizer="x"), r"`optimizer` must be a keras.optimizers.Optimizer", id="optimizer_string"),
    ],
)
def test_fingerprint_fields_rejects_what_is_not_a_layer_list_or_optimizer(kwargs, match):
    config = policy.AmpConfig(**_config_fields())
    with pytest.raises(TypeError, match=match):
        config.fingerprint_fields(**kwargs)
