"""2 workers, mixed_float16; worker 1's copy of global step 2 overflows float16, worker 0's does not.

argv: optimizer timeout
  optimizer: "amp" (keras_amp.optimizers.LossScaleOptimizer) or "stock" (keras.optimizers.LossScaleOptimizer)
"""

import sys
import time

import common
import keras

import keras_amp

kind, timeout = sys.argv[1], float(sys.argv[2])
POISON_STEP = 2
INITIAL_SCALE = 2.0**8  # small enough that the clean steps never overflow


def main():
    keras_amp.enable("mixed_float16")
    strategy = keras_amp.distribute.multi_worker(timeout_seconds=timeout)
    worker = common.task_index()
    sgd = keras.optimizers.SGD(0.05)
    with strategy.scope():
        if kind == "amp":
            optimizer = keras_amp.optimizers.LossScaleOptimizer(
                sgd, initial_scale=INITIAL_SCALE, dynamic_growth_steps=1000, hysteresis=1
            )
        else:
            optimizer = keras.optimizers.LossScaleOptimizer(sgd, initial_scale=INITIAL_SCALE, dynamic_growth_steps=1000)
        model = common.build_model()
        model.compile(optimizer=optimizer, loss="mse")
        model.build((None, common.FEATURES))
    initial = model.get_weights()
    clean_x, y = common.data()
    # 1e5 > float16 max (65504): the poisoned inputs become inf when cast to the compute dtype.
    x = common.data(poison_step=POISON_STEP, poison_value=1e5)[0] if worker == 1 else clean_x
    print(f"worker {worker} poisoned={worker == 1} step={POISON_STEP}", flush=True)
    start = time.monotonic()
    history = model.fit(common.dataset(x, y), epochs=2, verbose=0)
    digest, total, finite = common.weights_digest(model)
    common.emit(
        worker=worker,
        seconds=time.monotonic() - start,
        losses=[float(v) for v in history.history["loss"]],
        digest=digest,
        weight_sum=total,
        finite=finite,
        scale=float(optimizer.dynamic_scale.numpy()),
        overflow_count=int(optimizer.overflow_count.numpy()) if kind == "amp" else None,
        consecutive_overflows=int(optimizer.consecutive_overflows.numpy()) if kind == "amp" else None,
        iterations=int(optimizer.iterations.numpy()),
        total_steps=int(optimizer.total_steps.numpy()) if kind == "amp" else None,
        # Both workers skipped global step 2 of each epoch (steps 2 and 6); the reference skips exactly those.
        ref_max_abs_diff=common.max_abs_diff(
            model.get_weights(), common.sgd_reference(initial, clean_x, y, lr=0.05, epochs=2, skip_steps={POISON_STEP, POISON_STEP + 4})
        ),
    )


common.run(main)
