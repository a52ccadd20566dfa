"""LSTM and GRU whose gates and carried state are float32.

Written against Keras 3.15.1. Stock LSTM/GRU cells under a mixed policy compute
gate pre-activations, sigmoid/tanh and the cell state in float16/bfloat16, and
`keras.layers.RNN.call` casts every state to the compute dtype on the way into
and out of the loop, so a float16 cell state rounds every step (increments
below half its spacing, 0.03 at c=64, are lost).

Here the cells (subclasses of `LSTMCell`/`GRUCell`, same weights) do the input
and recurrent matmuls in the compute dtype, then add the float32 bias and run
gates, nonlinearities and the state update in float32. The carried state (LSTM
`c`, GRU `h`) stays float32 through the loop, in the stateful variables and
when returned; the LSTM's `h` is `o * tanh(c)`, bounded, recomputed every
step, and returned in the compute dtype like the output sequence.

The layers override `RNN.call` (a copy of the stock method with one dtype per
state instead of the compute dtype for all: stock's casts are inline, with no hook)
and are built with `use_cudnn=False`, the public switch to the generic loop: the
fused cuDNN kernel computes gates in the compute dtype. A float32-policy cell under
stock `RNN.call` was measured as the alternative and rounds the returned and
stateful states (BUILD_NOTES.md, "Layers").
"""

import keras
from keras import ops

from keras_amp import model_graph, validation
from keras_amp.layers import arguments
from keras_amp.numerics.islands import float32_value, weight_matmul

# Keras version the `call` override below was copied from.
KERAS_VERSION = "3.15.1"


def _masked(x, mask):
    """x * mask in x's dtype; `mask` is one mask or one per gate (implementation=1)."""
    if mask is None:
        return x
    if isinstance(mask, (list, tuple)):
        return [x * ops.cast(m, x.dtype) for m in mask]
    return x * ops.cast(mask, x.dtype)


def _project(x, kernel, mask, n, dtype):
    """x @ kernel in `dtype` (x in it), per gate when there is one dropout mask per gate.

    `kernel` is the float32 variable: in the time loop it is cast once, before the loop, and its
    gradient summed over the steps in float32 (`numerics.islands.weight_matmul`)."""
    x = _masked(x, mask)
    if isinstance(x, list):
        width = kernel.shape[1] // n
        return ops.concatenate(
            [weight_matmul(xi, kernel, dtype, slice(j * width, (j + 1) * width)) for j, xi in enumerate(x)],
            axis=-1,
        )
    return weight_matmul(x, kernel, dtype)


def _f32(x):
    return ops.cast(x, "float32")


# Arguments checked at construction (stock clips dropout rates into [0, 1] silently and
# stores non-bool flags as given).
_CELL_CHECKS = {
    "units": arguments.check_positive_int,
    "use_bias": validation.check_bool,
    "dropout": arguments.check_rate,
    "recurrent_dropout": arguments.check_rate,
}
_LAYER_CHECKS = {
    **_CELL_CHECKS,
    "return_sequences": validation.check_bool,
    "return_state": validation.check_bool,
    "go_backwards": validation.check_bool,
    "stateful": validation.check_bool,
    "unroll": validation.check_bool,
}


@keras.saving.register_keras_serializable(package="keras_amp")
class LSTMCell(arguments.CheckedArguments, keras.layers.LSTMCell):
    """`keras.layers.LSTMCell` with float32 gates and cell state.

    Same arguments and weights as `keras.layers.LSTMCell`. States are
    `[h, c]`: `h` in the compute dtype, `c` float32. The cell has
    `autocast=False`, so every cast in `call` is explicit.
    """

    STOCK = keras.layers.LSTMCell
    ARGUMENT_CHECKS = {**_CELL_CHECKS, "unit_forget_bias": validation.check_bool}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.autocast = False

    @property
    def state_dtypes(self):
        return [self.compute_dtype, "float32"]

    def call(self, inputs, states, training=False):
        dtype = self.compute_dtype
        h_tm1 = ops.cast(states[0], dtype)
        c_tm1 = _f32(states[1])
        inputs = ops.cast(inputs, dtype)
        dp_mask = self.get_dropout_mask(inputs) if training and 0.0 < self.dropout < 1.0 else None
        rec_mask = (
            self.get_recurrent_dropout_mask(h_tm1)
            if training and 0.0 < self.recurrent_dropout < 1.0
            else None
        )
        # Matmuls in the compute dtype (the speed of mixed precision); their
        # sums, the bias and everything after in float32: sigmoid saturation and
        # c = f * c + i * g need float32 resolution over many steps.
        z = _f32(_project(inputs, self.kernel, dp_mask, 4, dtype))
        z = z + _f32(_project(h_tm1, self.recurrent_kernel, rec_mask, 4, dtype))
        if self.use_bias:
            z = z + float32_value(self.bias)
        z_i, z_f, z_c, z_o = ops.split(z, 4, axis=-1)
        i = self.recurrent_activation(z_i)
        f = self.recurrent_activation(z_f)
        c = f * c_tm1 + i * self.activation(z_c)
        o = self.recurrent_activation(z_o)
        h = ops.cast(o * self.activation(c), dtype)
        return h, [h, c]

    def get_initial_state(self, batch_size=None):
        return [ops.zeros((batch_size, self.units), dtype=d) for d in self.state_dtypes]


@keras.saving.register_keras_serializable(package="keras_amp")
class GRUCell(arguments.CheckedArguments, keras.layers.GRUCell):
    """`keras.layers.GRUCell` with float32 gates and hidden state.

    Same arguments and weights as `keras.layers.GRUCell`. The carried state
    `h` is float32; the cell's output is `h` in the compute dtype.
    """

    STOCK = keras.layers.GRUCell
    ARGUMENT_CHECKS = {**_CELL_CHECKS, "reset_after": validation.check_bool}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.autocast = False

    @property
    def state_dtypes(self):
        return ["float32"]

    def call(self, inputs, states, training=False):
        dtype = self.compute_dtype
        h_tm1 = _f32(states[0] if keras.tree.is_nested(states) else states)
        h_tm1_c = ops.cast(h_tm1, dtype)
        inputs = ops.cast(inputs, dtype)
        dp_mask = self.get_dropout_mask(inputs) if training and 0.0 < self.dropout < 1.0 else None
        rec_mask = (
            self.get_recurrent_dropout_mask(h_tm1_c)
            if training and 0.0 < self.recurrent_dropout < 1.0
            else None
        )
        units = self.units
        if self.use_bias:
            bias = float32_value(self.bias)
            input_bias, recurrent_bias = (bias[0], bias[1]) if self.reset_after else (bias, None)
        # Matmuls in the compute dtype; gates, bias and the state mix in float32
        # (h = z * h + (1 - z) * hh accumulates over steps like an LSTM's c).
        x = _f32(_project(inputs, self.kernel, dp_mask, 3, dtype))
        if self.use_bias:
            x = x + input_bias
        x_z, x_r, x_h = ops.split(x, 3, axis=-1)
        h_gates = _masked(h_tm1_c, rec_mask)
        h_z, h_r, h_h = h_gates if isinstance(h_gates, list) else [h_gates] * 3
        k_z, k_r, k_h = (slice(j * units, (j + 1) * units) for j in range(3))  # recurrent kernel's columns
        rec_z = _f32(weight_matmul(h_z, self.recurrent_kernel, dtype, k_z))
        rec_r = _f32(weight_matmul(h_r, self.recurrent_kernel, dtype, k_r))
        if self.reset_after and self.use_bias:
            rec_z = rec_z + recurrent_bias[:units]
            rec_r = rec_r + recurrent_bias[units : 2 * units]
        z = self.recurrent_activation(x_z + rec_z)
        r = self.recurrent_activation(x_r + rec_r)
        if self.reset_after:
            rec_h = _f32(weight_matmul(h_h, self.recurrent_kernel, dtype, k_h))
            if self.use_bias:
                rec_h = rec_h + recurrent_bias[2 * units :]
            rec_h = r * rec_h
        else:
            rec_h = _f32(weight_matmul(ops.cast(r * _f32(h_h), dtype), self.recurrent_kernel, dtype, k_h))
        hh = self.activation(x_h + rec_h)
        h = z * h_tm1 + (1.0 - z) * hh
        new_state = [h] if keras.tree.is_nested(states) else h
        return ops.cast(h, dtype), new_state

    def get_initial_state(self, batch_size=None):
        return [ops.zeros((batch_size, self.units), dtype="float32")]


def _use_cudnn(layer_name, value):
    """`use_cudnn` checked: "auto" or False (both mean the generic loop); True raises."""
    if value is False or (isinstance(value, str) and value == "auto"):
        return False
    if value is True:
        raise ValueError(
            f"keras_amp's {layer_name} keeps gates and state in float32 and cannot use cuDNN, "
            "whose fused kernel computes them in the compute dtype. "
            f"Received: use_cudnn={value!r}. Allowed: 'auto', False"
        )
    if isinstance(value, str):
        raise ValueError(f"Unknown `use_cudnn`. Received: use_cudnn={value!r}. Allowed: 'auto', False")
    raise TypeError(f"`use_cudnn` must be 'auto' or False. Received: use_cudnn={value!r} of type {type(value).__name__}")


class _Float32Carry(model_graph.Float32Island, arguments.CheckedArguments):
    """Arguments checked at creation; the cell swapped for ours; `RNN.call` (Keras 3.15.1)
    with per-state dtypes instead of one compute dtype."""

    CELL: type

    def __init__(self, *args, **kwargs):
        _use_cudnn(type(self).__name__, kwargs.pop("use_cudnn", "auto"))
        # use_cudnn=False: the stock layer's public switch to the generic loop, where our
        # cell runs (cuDNN would compute the gates in the compute dtype).
        super().__init__(*args, use_cudnn=False, **kwargs)
        stock_cell = self.cell
        self.cell = self.CELL.from_config(stock_cell.get_config())
        # The stock cell was tracked when the stock constructor assigned it; drop it so
        # the layer has one cell (and one set of weights) as stock does.
        self._layers[:] = [sub for sub in self._layers if sub is not stock_cell]
        # Our `call` casts explicitly; float32 states and stateful variables must
        # not be autocast to the compute dtype when read.
        self.autocast = False

    def _state_dtypes(self):
        return self.cell.state_dtypes

    def call(self, sequences, initial_state=None, mask=None, training=False):
        timesteps = sequences.shape[1]
        if self.unroll and timesteps is None:
            raise ValueError(
                "Cannot unroll a RNN if the time dimension is undefined. "
                f"Received: sequences.shape={sequences.shape}"
            )
        if initial_state is None:
            if self.stateful:
                # Read the float32 state variables without autocasting.
                initial_state = [float32_value(v) for v in self.states]
            else:
                initial_state = self.get_initial_state(batch_size=ops.shape(sequences)[0])
        if self.stateful:
            actual_batch_size = sequences.shape[0]
            if (
                self._expected_batch_size is not None
                and actual_batch_size is not None
                and actual_batch_size != self._expected_batch_size
            ):
                raise ValueError(
                    "If an RNN is stateful, the batch size of the input sequences "
                    "must be the same as the batch size of the initial state. "
                    f"Received: batch_size={actual_batch_size}, "
                    f"expected: {self._expected_batch_size}"
                )
        if not keras.tree.is_nested(initial_state):
            initial_state = [initial_state]
        initial_state = list(initial_state)
        if len(initial_state) != len(self._state_dtypes()):
            names = "[h, c]" if len(self._state_dtypes()) == 2 else "[h]"
            raise ValueError(
                f"`initial_state` must hold {len(self._state_dtypes())} tensor(s), {names}, for "
                f"{type(self).__name__}. Received: initial_state with {len(initial_state)} tensors"
            )
        # Stock casts every state to the compute dtype here; the carried state
        # must stay float32 or it rounds to float16 at every step.
        initial_state = [
            ops.cast(s, d) for s, d in zip(initial_state, self._state_dtypes())
        ]
        sequences = ops.cast(sequences, self.compute_dtype)
        self._maybe_config_dropout_masks(self.cell, sequences[:, 0, :], initial_state)
        last_output, outputs, states = self.inner_loop(
            sequences=sequences, initial_state=initial_state, mask=mask, training=training
        )
        last_output = ops.cast(last_output, self.compute_dtype)
        outputs = ops.cast(outputs, self.compute_dtype)
        states = [ops.cast(s, d) for s, d in zip(states, self._state_dtypes())]
        self._maybe_reset_dropout_masks(self.cell)
        if self.stateful:
            for self_state, state in zip(self.states, states):
                self_state.assign(state)
        output = outputs if self.return_sequences else last_output
        if self.return_state:
            return output, *states
        return output

    def compute_output_spec(self, sequences, initial_state=None, mask=None, training=False):
        spec = super().compute_output_spec(sequences, initial_state=initial_state)
        if not self.return_state:
            return spec
        output, *states = spec
        states = [keras.KerasTensor(s.shape, dtype=d) for s, d in zip(states, self._state_dtypes())]
        return [output, *states]


@keras.saving.register_keras_serializable(package="keras_amp")
class LSTM(_Float32Carry, keras.layers.LSTM):
    """`keras.layers.LSTM` with float32 gates and cell state.

    Same arguments, weights and config as `keras.layers.LSTM`. Input and
    recurrent matmuls run in the compute dtype; gate pre-activations, sigmoid
    and tanh, and the cell state `c` are float32. Outputs and the returned `h`
    state are in the compute dtype; the returned `c` state is float32 (so a
    float32 state can be fed back as `initial_state` without rounding), as
    are the stateful variables. cuDNN is never used (it would compute gates in
    the compute dtype): `use_cudnn` may be `"auto"` or `False` and is stored as
    `False`; `True` raises. `units`, the dropout rates and the flags are checked
    when the layer is created; `initial_state` must be `[h, c]`.

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> out, h, c = keras_amp.layers.LSTM(32, return_state=True)(x)
    >>> out.dtype, h.dtype, c.dtype
    (tf.float16, tf.float16, tf.float32)
    """

    STOCK = keras.layers.LSTM
    CELL = LSTMCell
    ARGUMENT_CHECKS = {**_LAYER_CHECKS, "unit_forget_bias": validation.check_bool}


@keras.saving.register_keras_serializable(package="keras_amp")
class GRU(_Float32Carry, keras.layers.GRU):
    """`keras.layers.GRU` with float32 gates and hidden state.

    Same arguments, weights and config as `keras.layers.GRU`. Input and
    recurrent matmuls run in the compute dtype; gate pre-activations,
    nonlinearities and the carried hidden state are float32. Outputs are in
    the compute dtype; the returned state and the stateful variable are
    float32 (the state is the carry). cuDNN is never used (`use_cudnn` as for
    `LSTM`); arguments are checked when the layer is created; `initial_state`
    must be `[h]`.

    Example:

    >>> keras.config.set_dtype_policy("mixed_bfloat16")
    >>> out, h = keras_amp.layers.GRU(32, return_state=True)(x)
    >>> out.dtype, h.dtype
    (tf.bfloat16, tf.float32)
    """

    STOCK = keras.layers.GRU
    CELL = GRUCell
    ARGUMENT_CHECKS = {**_LAYER_CHECKS, "reset_after": validation.check_bool}
