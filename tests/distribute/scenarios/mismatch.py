"""2 workers; worker 1 differs from worker 0 in one precision setting. Every worker must fail fast.

argv: field timeout
  field: "policy" | "tf32" (differ at strategy creation, checked by multi_worker());
         "tier" (differs at fit: VerifyPrecision.on_train_begin);
         "layer_policies" (differs at evaluate: VerifyPrecision.on_test_begin)
"""

import sys
import time

import common
import keras

import keras_amp

field, timeout = sys.argv[1], float(sys.argv[2])


def main():
    worker = common.task_index()
    odd = worker == 1
    policy = "mixed_float16" if field == "policy" and odd else "mixed_bfloat16"
    keras_amp.enable(policy, tf32=odd if field == "tf32" else None)
    start = time.monotonic()
    stage = "multi_worker"
    try:
        strategy = keras_amp.distribute.multi_worker(timeout_seconds=timeout)
        stage = "evaluate" if field == "layer_policies" else "fit"
        with strategy.scope():
            model = common.build_model()
            if field == "layer_policies" and odd:
                model.layers[0].dtype_policy = "float32"  # e.g. a float32 island on one worker only
            tier = "large" if field == "tier" and odd else "small"
            optimizer = keras_amp.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), tier=tier)
            model.compile(optimizer=optimizer, loss="mse")
        x, y = common.data()
        start = time.monotonic()
        check = [keras_amp.distribute.VerifyPrecision()]
        if stage == "evaluate":
            model.evaluate(common.dataset(x, y), verbose=0, callbacks=check)
        else:
            model.fit(common.dataset(x, y), epochs=1, verbose=0, callbacks=check)
    except keras_amp.distribute.FingerprintMismatchError as e:
        common.emit(worker=worker, stage=stage, fields=e.fields, message=str(e), seconds=time.monotonic() - start)
        return
    common.emit(worker=worker, stage="none", fields=[], message="no mismatch detected", seconds=time.monotonic() - start)


common.run(main)
