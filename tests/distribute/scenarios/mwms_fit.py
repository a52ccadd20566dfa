"""MultiWorkerMirroredStrategy fit on 2 workers: stock Keras 3.15 vs keras_amp's fit fix.

argv: policy fix timeout
  fix: "none" (stock Keras), "build" (only the _maybe_symbolic_build half),
       "full" (keras_amp.distribute.multi_worker, and VerifyPrecision at fit start)
"""

import sys

import common  # noqa: F401  (sets TF_CPP_MIN_LOG_LEVEL before TensorFlow loads)
import keras
import tensorflow as tf

import keras_amp
from keras_amp.distribute import trainer_fix

policy, fix, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])


def main():
    keras_amp.enable(policy)
    if fix == "full":
        strategy = keras_amp.distribute.multi_worker(timeout_seconds=timeout)
    else:
        if fix == "build":
            from keras.src.backend.tensorflow import trainer as tf_trainer

            tf_trainer.TensorFlowTrainer._maybe_symbolic_build = trainer_fix.fixed_maybe_symbolic_build
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    with strategy.scope():
        model = common.build_model()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x, y = common.data()
    model.build((None, common.FEATURES))
    initial = model.get_weights()
    # With the fix, also the precision check at fit start, where it passes (both workers agree).
    check = [keras_amp.distribute.VerifyPrecision()] if fix == "full" else []
    history = model.fit(common.dataset(x, y), epochs=2, verbose=0, callbacks=check)
    digest, total, finite = common.weights_digest(model)
    common.emit(
        worker=common.task_index(),
        replicas=strategy.num_replicas_in_sync,
        losses=[float(v) for v in history.history["loss"]],
        digest=digest,
        weight_sum=total,
        finite=finite,
        compute_dtype=model.layers[0].compute_dtype,
        variable_dtype=model.layers[0].variable_dtype,
        iterations=int(model.optimizer.iterations.numpy()),
        fix_installed=trainer_fix.fit_fix_installed(),
        verified_fields=sorted(check[0].fields) if check else [],
        ref_max_abs_diff=common.max_abs_diff(
            model.get_weights(), common.sgd_reference(initial, x, y, lr=0.05, epochs=2)
        ),
    )


common.run(main)
