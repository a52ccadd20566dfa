"""`OutputHead`: the model's last Dense and its activation, in float32."""

import keras

from keras_amp import model_graph
from keras_amp.layers import arguments


@keras.saving.register_keras_serializable(package="keras_amp")
class OutputHead(model_graph.Float32Island, keras.layers.Dense):
    """A `Dense` layer (and its activation) that computes in float32.

    Under a mixed policy a stock `Dense(activation="softmax")` head runs its
    matmul, softmax and output in float16/bfloat16, so the model's
    probabilities and the loss input are rounded (float16 flushes
    probabilities below ~6e-8 to 0, and `log(0)` follows in the loss). This
    head is a `Dense` whose dtype policy is fixed to `"float32"`: inputs are
    cast to float32, the matmul, bias, activation and output are float32.
    Weights are the same as `Dense`'s, so stock checkpoints load.

    Args:
        units: Positive integer, dimensionality of the output space.
        activation: Activation function to use. Defaults to `None` (logits).
        **kwargs: Any other `keras.layers.Dense` argument (`use_bias`,
            initializers, regularizers, constraints, `name`). `dtype`, if
            given, must compute in float32.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> head = keras_amp.layers.OutputHead(10, activation="softmax")
    >>> head(np.ones((2, 64))).dtype
    tf.float32
    """

    def __init__(self, units, activation=None, **kwargs):
        # `units` is left to stock Dense, which checks it at construction and whose own tests pin
        # its error (drop-in wins over the house rule there; see BUILD_NOTES).
        arguments.check_activation("activation", activation)
        dtype = kwargs.pop("dtype", None)
        if dtype is None:
            dtype = "float32"
        policy = keras.dtype_policies.get(dtype)
        if policy.compute_dtype != "float32" or policy.variable_dtype != "float32":
            raise ValueError(
                "`OutputHead` computes in float32; its `dtype` must be a float32 "
                f"policy. Received: dtype={dtype!r}. Allowed: None, 'float32'"
            )
        # Float32 island: the head's matmul, activation and output are the loss
        # input, so they stay in float32 whatever the global policy.
        super().__init__(units, activation=activation, dtype=policy, **kwargs)
