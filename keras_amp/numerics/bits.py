"""16-bit storage of float32 values: the exact 16+16 split, Kahan pairs and stochastic rounding.

- `split` / `join`: a float32 is its bfloat16 rounding and a uint16 of its 16 low mantissa bits.
  `join(split(x)) == x` bit for bit, for every finite float32 and infinity, so a bfloat16 weight
  plus its low half is a float32 master in 4 bytes. The bfloat16 half is `x` rounded to nearest
  with ties away from zero (whether it rounded up is then `low >= 0x8000`); it differs from
  TensorFlow's cast (ties to even) only on exact ties.
- `kahan_split`: `hi` is `x` rounded to the 16-bit dtype and `lo` the rounded remainder `x - hi`:
  about twice the 16-bit precision, for float16 where no exact split exists.
- `stochastic_round`: rounds float32 to bfloat16 up or down with probability given by the distance,
  so that the expected stored value equals `x`: small increments survive on average instead of
  being rounded away every step. Seeded statelessly, so that every replica rounds the same way.
- `dither`: the 16 random bits per element that stochastic rounding adds, a counter-based integer
  hash of (seed, element index). Not Philox (`tf.random.stateless_uniform`): XLA's CPU backend
  expands Philox into 64-bit multiplies it does not vectorise, and one Adam step over an 8.4M-element
  weight took 150 times as long with it as with the hash (BUILD_NOTES); three 32-bit multiplies and
  shifts fuse into the update's loop.
"""

from __future__ import annotations

import tensorflow as tf

_LOW_MASK = 0xFFFF
_HALF = 0x8000


def split(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """float32 `x` -> (bfloat16 `x` rounded half up, uint16 low half of `x`), exact."""
    bits = tf.bitcast(tf.convert_to_tensor(x, tf.float32), tf.uint32)
    rounded = tf.bitwise.right_shift(bits + _HALF, 16)
    hi = tf.bitcast(tf.cast(rounded, tf.uint16), tf.bfloat16)
    lo = tf.cast(tf.bitwise.bitwise_and(bits, _LOW_MASK), tf.uint16)
    return hi, lo


def join(hi: tf.Tensor, lo: tf.Tensor) -> tf.Tensor:
    """(bfloat16 top half, uint16 low half) -> the float32 they split from."""
    lo = tf.cast(lo, tf.uint32)
    carried = tf.cast(lo >= _HALF, tf.uint32)  # split rounded the top half up exactly then
    top = tf.bitwise.left_shift(tf.cast(tf.bitcast(hi, tf.uint16), tf.uint32) - carried, 16)
    return tf.bitcast(tf.bitwise.bitwise_or(top, lo), tf.float32)


def top_half_for(x: tf.Tensor, lo: tf.Tensor) -> tf.Tensor:
    """The bfloat16 top half that joins `lo` into the float32 nearest `x` whose low half is `lo`.

    `top_half_for(x, split(x)[1]) == split(x)[0]`; for `x` a few ulps from the value `lo` was split
    from (the same arithmetic compiled twice may fuse a multiply-add differently), the pair still
    joins exactly to that value (within 2^15 float32 ulps).
    """
    bits = tf.bitcast(tf.convert_to_tensor(x, tf.float32), tf.uint32)
    offset = tf.bitwise.bitwise_and(tf.cast(lo, tf.uint32) - bits, _LOW_MASK)  # (lo - bits) mod 2^16
    wrap = tf.where(offset >= _HALF, tf.constant(0x10000, tf.uint32), tf.constant(0, tf.uint32))
    nearest = bits + offset - wrap  # modulo 2^32, as `join` reads it
    return tf.bitcast(tf.cast(tf.bitwise.right_shift(nearest + _HALF, 16), tf.uint16), tf.bfloat16)


def kahan_split(x: tf.Tensor, dtype: tf.DType) -> tuple[tf.Tensor, tf.Tensor]:
    """float32 `x` -> (`x` rounded to `dtype`, the remainder rounded to `dtype`)."""
    x = tf.convert_to_tensor(x, tf.float32)
    hi = tf.cast(x, dtype)
    return hi, tf.cast(x - tf.cast(hi, tf.float32), dtype)


def kahan_join(hi: tf.Tensor, lo: tf.Tensor) -> tf.Tensor:
    return tf.cast(hi, tf.float32) + tf.cast(lo, tf.float32)


def _mix(x: tf.Tensor) -> tf.Tensor:
    """A bijective 32-bit integer hash (Wellons's lowbias32: every input bit changes half the output bits)."""
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16)) * tf.constant(0x7FEB352D, tf.uint32)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 15)) * tf.constant(0x846CA68B, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, 16))


def dither(shape, seed: tf.Tensor) -> tf.Tensor:
    """Uniform 16-bit integers (uint32 in [0, 2^16)) of `shape`, a pure function of `seed` and position.

    `seed`: int32 tensor of shape [2]. Element `i` (row-major) gets the top half of
    `mix(i * golden + mix(seed[0] * golden + mix(seed[1])))`: another seed or position, an
    unrelated draw.
    """
    seed = tf.bitcast(tf.convert_to_tensor(seed, tf.int32), tf.uint32)
    golden = tf.constant(0x9E3779B9, tf.uint32)
    key = _mix(seed[0] * golden + _mix(seed[1]))
    index = tf.bitcast(tf.range(tf.reduce_prod(shape), dtype=tf.int32), tf.uint32)
    return tf.reshape(tf.bitwise.right_shift(_mix(index * golden + key), 16), shape)


def stochastic_round(x: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """float32 `x` -> bfloat16, rounded up with probability (distance to the lower value) / ulp.

    `seed`: int32 tensor of shape [2] (`dither`'s). Non-finite values stay as they are.
    """
    x = tf.convert_to_tensor(x, tf.float32)
    bits = tf.bitcast(x, tf.uint32)
    dithered = tf.bitwise.bitwise_and(bits + dither(tf.shape(x), seed), tf.constant(0xFFFF0000, tf.uint32))
    rounded = tf.bitcast(tf.cast(tf.bitwise.right_shift(dithered, 16), tf.uint16), tf.bfloat16)
    return tf.where(tf.math.is_finite(x), rounded, tf.cast(x, tf.bfloat16))


def bfloat16_to_float32(x: tf.Tensor) -> tf.Tensor:
    """bfloat16 -> float32 exactly, with integer ops only (XLA's CPU convert of bfloat16 is slow)."""
    return tf.bitcast(tf.bitwise.left_shift(tf.cast(tf.bitcast(x, tf.uint16), tf.uint32), 16), tf.float32)


def round_to_bfloat16(x: tf.Tensor) -> tf.Tensor:
    """float32 -> bfloat16, round to nearest even (as `tf.cast`), with integer ops only. NaN stays NaN."""
    bits = tf.bitcast(tf.convert_to_tensor(x, tf.float32), tf.uint32)
    odd = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 16), 1)
    rounded = tf.bitwise.right_shift(bits + 0x7FFF + odd, 16)
    nan = tf.math.is_nan(x)
    top = tf.where(nan, tf.bitwise.bitwise_or(tf.bitwise.right_shift(bits, 16), 0x40), rounded)
    return tf.bitcast(tf.cast(top, tf.uint16), tf.bfloat16)


def same_bits(a: tf.Tensor, b: tf.Tensor) -> bool:
    """Whether two 16- or 32-bit float tensors of one dtype hold the same bits (NaNs included); eager."""
    a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
    if a.dtype != b.dtype:
        return False
    word = tf.uint32 if a.dtype.size == 4 else tf.uint16
    return bool(tf.reduce_all(tf.equal(tf.bitcast(a, word), tf.bitcast(b, word))))
