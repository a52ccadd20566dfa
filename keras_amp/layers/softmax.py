"""Softmax that normalises in float32 whatever the dtype policy."""

import keras
from keras import ops

from keras_amp import model_graph
from keras_amp.layers import arguments
from keras_amp.layers.float32 import resolve_output_dtype, validate_output_dtype


@keras.saving.register_keras_serializable(package="keras_amp")
class Softmax(model_graph.Float32Island, keras.layers.Softmax):
    """Softmax activation layer computed in float32.

    Stock `keras.layers.Softmax` computes in the layer's compute dtype: under
    `mixed_float16` it rounds logits near 1e4 to multiples of 8 (bfloat16: 64)
    before normalising, so the differences between them, which are all a
    softmax sees, are lost; float16 probabilities also flush to zero below
    ~6e-8. This layer casts its inputs to float32, masks with a float32-safe
    large negative number and returns float32 probabilities (or casts back
    when asked).

    Args:
        axis: Integer, or list of Integers, axis along which the softmax
            normalization is applied. Defaults to `-1`.
        output_dtype: `None`, `"compute"`, `"float16"`, `"bfloat16"`,
            `"float32"` or `"float64"`. `None`
            (default) returns float32; `"compute"` casts the result back to
            the layer's compute dtype (e.g. float16 under `mixed_float16`).
        **kwargs: Base layer keyword arguments, such as `name` and `dtype`.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> probs = keras_amp.layers.Softmax()(np.array([[1e4, 0.0, -1e4]]))
    >>> probs.dtype
    tf.float32
    """

    def __init__(self, axis=-1, output_dtype=None, **kwargs):
        axis = arguments.check_axis("axis", axis)
        output_dtype = validate_output_dtype(output_dtype)
        super().__init__(axis=axis, **kwargs)
        self.output_dtype = output_dtype
        # Float32 island: without autocast the float32 logits a previous island
        # produced are not rounded to float16/bfloat16 on the way in.
        self.autocast = False

    def _output_dtype(self):
        return resolve_output_dtype(self.output_dtype, self.compute_dtype)

    def call(self, inputs, mask=None):
        # exp() and the normaliser overflow float16, and bfloat16's 8-bit
        # mantissa loses small probabilities: the whole softmax runs in float32.
        # With float32 logits the stock layer masks with -1e9, which float32 holds.
        inputs = ops.cast(inputs, "float32")
        if isinstance(self.axis, (tuple, list)) and len(self.axis) > 1:
            # Stock uses exp(x - logsumexp(x)) over several axes: for logits near
            # 1e4 that subtraction loses ~5e-4 even in float32. Shifting by the
            # max first (softmax is shift-invariant) keeps it exact.
            inputs = inputs - ops.stop_gradient(
                ops.max(inputs, axis=tuple(self.axis), keepdims=True)
            )
        outputs = super().call(inputs, mask=mask)
        return ops.cast(outputs, self._output_dtype())

    def compute_output_spec(self, inputs, mask=None):
        return keras.KerasTensor(inputs.shape, dtype=self._output_dtype())

    def get_config(self):
        config = super().get_config()
        config["output_dtype"] = self.output_dtype
        return config
