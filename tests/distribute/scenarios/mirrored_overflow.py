"""Scenario: an overflow on one replica only, under MirroredStrategy on two logical CPUs.

argv: [optimizer ...] ("stock" Keras, "ours"; default both)
For each optimizer and each poisoned replica (1, then 0): one clean step, then one step where
only that replica's half of the global batch holds inf. Prints one RESULT line;
tests/distribute/test_loss_scale_mirrored.py asserts on it.
"""

import sys

import common
from keras_amp.distribute import local_cluster

local_cluster.configure_logical_cpus(2)  # before TensorFlow initialises its devices

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_amp.optimizers import LossScaleOptimizer  # noqa: E402

PER_REPLICA = 4
INITIAL_SCALE = 1024.0


def _run(strategy, make_optimizer, poisoned_replica):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        inputs = keras.Input((3,))
        hidden = keras.layers.Dense(4, name="hidden")(inputs)
        outputs = keras.layers.Dense(1, dtype="float32", name="head")(hidden)
        model = keras.Model(inputs, outputs)
        opt = make_optimizer()
        opt.build(model.trainable_variables)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, PER_REPLICA, 3)).astype("float32")
    y = rng.normal(size=(2, PER_REPLICA, 1)).astype("float32")

    def per_replica(poison):
        def value_fn(ctx):
            rid = ctx.replica_id_in_sync_group
            xs = x[rid].copy()
            if poison and rid == poisoned_replica:
                xs[0, 0] = np.inf
            return tf.constant(xs), tf.constant(y[rid])

        return strategy.experimental_distribute_values_from_function(value_fn)

    @tf.function
    def train_step(batch):
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            local_finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
            opt.apply(grads, model.trainable_variables)
            return local_finite

        return strategy.run(step, args=batch)

    def replica_weights():
        return [[np.asarray(t) for t in strategy.experimental_local_results(v.value)]
                for v in model.trainable_variables]

    def scale():
        return float(np.asarray(strategy.experimental_local_results(opt.dynamic_scale.value)[0]))

    train_step(per_replica(False))
    before = replica_weights()
    scale_before = scale()
    local_finite = strategy.experimental_local_results(train_step(per_replica(True)))
    after = replica_weights()
    result = {
        "local_finite": [bool(np.asarray(f)) for f in local_finite],
        "weights_finite": all(np.isfinite(w).all() for ws in after for w in ws),
        "replicas_identical": all(np.array_equal(ws[0], w) for ws in after for w in ws[1:]),
        "weights_unchanged": all(np.array_equal(a, b) for wa, wb in zip(after, before)
                                 for a, b in zip(wa, wb)),
        "scale_before": scale_before,
        "scale_after": scale(),
        "iterations": int(np.asarray(opt.iterations)),
    }
    if isinstance(opt, LossScaleOptimizer):
        result["overflow_count"] = int(np.asarray(opt.overflow_count))
        result["total_steps"] = int(np.asarray(opt.total_steps))
    return result


def main():
    keras.config.set_dtype_policy("mixed_float16")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    makers = {
        "stock": lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.01), initial_scale=INITIAL_SCALE),
        "ours": lambda: LossScaleOptimizer(
            keras.optimizers.SGD(0.01), initial_scale=INITIAL_SCALE),
    }
    only = sys.argv[1:] or list(makers)
    out = {"num_replicas": strategy.num_replicas_in_sync}
    for name in only:
        for poisoned in (1, 0):
            out[f"{name}_replica{poisoned}"] = _run(strategy, makers[name], poisoned)
    common.emit(**out)


common.run(main)
