"""Memory: weights stored in the dtype they are read in, and the bytes a model's state takes.

- `prepare(model, optimizer=None)`: frozen weights in their layers' compute dtype (16 bits);
  for a `keras_amp.optimizers.LeanAdam`, trainable weights of 16-bit layers in 16 bits too.
  `fit`/`evaluate`/`predict` call it while keras_amp is enabled.
- `restore_frozen_float32(model, weights_path)`: float32 storage (and values) back.
- `float32_weights(model)`: a context in which every weight is float32 (a float32 checkpoint).
- `state_bytes(model, optimizer)`: exact bytes of the weights and the optimizer's variables.
"""

from keras_amp.memory.frozen import Prepared, frozen_16bit, prepare, restore_frozen_float32
from keras_amp.memory.storage import set_storage, state_bytes, storage_dtype, variable_bytes
from keras_amp.memory.float32_copy import float32_weights, save_float32_weights

__all__ = ["Prepared", "float32_weights", "frozen_16bit", "prepare", "restore_frozen_float32",
           "save_float32_weights", "set_storage", "state_bytes", "storage_dtype", "variable_bytes"]
