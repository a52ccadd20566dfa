"""Adam's update of one 16-bit-stored weight, as one function (optionally XLA-compiled).

`LeanAdam` keeps a weight as 16 bits plus a compensation and its moments in bfloat16. As
separate TensorFlow ops, one update reads and writes each of those arrays several times and
keeps float32 temporaries of the weight's size alive. Compiled with XLA (`jit=True`, LeanAdam's
default), the update (reconstruct the float32 master, decay, both moments, the step, split or
round again) is one element-wise loop: one read of the state and one write. Conversions to and
from bfloat16 use integer bit operations (`numerics.bits`), and stochastic rounding a hash
(`bits.dither`), not Philox: XLA's CPU backend is slow at both bfloat16 converts and Philox.

The float32 arithmetic follows Keras's `Adam.update_step` operation by operation.
"""

from __future__ import annotations

import functools

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
        lr, alpha, one_minus_b1, one_minus_b2, eps, wd = tf.unstack(scalars)
        w = _master(kind, hi, low)
        if decay:
            w = w - w * wd * lr
        g = tf.cast(g, tf.float32)
        m32 = _to_float32(m)
        v32 = _to_float32(v)
        m32 = m32 + (g - m32) * one_minus_b1
        v32 = v32 + (tf.square(g) - v32) * one_minus_b2
        new = w - (m32 * alpha) / (tf.sqrt(v32) + eps)
        hi2, low2 = _store(kind, new, hi.dtype, seed)
        if moments == "float32":
            m2, v2 = m32, v32
        else:
            m2 = bits.round_to_bfloat16(m32)
            v2 = bits.stochastic_round(v32, seed + tf.constant([0, 1], tf.int32))
        out = (hi2, low if low2 is None else low2, m2, v2)
        if with_master:
            out += (w, new, _master(kind, hi2, low2))
        return out

    return tf.function(update, jit_compile=jit, autograph=False)
