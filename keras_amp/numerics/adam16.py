"""Adam's update of one 16-bit-stored weight, as one function (optionally XLA-compiled).

`LeanAdam` keeps a weight as 16 bits plus a compensation and its moments in bfloat16. As
separate TensorFlow ops, one update reads and writes each of those arrays several times and
keeps float32 temporaries of the weight's size alive. Compiled with XLA (`jit=True`, LeanAdam's
default), the update (reconstruct the float32 master, decay, both moments, the step, split or
round again) is one element-wise loop: one read of the state and one write. Conversions to and
from bfloat16 use integer bit operations (`numerics.bits`), and stochastic rounding a hash
(`bits.dither`), not Philox: XLA's CPU backend is slow at both bfloat16 converts and Philox.

The float32 arithmetic follows Keras's `Adam.update_step` operation by operation.

`kernel` returns the new state, which the caller assigns: until then it exists beside the old, with
XLA's float32 temporaries (12 bytes a parameter held beside the state, tested). `in_place` is the
same update as calls that each write part of the state into its variable's own buffer (XLA aliases
a variable's update with its input when no other loop of the call still reads that input): only
the new compensation half, 2 bytes a parameter, is held beside the state.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import tensorflow as tf

from keras_amp.numerics import bits


def _to_float32(x):
    return bits.bfloat16_to_float32(x) if x.dtype == tf.bfloat16 else tf.cast(x, tf.float32)


def _master(kind, hi, low):
    if kind == "split":
        return bits.join(hi, low)
    if kind == "kahan":
        return bits.kahan_join(hi, low)
    return _to_float32(hi)


def _store(kind, new, dtype, seed):
    if kind == "split":
        return bits.split(new)
    if kind == "kahan":
        return bits.kahan_split(new, dtype)
    if kind == "stochastic":
        return bits.stochastic_round(new, seed), None
    return (bits.round_to_bfloat16(new) if dtype == tf.bfloat16 else tf.cast(new, dtype)), None


def _step(kind, hi, low, m, v, g, scalars, decay):
    """(master after weight decay, new master, first moment, second moment), float32: Keras Adam's
    arithmetic."""
    lr, alpha, _, _, eps, wd = tf.unstack(scalars)
    w = _master(kind, hi, low)
    if decay:
        w = w - w * wd * lr
    m32, v32 = _moments(m, v, g, scalars)
    return w, w - (m32 * alpha) / (tf.sqrt(v32) + eps), m32, v32


def _moments(m, v, g, scalars):
    _, _, one_minus_b1, one_minus_b2, _, _ = tf.unstack(scalars)
    g = tf.cast(g, tf.float32)
    m32 = _to_float32(m)
    v32 = _to_float32(v)
    return m32 + (g - m32) * one_minus_b1, v32 + (tf.square(g) - v32) * one_minus_b2


def _stored_moments(moments, m32, v32, seed):
    if moments == "float32":
        return m32, v32
    return bits.round_to_bfloat16(m32), bits.stochastic_round(v32, seed + tf.constant([0, 1], tf.int32))


@functools.lru_cache(maxsize=None)
def kernel(kind: str, moments: str, decay: bool, with_master: bool, jit: bool = False):
    """The compiled update for one configuration (cached: one trace per configuration and shape).

    Returns fn(hi, low, m, v, g, scalars, seed) -> (hi, low, m, v[, before, asked, stored]): the
    new state, and with `with_master` the float32 master before the Adam step (after weight
    decay, which is applied first), the one asked for and the one stored; where
    scalars = [lr, alpha, 1 - beta_1, 1 - beta_2, epsilon, weight_decay] (float32) and `low` is
    a dummy for kinds without compensation.
    """

    def update(hi, low, m, v, g, scalars, seed):
        w, new, m32, v32 = _step(kind, hi, low, m, v, g, scalars, decay)
        hi2, low2 = _store(kind, new, hi.dtype, seed)
        m2, v2 = _stored_moments(moments, m32, v32, seed)
        out = (hi2, low if low2 is None else low2, m2, v2)
        if with_master:
            out += (w, new, _master(kind, hi2, low2))
        return out

    return tf.function(update, jit_compile=jit, autograph=False)


class InPlace(NamedTuple):
    """`in_place`'s calls; each takes resource handles (`tf.Variable.handle`) and returns a scalar
    to order the next call on. For "split" and "kahan", in this order:

    - first(hi, low, m, v, g, scalars) -> the new half that is not written in place ("split": the
      low half, "kahan": the 16-bit weight);
    - second(hi, low, first, m, v, g, scalars): the other half, written in place. It recomputes the
      new master and takes it to the representation `first` fixes ("split": the top half that
      joins `first` exactly, `bits.top_half_for`), so the pair is exact even if the two compiled
      loops round a fused multiply-add differently;
    - put(target, first): `first` into its variable's own buffer;
    - moments(m, v, g, scalars, seed): both moments in place.

    For "stochastic" and "none": single(hi, m, v, g, scalars, seed) (the weight in place), then
    moments.
    """

    first: object
    second: object
    put: object
    single: object
    moments: object


@functools.lru_cache(maxsize=None)
def in_place(kind: str, moments: str, decay: bool, dtype: str) -> InPlace:
    """`kernel`'s update as XLA calls that write the state into the variables' own buffers (cached)."""
    weight_dtype = tf.as_dtype(dtype)
    low_dtype = tf.uint16 if kind == "split" else weight_dtype
    moment_dtype = tf.as_dtype(moments)
    read = tf.raw_ops.ReadVariableOp

    def state(hi, low, m, v):
        return (read(resource=hi, dtype=weight_dtype), None if low is None else read(resource=low, dtype=low_dtype),
                read(resource=m, dtype=moment_dtype), read(resource=v, dtype=moment_dtype))

    def assign(handle, value):
        tf.raw_ops.AssignVariableOp(resource=handle, value=value)
        return tf.constant(0)

    def first(hi, low, m, v, g, scalars):
        _, new, _, _ = _step(kind, *state(hi, low, m, v), g, scalars, decay)
        hi2, low2 = _store(kind, new, weight_dtype, None)
        return low2 if kind == "split" else hi2

    def second(hi, low, fixed, m, v, g, scalars):
        _, new, _, _ = _step(kind, *state(hi, low, m, v), g, scalars, decay)
        if kind == "split":
            return assign(hi, bits.top_half_for(new, fixed))
        return assign(low, tf.cast(new - tf.cast(fixed, tf.float32), low_dtype))

    def single(hi, m, v, g, scalars, seed):
        _, new, _, _ = _step(kind, *state(hi, None, m, v), g, scalars, decay)
        return assign(hi, _store(kind, new, weight_dtype, seed)[0])

    def both_moments(m, v, g, scalars, seed):
        m32, v32 = _moments(read(resource=m, dtype=moment_dtype), read(resource=v, dtype=moment_dtype), g, scalars)
        m2, v2 = _stored_moments(moments, m32, v32, seed)
        assign(m, m2)
        return assign(v, v2)

    jit = functools.partial(tf.function, jit_compile=True, autograph=False)
    return InPlace(jit(first), jit(second), jit(assign), jit(single), jit(both_moments))


def update_in_chunks(fn, variable, low_var, m_var, v_var, gradient, scalars, iterations, index: int,
                     chunk_elements: int) -> list:
    """`fn`'s update (a `kernel`) of one weight, about `chunk_elements` at a time along axis 0, one chunk
    after another: the float32 temporaries of a large weight (an embedding) never exist for the whole of
    it at once. `iterations` and `index` seed each chunk's stochastic rounding apart."""
    targets = [variable, None if low_var is None else low_var.value, m_var.value, v_var.value]
    gradient = tf.convert_to_tensor(gradient)
    rows = variable.shape[0]
    step = max(1, chunk_elements // (int(np.prod(variable.shape)) // rows))
    done = []
    for chunk, start in enumerate(range(0, rows, step)):
        part = slice(start, min(rows, start + step))
        seed = tf.stack([tf.cast(iterations, tf.int32), tf.constant(2 * (index * 4096 + chunk), tf.int32)])
        with tf.control_dependencies(done):
            low = targets[1][part] if targets[1] is not None else tf.zeros((), tf.uint16)
            out = fn(variable[part], low, targets[2][part], targets[3][part], gradient[part], scalars, seed)
            done = [t[part].assign(o) for t, o in zip(targets, out) if t is not None]
    return done
