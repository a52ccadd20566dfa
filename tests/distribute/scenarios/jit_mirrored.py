"""MirroredStrategy + `compile(jit_compile=True)` + a loss-scale optimizer under mixed_float16
(keras-team/keras#21366: stock crashes there with several GPUs).

argv: optimizer devices
  optimizer: "stock" (keras.optimizers.LossScaleOptimizer) | "ours" (keras_amp.wrap)
  devices: "cpu1" (one CPU replica) | "gpu2" (the first two GPUs)
"""

import sys

import common
import keras
import tensorflow as tf

import keras_amp

optimizer_kind, devices = sys.argv[1], sys.argv[2]


def main():
    keras_amp.enable("mixed_float16")
    names = ["/cpu:0"] if devices == "cpu1" else [g.name.replace("physical_device:", "") for g in
                                                  tf.config.list_physical_devices("GPU")[:2]]
    strategy = tf.distribute.MirroredStrategy(names)
    with strategy.scope():
        model = common.build_model()
        sgd = keras.optimizers.SGD(0.05)
        optimizer = keras.optimizers.LossScaleOptimizer(sgd) if optimizer_kind == "stock" else keras_amp.wrap(sgd)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    x, y = common.data()
    history = model.fit(common.dataset(x, y), epochs=2, verbose=0)
    _, total, finite = common.weights_digest(model)
    common.emit(replicas=strategy.num_replicas_in_sync, losses=history.history["loss"], finite=finite,
                optimizer=type(model.optimizer).__module__, weight_sum=total)


common.run(main)
