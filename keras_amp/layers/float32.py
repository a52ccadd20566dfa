"""`Float32(layer)`: run any layer as a float32 island; dtype helpers shared by the islands."""

import keras
from keras import ops

from keras_amp import model_graph, validation

_COMPUTE = "compute"
# `output_dtype` values besides None: the compute dtype, or a floating dtype by name.
OUTPUT_DTYPES = (_COMPUTE, "float16", "bfloat16", "float32", "float64")


def validate_output_dtype(output_dtype):
    """Returns `output_dtype` checked: None, "compute" or a floating dtype name."""
    if output_dtype is None:
        return None
    return validation.check_choice("output_dtype", output_dtype, OUTPUT_DTYPES)


def resolve_output_dtype(output_dtype, compute_dtype):
    """None -> float32 (the island's own dtype), "compute" -> `compute_dtype`."""
    if output_dtype is None:
        return "float32"
    if output_dtype == _COMPUTE:
        return compute_dtype
    return output_dtype


def _is_float(x):
    return hasattr(x, "dtype") and keras.backend.is_float_dtype(
        keras.backend.standardize_dtype(x.dtype)
    )


def _cast_floats(structure, dtype):
    return keras.tree.map_structure(
        lambda x: ops.cast(x, dtype) if _is_float(x) else x, structure
    )


@keras.saving.register_keras_serializable(package="keras_amp")
class Float32(model_graph.Float32Island, keras.layers.Wrapper):
    """Runs the wrapped layer in float32 under any dtype policy.

    For numerically sensitive layers Keras does not already keep in float32: a
    user's own normalisation, a custom loss head, an `exp`/`log` activation.
    The wrapped layer (and every layer nested in it) gets the `"float32"`
    policy, floating inputs are cast to float32, and floating outputs are cast
    to `output_dtype`. Variables are float32 under every mixed policy anyway,
    so weights are unchanged.

    Args:
        layer: A `keras.layers.Layer` instance to wrap. Its variables must be
            float32 (true of any layer built under `float32` or a mixed policy).
        output_dtype: `None`, `"compute"` or a floating dtype name. `None`
            (default) keeps the float32 result; `"compute"` casts it to the
            wrapper's compute dtype (e.g. float16 under `mixed_float16`).
        **kwargs: Base layer keyword arguments, such as `name`.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> norm = keras_amp.layers.Float32(MyNorm(), output_dtype="compute")
    >>> y = norm(x)  # MyNorm ran in float32, y is float16
    """

    def __init__(self, layer, output_dtype=None, **kwargs):
        validation.check_type("layer", layer, keras.layers.Layer, "a `keras.layers.Layer` instance")
        output_dtype = validate_output_dtype(output_dtype)
        super().__init__(layer, **kwargs)
        self.output_dtype = output_dtype
        bad = [w.path for w in layer.weights if w.dtype != "float32"]
        if bad:
            raise ValueError(
                "`Float32` needs a layer whose variables are float32. "
                f"Received: layer={layer.name!r} with non-float32 variables {bad}"
            )
        # Every nested layer too: a sublayer keeping its own mixed policy would
        # still compute in float16 inside the island. (The model walkers stop at this
        # island, so nothing inside needs a mark of its own.)
        layer.dtype_policy = "float32"
        for _, sublayer in model_graph.walk(layer):
            sublayer.dtype_policy = "float32"
        # Float32 island: no input autocast, so float32 inputs are not rounded to
        # the compute dtype before being cast (back) to float32.
        self.autocast = False

    def _output_dtype(self):
        return resolve_output_dtype(self.output_dtype, self.compute_dtype)

    def call(self, inputs, *args, **kwargs):
        # Inputs in float32 so the wrapped layer's statistics/exp/log never see
        # float16 range or bfloat16 rounding; nested policies are float32 too.
        inputs = _cast_floats(inputs, "float32")
        args = _cast_floats(args, "float32")
        outputs = self.layer(inputs, *args, **kwargs)
        return _cast_floats(outputs, self._output_dtype())

    def compute_output_spec(self, inputs, *args, **kwargs):
        spec = keras.tree.map_structure(
            lambda x: keras.KerasTensor(x.shape, "float32") if _is_float(x) else x,
            inputs,
        )
        outputs = self.layer.compute_output_spec(spec, *args, **kwargs)
        return keras.tree.map_structure(
            lambda x: keras.KerasTensor(x.shape, dtype=self._output_dtype())
            if _is_float(x)
            else x,
            outputs,
        )

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)

    def get_config(self):
        config = super().get_config()
        config["output_dtype"] = self.output_dtype
        return config
