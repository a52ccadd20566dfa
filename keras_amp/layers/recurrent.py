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

The layers override `RNN.call` (to keep the carried state float32; otherwise a
copy of the stock method) and never take the cuDNN path, whose fused kernel
computes gates in the compute dtype. On a GPU that costs speed against stock
LSTM/GRU with cuDNN; this was not measured (no GPU in the session that wrote
this). `tests/layers/test_recurrent.py` pins the stock sources these overrides
copy or rely on.
"""

import keras
from keras import ops

from keras_amp.layers.float32 import float32_value

# Keras version the `call` override below was copied from.
KERAS_VERSION = "3.15.1"


def _masked(x, mask):
    """x * mask in x's dtype; `mask` is one mask or one per gate (implementation=1)."""
    if mask is None:
        return x
    if isinstance(mask, (list, tuple)):
        return [x * ops.cast(m, x.dtype) for m in mask]
    return x * ops.cast(mask, x.dtype)


def _project(x, kernel, mask, n):
    """x @ kernel in x's dtype, per gate when there is one dropout mask per gate."""
    x = _masked(x, mask)
    if isinstance(x, list):
        return ops.concatenate(
            [ops.matmul(xi, k) for xi, k in zip(x, ops.split(kernel, n, axis=1))],
            axis=-1,
        )
    return ops.matmul(x, kernel)


def _f32(x):
    return ops.cast(x, "float32")


@keras.saving.register_keras_serializable(package="keras_amp")
class LSTMCell(keras.layers.LSTMCell):
    """`keras.layers.LSTMCell` with float32 gates and cell state.

    Same arguments and weights as `keras.layers.LSTMCell`. States are
    `[h, c]`: `h` in the compute dtype, `c` float32. The cell has
    `autocast=False`, so every cast in `call` is explicit.
    """

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
        z = _f32(_project(inputs, ops.cast(self.kernel, dtype), dp_mask, 4))
        z = z + _f32(_project(h_tm1, ops.cast(self.recurrent_kernel, dtype), rec_mask, 4))
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
class GRUCell(keras.layers.GRUCell):
    """`keras.layers.GRUCell` with float32 gates and hidden state.

    Same arguments and weights as `keras.layers.GRUCell`. The carried state
    `h` is float32; the cell's output is `h` in the compute dtype.
    """

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
        kernel = ops.cast(self.kernel, dtype)
        recurrent_kernel = ops.cast(self.recurrent_kernel, dtype)
        units = self.units
        if self.use_bias:
            bias = float32_value(self.bias)
            input_bias, recurrent_bias = (bias[0], bias[1]) if self.reset_after else (bias, None)
        # Matmuls in the compute dtype; gates, bias and the state mix in float32
        # (h = z * h + (1 - z) * hh accumulates over steps like an LSTM's c).
        x = _f32(_project(inputs, kernel, dp_mask, 3))
        if self.use_bias:
            x = x + input_bias
        x_z, x_r, x_h = ops.split(x, 3, axis=-1)
        h_gates = _masked(h_tm1_c, rec_mask)
        h_z, h_r, h_h = h_gates if isinstance(h_gates, list) else [h_gates] * 3
        k_z, k_r, k_h = ops.split(recurrent_kernel, 3, axis=1)
        rec_z = _f32(ops.matmul(h_z, k_z))
        rec_r = _f32(ops.matmul(h_r, k_r))
        if self.reset_after and self.use_bias:
            rec_z = rec_z + recurrent_bias[:units]
            rec_r = rec_r + recurrent_bias[units : 2 * units]
        z = self.recurrent_activation(x_z + rec_z)
        r = self.recurrent_activation(x_r + rec_r)
        if self.reset_after:
            rec_h = _f32(ops.matmul(h_h, k_h))
            if self.use_bias:
                rec_h = rec_h + recurrent_bias[2 * units :]
            rec_h = r * rec_h
        else:
            rec_h = _f32(ops.matmul(ops.cast(r * _f32(h_h), dtype), k_h))
        hh = self.activation(x_h + rec_h)
        h = z * h_tm1 + (1.0 - z) * hh
        new_state = [h] if keras.tree.is_nested(states) else h
        return ops.cast(h, dtype), new_state

    def get_initial_state(self, batch_size=None):
        return [ops.zeros((batch_size, self.units), dtype="float32")]


class _Float32CarryMixin:
    """`RNN.call` (Keras 3.15.1) with per-state dtypes instead of one compute dtype."""

    def _state_dtypes(self):
        return self.cell.state_dtypes

    def inner_loop(self, sequences, initial_state, mask, training=False):
        # Skip the stock LSTM/GRU cuDNN attempt: cuDNN computes gates in the
        # compute dtype. Always run our cell in the generic loop.
        return keras.layers.RNN.inner_loop(
            self, sequences, initial_state, mask, training=training
        )

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
        # Stock casts every state to the compute dtype here; the carried state
        # must stay float32 or it rounds to float16 at every step.
        initial_state = [
            ops.cast(s, d) for s, d in zip(list(initial_state), self._state_dtypes())
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


def _swap_cell(layer, cell_cls):
    """Replaces the stock cell built by the stock constructor with ours (same args)."""
    stock_cell = layer.cell
    layer.cell = cell_cls.from_config(stock_cell.get_config())
    # The stock cell was tracked when the stock constructor assigned it; drop
    # it so the layer has one cell (and one set of weights) as stock does.
    layer._layers[:] = [sub for sub in layer._layers if sub is not stock_cell]
    # Our `call` casts explicitly; float32 states and stateful variables must
    # not be autocast to the compute dtype when read.
    layer.autocast = False


@keras.saving.register_keras_serializable(package="keras_amp")
class LSTM(_Float32CarryMixin, keras.layers.LSTM):
    """`keras.layers.LSTM` with float32 gates and cell state.

    Same arguments, weights and config as `keras.layers.LSTM`. Input and
    recurrent matmuls run in the compute dtype; gate pre-activations, sigmoid
    and tanh, and the cell state `c` are float32. Outputs and the returned `h`
    state are in the compute dtype; the returned `c` state is float32 (so a
    float32 state can be fed back as `initial_state` without rounding), as
    are the stateful variables. `use_cudnn` is accepted for compatibility but
    cuDNN is never used (it would compute gates in the compute dtype).

    Example:

    >>> keras.config.set_dtype_policy("mixed_float16")
    >>> out, h, c = keras_amp.layers.LSTM(32, return_state=True)(x)
    >>> out.dtype, h.dtype, c.dtype
    (tf.float16, tf.float16, tf.float32)
    """

    def __init__(self, units, *args, **kwargs):
        super().__init__(units, *args, **kwargs)
        _swap_cell(self, LSTMCell)


@keras.saving.register_keras_serializable(package="keras_amp")
class GRU(_Float32CarryMixin, keras.layers.GRU):
    """`keras.layers.GRU` with float32 gates and hidden state.

    Same arguments, weights and config as `keras.layers.GRU`. Input and
    recurrent matmuls run in the compute dtype; gate pre-activations,
    nonlinearities and the carried hidden state are float32. Outputs are in
    the compute dtype; the returned state and the stateful variable are
    float32 (the state is the carry). cuDNN is never used.

    Example:

    >>> keras.config.set_dtype_policy("mixed_bfloat16")
    >>> out, h = keras_amp.layers.GRU(32, return_state=True)(x)
    >>> out.dtype, h.dtype
    (tf.bfloat16, tf.float32)
    """

    def __init__(self, units, *args, **kwargs):
        super().__init__(units, *args, **kwargs)
        _swap_cell(self, GRUCell)
