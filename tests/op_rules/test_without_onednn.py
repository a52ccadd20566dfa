"""On TensorFlow with oneDNN off (the default on AVX2-only CPUs such as AMD Zen 3), the speed rules'
oneDNN kernels are not taken, and a bfloat16 model trains with no keras_amp warning beyond the one
piece of advice `enable` gives.

oneDNN is fixed when TensorFlow starts, so the models train in a subprocess started with
`TF_ENABLE_ONEDNN_OPTS=0`: a CNN (convolution, batch normalisation, ReLU: the fused batch-norm rule
and the bias-gradient rule) and a Transformer block (layer normalisation: the fused layer-norm rule;
attention scores, gelu and the cross-entropy: keras_amp's XLA kernels; dropout), and an LSTM under
the "rnn" recipe (its weight matmuls on float32 kernels: Eigen's bfloat16 ones are slower).
"""

import json
import os
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import json, sys, warnings
    import numpy as np
    import keras
    import tensorflow as tf
    import keras_amp
    from keras_amp import hardware
    from keras_amp.numerics import islands
    from keras_amp.op_rules import bias_add, fused_layer_norm
    from keras_amp.policy import AmpWarning
    sys.path.insert(0, sys.argv[1])
    from helpers import live_ops

    out = {"onednn": hardware.detect().onednn_enabled, "layer_norm_fuses": fused_layer_norm.device_fuses(),
           "bias_gradient": bias_add.gradient_method(), "float32_kernels": islands.float32_kernels("bfloat16")}
    with warnings.catch_warnings(record=True) as advice:
        warnings.simplefilter("always")
        keras_amp.enable("mixed_bfloat16")
    out["enable"] = [str(w.message) for w in advice if issubclass(w.category, AmpWarning)]

    def cnn():
        x = inputs = keras.Input((8, 8, 3))
        for filters in (8, 16):
            x = keras.layers.Conv2D(filters, 3, padding="same")(x)
            x = keras.layers.BatchNormalization()(x)
            x = keras.layers.ReLU()(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        return keras.Model(inputs, keras.layers.Dense(10)(x))

    def transformer():
        x = inputs = keras.Input((16,), dtype="int32")
        x = keras.layers.Embedding(64, 32)(x)
        h = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.MultiHeadAttention(4, 8, dropout=0.1)(h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization()(x)
        x = x + keras.layers.Dropout(0.1)(keras.layers.Dense(32)(keras.layers.Dense(64, activation="gelu")(h)))
        return keras.Model(inputs, keras.layers.Dense(64)(keras.layers.LayerNormalization()(x)))

    def lstm():
        x = inputs = keras.Input((16,), dtype="int32")
        x = keras.layers.LSTM(32, return_sequences=True)(keras.layers.Embedding(64, 16)(x))
        return keras_amp.apply_recipe(keras.Model(inputs, keras.layers.Dense(64)(x)), "rnn")

    rng = np.random.default_rng(0)
    data = {"cnn": (rng.normal(size=(16, 8, 8, 3)).astype("float32"), rng.integers(0, 10, 16)),
            "transformer": (rng.integers(0, 64, (16, 16)), rng.integers(0, 64, (16, 16)))}
    data["lstm"] = data["transformer"]
    for name, build in (("cnn", cnn), ("transformer", transformer), ("lstm", lstm)):
        keras.utils.set_random_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = build()
            model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            x, y = data[name]
            history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
            model.predict(x, verbose=0)
            graph = tf.function(lambda x: model(x, training=False)).get_concrete_function(x[:8]).graph
        out[name] = {
            "loss": history.history["loss"],
            "warnings": [f"{w.category.__name__} {w.filename}:{w.lineno}: {w.message}" for w in caught
                         if issubclass(w.category, AmpWarning) or "keras_amp" in w.filename],
            "types": sorted({op.type for op in live_ops(graph)}),
        }
    print("RESULT " + json.dumps(out))
""")


def test_without_onednn_the_kernels_stay_out_and_nothing_warns():
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="2")
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", _CHILD, tests_dir], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out["onednn"] is False
    # What enable() says once: bfloat16 has no fast path here (the user asked for it anyway).
    assert len(out["enable"]) == 1 and "oneDNN off" in out["enable"][0], out["enable"]
    # The kernels' choices: the op-by-op layer norm, the bias gradient as a float32-accumulating sum.
    assert out["layer_norm_fuses"] is False and out["bias_gradient"] == "sum"
    assert out["float32_kernels"] is True  # an RNN's weight matmuls: float32 kernels on exact upcasts
    for name in ("cnn", "transformer", "lstm"):
        result = out[name]
        assert result["warnings"] == [], (name, result["warnings"])
        assert all(0.0 < loss < 20.0 for loss in result["loss"]), (name, result["loss"])
        assert not [t for t in result["types"] if t.startswith("_Mkl")], (name, result["types"])
    # The guard sees the ops it looks for: the fused batch-norm rule's kernel (portable, not oneDNN's)
    # and the Transformer's normalisation as float32 ops.
    assert "FusedBatchNormV3" in out["cnn"]["types"], out["cnn"]["types"]
    assert "Rsqrt" in out["transformer"]["types"], out["transformer"]["types"]
