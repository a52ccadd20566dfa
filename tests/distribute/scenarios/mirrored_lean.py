"""MirroredStrategy over 2 logical CPUs: LeanAdam (16-bit weights, compensation, 16-bit moments)
and a frozen layer stored in 16 bits; every replica must hold the same bits.

argv: policy compensation   ("mixed_bfloat16" stochastic | "mixed_float16" kahan, ...)
"""

import sys

import common
import keras
import numpy as np

import keras_amp

policy, compensation = sys.argv[1], sys.argv[2]


def main():
    strategy = common.two_cpu_mirrored(policy)
    with strategy.scope():
        model = common.build_model()
        model.build((None, common.FEATURES))
        model.layers[0].trainable = False
        opt = keras_amp.optimizers.LeanAdam(1e-2, compensation=compensation)
        if policy == "mixed_float16":
            opt = keras_amp.LossScaleOptimizer(opt)
        model.compile(optimizer=opt, loss="mse")
    x, y = common.data()
    history = model.fit(common.dataset(x, y), epochs=2, verbose=0)
    inner = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    state = [v for v in model.weights] + [v for v in inner.variables]
    per_replica = [[np.atleast_1d(np.asarray(c.numpy())) for c in var.value.values] for var in state
                   if hasattr(var.value, "values")]
    common.emit(
        replicas=strategy.num_replicas_in_sync,
        losses=[float(v) for v in history.history["loss"]],
        storage=[keras_amp.memory.storage_dtype(v) for v in model.weights],
        mirrored=len(per_replica),
        replicas_identical=all(all(np.array_equal(c.view(np.uint8), copies[0].view(np.uint8)) for c in copies)
                               for copies in per_replica),
        lean=list(inner._kinds[i][0] if inner._kinds[i] else "float32" for i in range(len(inner._kinds))),
    )


common.run(main)
