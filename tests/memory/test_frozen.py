"""keras_amp.memory.prepare (memory/frozen.py): frozen weights stored in the dtype their layer reads them in."""

import warnings

import numpy as np
import pytest
import tensorflow as tf

import keras
import keras_amp
from keras_amp import memory
from keras_amp.memory import storage
from keras_amp.policy import AmpWarning

X = np.random.RandomState(0).randn(64, 16).astype("float32")
Y = np.random.RandomState(1).randn(64, 4).astype("float32")


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.BatchNormalization(), keras.layers.LayerNormalization(),
                             keras.layers.Dense(32), keras.layers.Dense(4)])


def _lora_fit(mode, freeze_after_compile=False, epochs=3):
    keras_amp.enable("mixed_bfloat16", frozen_weights=mode)
    model = _model()
    if not freeze_after_compile:
        model.layers[0].enable_lora(2)
        model.layers[3].trainable = False
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    if freeze_after_compile:
        model.layers[0].enable_lora(2)
        model.layers[3].trainable = False
    history = model.fit(X, Y, batch_size=16, epochs=epochs, verbose=0, shuffle=False)
    return model, history.history["loss"]


@pytest.mark.parametrize("freeze_after_compile", [False, True])
def test_frozen_weights_in_16bit_give_bit_identical_training(freeze_after_compile):
    ref_model, ref = _lora_fit("float32", freeze_after_compile)
    ref_weights = [v.numpy() for v in ref_model.weights]
    keras_amp.disable()
    model, got = _lora_fit("compute", freeze_after_compile)
    assert got == ref
    dense, bn, ln = model.layers[0], model.layers[1], model.layers[2]
    assert memory.storage_dtype(dense._kernel) == "bfloat16"  # frozen by enable_lora
    assert {memory.storage_dtype(v) for v in (dense.lora_kernel_a, dense.lora_kernel_b, dense.bias)} == {"float32"}
    # Statistics a layer updates itself, and float32 islands, stay float32.
    assert memory.storage_dtype(bn.moving_mean) == "float32"
    assert memory.storage_dtype(ln.gamma) == "float32"
    assert {memory.storage_dtype(v) for v in model.layers[3].weights} == {"bfloat16"}  # frozen Dense
    # Trained weights and statistics end equal; frozen ones are the 16-bit rounding of the float32 ones.
    for a, b in zip(model.weights, ref_weights):
        want = b.astype(a.numpy().dtype) if memory.storage_dtype(a) == "bfloat16" else b
        np.testing.assert_array_equal(a.numpy(), want, err_msg=a.path)


def test_frozen_bytes_halve_and_float32_mode_or_disabled_keeps_float32():
    model, _ = _lora_fit("compute", epochs=1)
    kernel = model.layers[0]._kernel
    assert memory.storage_dtype(kernel) == "bfloat16"
    assert memory.variable_bytes([kernel]) == 16 * 32 * 2
    keras_amp.disable()
    model, _ = _lora_fit("float32", epochs=1)
    assert memory.storage_dtype(model.layers[0]._kernel) == "float32"
    keras_amp.disable()
    plain = _model()
    plain.layers[0].trainable = False
    assert not memory.prepare(plain).changed  # keras_amp off: nothing to store in 16 bits


def test_save_writes_the_16bit_values_and_a_float32_model_loads_them(tmp_path):
    model, _ = _lora_fit("compute", epochs=1)
    path = str(tmp_path / "m.weights.h5")
    model.save_weights(path)
    keras_amp.disable()
    plain = _model()
    plain.layers[0].enable_lora(2)
    plain.load_weights(path)
    kernel = plain.layers[3].kernel  # frozen: saved as its 16-bit value
    assert kernel.dtype == "float32"
    np.testing.assert_array_equal(kernel.numpy(), np.asarray(model.layers[3].kernel.numpy(), np.float32))


def test_restore_frozen_float32_from_the_pretrained_file_keeps_trained_adapters(tmp_path):
    keras_amp.enable("mixed_bfloat16")
    model = _model()
    model(X[:1])
    pretrained = str(tmp_path / "pretrained.weights.h5")
    model.save_weights(pretrained)
    original = model.layers[0].kernel.numpy().copy()
    model.layers[0].enable_lora(2)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    adapters = model.layers[0].lora_kernel_b.numpy().copy()
    assert np.abs(adapters).max() > 0
    restored = memory.restore_frozen_float32(model, pretrained)
    assert restored == [model.layers[0]._kernel.path]
    assert memory.storage_dtype(model.layers[0]._kernel) == "float32"
    np.testing.assert_array_equal(model.layers[0]._kernel.numpy(), original)
    np.testing.assert_array_equal(model.layers[0].lora_kernel_b.numpy(), adapters)


def test_restore_frozen_float32_from_a_file_that_does_not_fit_changes_nothing(tmp_path):
    # Keras loads what matches before it raises: the trained head had taken the file's values, and the
    # frozen weights, unmarked, were not found again by a retry with the right file.
    keras_amp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)

    def build(inputs):
        return keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(16, name="base"),
                                 keras.layers.Dense(1, dtype="float32", name="head")])

    wrong, right = str(tmp_path / "wrong.weights.h5"), str(tmp_path / "right.weights.h5")
    build(4).save_weights(wrong)  # the base's kernel has another shape; the head's fits
    model = build(16)
    model.save_weights(right)
    pretrained = model.get_layer("base").kernel.numpy().copy()
    model.get_layer("base").trainable = False
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    model.fit(X, Y[:, :1], batch_size=16, epochs=1, verbose=0)
    head, base = model.get_layer("head").kernel.numpy().copy(), model.get_layer("base").kernel
    stored, frozen = base.numpy().copy(), [v.path for v in model.get_layer("base").weights]
    assert memory.storage_dtype(base) == "bfloat16"  # guard
    with pytest.raises(ValueError):
        memory.restore_frozen_float32(model, wrong)
    np.testing.assert_array_equal(model.get_layer("head").kernel.numpy(), head)
    assert memory.storage_dtype(base) == "bfloat16" and [v.path for v in memory.frozen_16bit(model)] == frozen
    np.testing.assert_array_equal(base.numpy(), stored)
    assert memory.restore_frozen_float32(model, right) == frozen
    np.testing.assert_array_equal(base.numpy(), pretrained)
    np.testing.assert_array_equal(model.get_layer("head").kernel.numpy(), head)


def test_unfreezing_goes_back_to_float32_with_a_warning():
    model, _ = _lora_fit("compute", epochs=1)
    model.layers[3].trainable = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        done = memory.prepare(model)
    assert model.layers[3].kernel.path in done.back_to_float32
    assert memory.storage_dtype(model.layers[3].kernel) == "float32"
    assert any(issubclass(w.category, AmpWarning) and "float32 storage" in str(w.message) for w in caught)


def test_unfrozen_weights_recompiled_with_lean_adam_are_lean_and_training_goes_on():
    # Fine-tuning: a head trained over a frozen (16-bit stored) layer, then the layer unfrozen and the model
    # compiled with LeanAdam. The thawed weights had stayed float32 beside a built LeanAdam, and the next
    # fit refused with "already built on float32 weights".
    model, _ = _lora_fit("compute", epochs=1)
    frozen = model.layers[3]
    assert memory.storage_dtype(frozen.kernel) == "bfloat16"  # guard: it was stored in 16 bits
    frozen.trainable = True
    model.compile(keras_amp.optimizers.LeanAdam(1e-3), "mse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)  # the back-to-float32 notice, tested above
        model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert memory.storage_dtype(frozen.kernel) == "bfloat16" and storage.is_marked_lean(frozen.kernel)
    before = frozen.kernel.numpy().copy()
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(model.evaluate(X, Y, verbose=0)) and not np.array_equal(frozen.kernel.numpy(), before)


def test_a_lean_adam_built_on_float32_weights_keeps_training_them_as_stored():
    # A custom loop that skipped prepare: LeanAdam built on float32 weights trains them as Keras's Adam
    # (and warns). Compiling and evaluating afterwards had raised from fit's prepare.
    keras_amp.enable("mixed_bfloat16")
    model = _model()
    model(X[:1])
    opt = keras_amp.optimizers.LeanAdam(1e-3)
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(Y[:16], model(X[:16], training=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AmpWarning)
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    model.compile(opt, "mse")
    assert np.isfinite(model.evaluate(X, Y, verbose=0))
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    assert {memory.storage_dtype(v) for v in model.trainable_variables} == {"float32"}


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        memory.prepare("not a model")
    unbuilt = keras.Sequential([keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="`model` must be built"):
        memory.prepare(unbuilt, keras_amp.optimizers.LeanAdam())
    with pytest.raises(ValueError, match="frozen_weights"):
        memory.prepare(_model(), frozen_weights="bf16")
    with pytest.raises(ValueError, match="frozen_weights"):
        keras_amp.enable("mixed_bfloat16", frozen_weights="half")
    assert keras_amp.config() is None or not getattr(keras_amp.config(), "enabled", False)


def _backbone(name, scale=1.0):
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(16, name="d1")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(8, name="d2")(hidden), name=name)
    model.set_weights([w * scale for w in model.get_weights()])
    return model


def test_restore_frozen_float32_from_a_backbone_file_on_the_model_around_it(tmp_path):
    # A keras-hub preset's model.weights.h5 holds the backbone's weights, not the task's.
    keras_amp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    backbone = _backbone("backbone")
    pretrained = str(tmp_path / "backbone.weights.h5")
    backbone.save_weights(pretrained)
    original = [w.copy() for w in backbone.get_weights()]
    backbone.trainable = False
    inputs = keras.Input((16,))
    frozen_head = keras.layers.Dense(4, name="frozen_head")
    outputs = keras.layers.Dense(4, name="head")(frozen_head(backbone(inputs)))
    model = keras.Model(inputs, outputs)
    frozen_head.trainable = False
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    head = model.get_layer("head").kernel.numpy().copy()
    outside = frozen_head.kernel.numpy().copy()
    assert memory.storage_dtype(backbone.get_layer("d1").kernel) == "bfloat16"  # guard
    with pytest.raises(ValueError):  # Keras's own load, for contrast: the file is not the model's
        model.load_weights(pretrained)
    model.get_layer("head").kernel.assign(head)
    restored = memory.restore_frozen_float32(model, pretrained)
    assert restored == [v.path for v in backbone.weights]
    for v, want in zip(backbone.weights, original):
        assert memory.storage_dtype(v) == "float32"
        np.testing.assert_array_equal(v.numpy(), want, err_msg=v.path)
    np.testing.assert_array_equal(model.get_layer("head").kernel.numpy(), head)  # trained: as it was
    assert memory.storage_dtype(frozen_head.kernel) == "bfloat16"  # outside the file's model: as it was
    np.testing.assert_array_equal(frozen_head.kernel.numpy(), outside)


def test_a_backbone_changed_alone_drops_the_steps_of_the_model_around_it(tmp_path):
    # The fitted model's traced steps captured the backbone's 16-bit variables; restoring the backbone
    # alone, with other values, must not leave them reading the old ones.
    keras_amp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    backbone = _backbone("backbone")
    other = str(tmp_path / "other.weights.h5")
    _backbone("other", scale=3.0).save_weights(other)
    backbone.trainable = False
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(backbone(inputs)))
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    before = model.predict(X, verbose=0)
    memory.restore_frozen_float32(backbone, other)
    keras_amp.disable()  # no `prepare` before the next step, which would have traced again anyway
    after = model.predict(X, batch_size=len(X), verbose=0)
    # A graph of the model traced now (eager differs where oneDNN fuses a bias into its matmul: one rounding).
    want = tf.function(lambda x: model(x, training=False))(X)
    np.testing.assert_array_equal(after, keras.ops.convert_to_numpy(want))
    assert np.abs(after - before).max() > 0.1


def test_restore_frozen_float32_refuses_a_file_that_fits_two_models_inside(tmp_path):
    keras_amp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    left, right = _backbone("left"), _backbone("right")
    path = str(tmp_path / "left.weights.h5")
    left.save_weights(path)
    left.trainable = right.trainable = False
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(4, name="head")(
        keras.layers.Concatenate()([left(inputs), right(inputs)])))
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    values = [v.numpy().copy() for v in model.weights]
    with pytest.raises(ValueError, match="2 models inside .*'left'.*'right'"):
        memory.restore_frozen_float32(model, path)
    for v, want in zip(model.weights, values):
        np.testing.assert_array_equal(v.numpy(), want, err_msg=v.path)
    assert {memory.storage_dtype(v) for v in left.weights + right.weights} == {"bfloat16"}


def test_restore_frozen_float32_on_a_keras_hub_task_from_its_backbone_file(tmp_path):
    keras_hub = pytest.importorskip("keras_hub")
    keras_amp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
                                             intermediate_dim=32, max_sequence_length=8)
    path = str(tmp_path / "model.weights.h5")  # what a preset holds: the backbone's weights
    backbone.save_weights(path)
    pretrained = {v.path: v.numpy().copy() for v in backbone.weights}
    task = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    backbone.enable_lora(2)
    task.compile(keras.optimizers.Adam(1e-2),
                 keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 64, (8, 8)), "padding_mask": np.ones((8, 8), bool)}
    task.fit(x, rng.integers(0, 64, (8, 8)), verbose=0)
    frozen = [v.path for v in memory.frozen_16bit(task)]
    adapters = {v.path: v.numpy().copy() for v in backbone.weights if "lora" in v.path}
    assert frozen and adapters and np.abs(np.concatenate([a.ravel() for a in adapters.values()])).max() > 0
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert memory.restore_frozen_float32(task, path) == frozen
    assert not said, [str(w.message) for w in said]  # the trial loads' warnings are not the user's
    for v in backbone.weights:
        if v.path in adapters:
            np.testing.assert_array_equal(v.numpy(), adapters[v.path], err_msg=v.path)
        elif v.path in frozen:
            assert memory.storage_dtype(v) == "float32"
            np.testing.assert_array_equal(v.numpy(), pretrained[v.path], err_msg=v.path)
