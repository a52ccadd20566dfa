"""keras_amp.op_rules.einsum_rows: an activation times a weight as one 2-D matmul of its rows."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp import op_rules
from keras_amp.op_rules import einsum_rows
from tests.helpers import as_matmul_result, live_ops, matmul_roundoff

pytestmark = pytest.mark.usefixtures("no_op_rules")

# The equations Keras's TF einsum writes as a matmul by a 2-D (reshaped, maybe transposed) weight,
# with an input and a weight shape each.
WEIGHT_EQUATIONS = {
    "abc,cde->abde": ((8, 64, 96), (96, 4, 24)),
    "abc,dce->abde": ((8, 64, 96), (4, 96, 24)),
    "abc,dec->abde": ((8, 64, 96), (4, 24, 96)),
    "abcd,cde->abe": ((8, 64, 4, 24), (4, 24, 96)),
    "abcd,ced->abe": ((8, 64, 4, 24), (4, 96, 24)),
    "abcd,ecd->abe": ((8, 64, 4, 24), (96, 4, 24)),
    "abc,cd->abd": ((8, 64, 96), (96, 80)),
    "abc,dc->abd": ((8, 64, 96), (80, 96)),
}


def _as64(t):
    return np.asarray(tf.cast(t, tf.float64))


def _live_types(graph) -> list[str]:
    return sorted(op.type for op in live_ops(graph))


def _einsum_and_weight_gradient(equation, x, w, upstream, graph):
    """The einsum of `x` by the weight `w` (a variable) and its gradient for `w`; with `graph`, the
    live op types of its traced function too."""
    def f(x):
        with tf.GradientTape() as tape:
            y = keras.ops.einsum(equation, x, w)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
        return y, tape.gradient(loss, w)

    if not graph:
        return [_as64(t) for t in f(x)], set()
    fn = tf.function(f)
    types = set(_live_types(fn.get_concrete_function(x).graph))
    return [_as64(t) for t in fn(x)], types


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("equation", WEIGHT_EQUATIONS)
def test_weight_einsum_is_one_matmul_of_rows_its_kernel_gradient_rounded_once(equation, dtype):
    x_shape, w_shape = WEIGHT_EQUATIONS[equation]
    rng = np.random.default_rng(0)
    x = tf.cast(rng.standard_normal(x_shape), dtype)
    w = tf.Variable(tf.cast(rng.standard_normal(w_shape), dtype))
    out = equation.split("->")[1]
    out_shape = [dict(zip("".join(equation.split("->")[0].split(",")), x_shape + w_shape))[c] for c in out]
    upstream = tf.constant(rng.standard_normal(out_shape), tf.float32)
    (stock_y, stock_dw), stock_types = _einsum_and_weight_gradient(equation, x, w, upstream, graph=True)
    op_rules.install(dtype)
    (y, dw), types = _einsum_and_weight_gradient(equation, x, w, upstream, graph=True)
    assert "BatchMatMulV2" in stock_types and "BatchMatMulV2" not in types, (stock_types, types)
    lhs, kernel = equation.split("->")[0].split(",")
    eps = matmul_roundoff(dtype)  # one rounding by the matmul kernel (a whole ulp where it truncates)
    # The result: float32-accumulated dot products, rounded once, as stock's.
    ref = np.einsum(equation, _as64(x), _as64(w))
    terms = np.prod([x_shape[lhs.index(c)] for c in set(lhs) & set(kernel)])
    bound = eps * np.abs(ref) + terms * 2.0**-24 * np.einsum(equation, np.abs(_as64(x)), np.abs(_as64(w)))
    assert np.all(np.abs(y - ref) <= bound), np.max(np.abs(y - ref) / bound)
    # The kernel's gradient: one product over every row, float32 accumulation, one rounding.
    dy = _as64(tf.cast(upstream, dtype))
    dw_ref = np.einsum(f"{lhs},{out}->{kernel}", _as64(x), dy)
    rows = np.prod(x_shape) // terms
    dw_bound = eps * np.abs(dw_ref) + rows * 2.0**-24 * np.einsum(
        f"{lhs},{out}->{kernel}", np.abs(_as64(x)), np.abs(dy))
    assert np.all(np.abs(dw - dw_ref) <= dw_bound), np.max(np.abs(dw - dw_ref) / dw_bound)
    once = as_matmul_result(dw_ref, dtype)
    assert np.mean(dw == once) > 0.99, np.mean(dw == once)
    assert np.mean(stock_dw == once) < 0.9, np.mean(stock_dw == once)  # guard: stock rounds each example's part


def test_eager_other_einsums_and_float32_are_kerass():
    op_rules.install("bfloat16")
    rng = np.random.default_rng(1)
    x = tf.cast(rng.standard_normal((2, 5, 8)), tf.bfloat16)
    w = tf.Variable(tf.cast(rng.standard_normal((8, 2, 4)), tf.bfloat16))
    (y, _), _ = _einsum_and_weight_gradient("abc,cde->abde", x, w, tf.ones([2, 5, 2, 4]), graph=False)
    op_rules.uninstall()
    (stock, _), _ = _einsum_and_weight_gradient("abc,cde->abde", x, w, tf.ones([2, 5, 2, 4]), graph=False)
    np.testing.assert_array_equal(y, stock)  # eager: Keras's batched matmul itself
    op_rules.install("bfloat16")

    def types(equation, *operands):
        fn = tf.function(lambda *t: keras.ops.einsum(equation, *t))
        return set(_live_types(fn.get_concrete_function(*operands).graph))

    q = tf.ones([2, 5, 3, 4], tf.bfloat16)  # QK^T: two activations, left to the scores rule
    assert "BatchMatMulV2" in types("abcd,aecd->acbe", q, q)
    # An activation by a 2-D activation (DeBERTa's relative-position score terms): the scores rule's too.
    assert "BatchMatMulV2" in types("abc,dc->abd", x, tf.ones([7, 8], tf.bfloat16))
    assert "BatchMatMulV2" in types("abc,cde->abde", tf.cast(x, tf.float32), tf.Variable(tf.cast(w, tf.float32)))


def test_a_result_read_twice_is_computed_once():
    # The rebuild happens inside `einsum`, before anything reads the result: every reader gets it.
    op_rules.install("bfloat16")
    x, w = tf.ones([2, 5, 16], tf.bfloat16), tf.Variable(tf.ones([16, 4, 8], tf.bfloat16))

    @tf.function
    def f(x):
        y = keras.ops.einsum("abc,cde->abde", x, w)
        return y + 1, y * 2

    assert [t for t in _live_types(f.get_concrete_function(x).graph) if "MatMul" in t] == ["MatMul"]


def test_weight_matmul_refuses_what_it_cannot_rebuild():
    b = tf.Variable(tf.ones([4, 5], tf.bfloat16))
    b_t = tf.Variable(tf.ones([5, 4], tf.bfloat16))
    b32 = tf.Variable(tf.ones([4, 5]))

    @tf.function
    def check():
        a = tf.ones([2, 3, 4], tf.bfloat16)
        assert einsum_rows.weight_matmul(tf.matmul(a, b)) is not None
        assert einsum_rows.weight_matmul(tf.matmul(a, b_t, transpose_b=True))[2]
        assert einsum_rows.weight_matmul(tf.matmul(a, tf.ones([4, 5], tf.bfloat16))) is None  # an activation
        assert einsum_rows.weight_matmul(tf.matmul(a, tf.ones([2, 4, 5], tf.bfloat16))) is None  # a 3-D b
        assert einsum_rows.weight_matmul(tf.matmul(tf.ones([2, 4, 3], tf.bfloat16), b, adjoint_a=True)) is None
        assert einsum_rows.weight_matmul(tf.matmul(tf.ones([2, 3, 4]), b32)) is None  # float32
        return tf.constant(0)

    check()
