"""MirroredStrategy over 2 logical CPUs: LeanAdam (16-bit weights, compensation, 16-bit moments)
and a frozen layer stored in 16 bits; every replica must hold the same bits.

argv: policy compensation [in_place]   ("mixed_bfloat16" stochastic | "mixed_float16" kahan in_place, ...)
in_place: every weight counts as large, so XLA updates it in place (`adam16.in_place`, on each
replica's variables through the update context's handles).
"""

import sys

import common
import keras
import numpy as np

import keras_amp
from keras_amp.numerics import adam16

policy, compensation = sys.argv[1], sys.argv[2]
if sys.argv[3:] == ["in_place"]:
    from keras_amp.optimizers import lean_adam

    lean_adam.CHUNK_ELEMENTS = 0


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
        in_place_configurations=adam16.in_place.cache_info().currsize,
        lean=list(inner._kinds[i][0] if inner._kinds[i] else "float32" for i in range(len(inner._kinds))),
    )


common.run(main)
