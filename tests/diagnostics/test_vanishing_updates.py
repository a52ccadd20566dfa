"""keras_amp.diagnostics.vanishing_updates: the share of each update lost to rounding, per layer.

The keras-hub case (keras-team/keras-hub#2629), on a tiny Llama: Keras 3.15 creates LoRA adapters
in float32 even under a pure bfloat16 policy, so they move; but fine-tuning the bfloat16 weights
themselves with stock Adam never moves them (1 - 0.999 ** t rounds to 0 in bfloat16), and the
probe names those layers. keras_amp (mixed_bfloat16, frozen weights stored in 16 bits) moves the
adapters with the base weights in 16 bits.
"""

import numpy as np
import pytest

import keras
import keras_amp
from keras_amp import memory
from keras_amp.diagnostics import vanishing_updates as vu

hub = pytest.importorskip("keras_hub")


def _llama(lora=True):
    keras.utils.set_random_seed(3)
    backbone = hub.models.LlamaBackbone(vocabulary_size=64, num_layers=1, hidden_dim=16, intermediate_dim=32,
                                        num_query_heads=2, num_key_value_heads=1)
    if lora:
        backbone.enable_lora(2)
    return backbone


def _batch():
    r = np.random.RandomState(0)
    x = {"token_ids": r.randint(1, 64, (8, 6)).astype("int32"), "padding_mask": np.ones((8, 6), "int32")}
    return x, r.randn(8, 6, 16).astype("float32")


def _train(backbone, steps=4, watch="lora_kernel_a"):
    x, y = _batch()
    backbone.compile(keras.optimizers.Adam(1e-3), "mse")
    watched = [v for v in backbone.trainable_variables if watch in v.path]
    before = [np.asarray(v.numpy(), np.float64) for v in watched]
    probe = vu.UpdateLossProbe(backbone)
    probe.start()
    backbone.fit(x, y, batch_size=8, epochs=steps, verbose=0)
    fractions = probe.stop()
    moved = max(np.abs(np.asarray(v.numpy(), np.float64) - b).max() for v, b in zip(watched, before))
    return moved, fractions


def test_stock_pure_bfloat16_weights_never_move_and_the_report_names_the_layers():
    keras.config.set_dtype_policy("bfloat16")
    backbone = _llama(lora=False)
    moved, fractions = _train(backbone, watch="query/kernel")
    assert moved == 0.0
    # (The untied reverse embeddings get no gradient from a backbone loss: no update to measure.)
    bf16 = [v.path for v in backbone.trainable_variables
            if memory.storage_dtype(v) == "bfloat16" and "reverse_embeddings" not in v.path]
    assert len(bf16) >= 6 and all(fractions[path]["stalled"] == 1.0 for path in bf16)
    lines = vu.advice(fractions)
    assert any("self_attention/query" in line for line in lines) and "LeanAdam" in lines[0]


def test_lora_adapters_move_with_keras_amp_and_the_base_weights_are_16bit():
    keras_amp.enable("mixed_bfloat16")
    backbone = _llama()
    moved, fractions = _train(backbone)
    assert moved > 1e-4
    assert vu.advice(fractions) == []
    assert all(m["lost"] < 1e-3 for m in fractions.values())
    frozen = memory.frozen_16bit(backbone)
    assert len(frozen) >= 6 and all(memory.storage_dtype(v) == "bfloat16" for v in frozen)
    assert all("lora" not in v.path for v in frozen)


def test_rounding_loss_is_measured_for_16bit_weights_without_compensation():
    keras_amp.enable("mixed_bfloat16")
    x = np.random.RandomState(0).randn(32, 8).astype("float32")
    results = {}
    for name in ("none", "split"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64), keras.layers.Dense(1)])
        model.compile(keras_amp.optimizers.LeanAdam(1e-4, compensation=name), "mse")
        memory.prepare(model)
        probe = vu.UpdateLossProbe(model)
        model.fit(x, x[:, :1], verbose=0)  # traced with the probe, inactive
        idle = probe.stop()
        probe.start()
        model.fit(x, x[:, :1], verbose=0)
        results[name] = vu.by_layer(probe.stop())
        assert all(m == {"lost": 0.0, "stalled": 0.0} for m in idle.values())  # nothing measured while off
    wide = [sorted(r)[0] for r in (results["none"], results["split"])]  # the 64-unit Dense
    assert results["none"][wide[0]]["lost"] > 0.5 and results["split"][wide[1]]["lost"] < 1e-6


def test_a_float32_master_losing_steps_below_its_rounding_is_measured_against_float64():
    # Steps around float32's half ulp of 1.0 (2**-24): some are lost whole, some rounded. The probe had
    # taken `w + step` in float32 as the request, which is the rounding it measures: it read 0% lost.
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(2000, use_bias=False, kernel_initializer="ones")])
    model.compile(keras.optimizers.SGD(1e-7), "mse")
    probe = vu.UpdateLossProbe(model)
    (kernel,) = model.trainable_variables
    grad = np.random.RandomState(0).uniform(0.1, 3.0, (1, 2000)).astype("float32")
    w = kernel.numpy()
    probe.start()
    model.optimizer.apply_gradients([(grad, kernel)])
    measured = probe.stop()[kernel.path]
    asked = -1e-7 * grad.astype(np.float64)
    realized = kernel.numpy().astype(np.float64) - w
    assert 0 < np.mean(realized == 0) < 1  # guard: both lost and kept steps
    lost = np.abs(asked - realized).sum() / np.abs(asked).sum()
    assert 0.05 < lost < 0.95 and measured["lost"] == pytest.approx(lost, rel=1e-5)
    assert measured["stalled"] == pytest.approx(np.mean(realized == 0), abs=1e-7)
    assert "raise the learning rate" in vu.VanishingLayer("dense", lost, 1.0).advice


def test_record_takes_the_intended_value_or_the_change():
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    probe = vu.UpdateLossProbe(model)
    with pytest.raises(ValueError, match="one of `intended` and `change`"):
        probe.record(model.trainable_variables[0], before=0.0, realized=0.0)


def test_bad_arguments():
    with pytest.raises(TypeError, match="model"):
        vu.UpdateLossProbe("model")
    with pytest.raises(TypeError, match="optimizer"):
        vu.UpdateLossProbe(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]))


def test_vanishing_layers_are_structured_worst_first_and_at_the_threshold():
    fractions = {"enc/dense/kernel": {"lost": 0.2, "stalled": 0.9},
                 "enc/dense/bias": {"lost": 0.6, "stalled": 0.1},  # the layer's worst of each measure
                 "head/kernel": {"lost": 0.5, "stalled": 0.0},  # exactly at the threshold: reported
                 "ok/kernel": {"lost": 0.49, "stalled": 0.3}}
    found = vu.vanishing_layers(fractions, threshold=0.5)
    assert [(f.layer, f.lost, f.stalled) for f in found] == [("enc/dense", 0.6, 0.9), ("head", 0.5, 0.0)]
    assert vu.advice(fractions, 0.5) == [f.advice for f in found]
    assert found[0].advice.startswith("enc/dense: updates vanish (60% ") and "90% of its weights" in found[0].advice
    assert vu.vanishing_layers(fractions, threshold=0.95) == []
