"""Shared test helpers: policies, unit roundoff, float64 references. Import these; conftest files
hold fixtures only."""

import functools

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_v2_func_graphs

from keras_amp.hardware import DeviceInfo, GpuInfo
from keras_amp.optimizers import LossScaleOptimizer

POLICIES = ["float32", "mixed_float16", "mixed_bfloat16"]
MIXED = ["mixed_float16", "mixed_bfloat16"]

# Unit roundoff (half the spacing at 1) of each compute dtype.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


@functools.cache
def matmul_rounding(dtype) -> str:
    """How this device's TensorFlow kernel turns a 16-bit matmul's float32 sums into `dtype`, measured:
    "nearest" (oneDNN, GPUs, float16) or "truncate" (Eigen's bfloat16 MatMul without oneDNN, the default
    on AVX2-only CPUs: the float32 product with its low 16 bits dropped)."""
    rng = np.random.default_rng(0)
    a, b = (tf.cast(rng.standard_normal(shape), dtype) for shape in ((64, 32), (32, 48)))
    got = tf.raw_ops.MatMul(a=a, b=b)
    total = tf.raw_ops.MatMul(a=tf.cast(a, tf.float32), b=tf.cast(b, tf.float32))
    if np.mean(np64(got) == np64(tf.cast(total, dtype))) > 0.99:
        return "nearest"
    if dtype in ("bfloat16", tf.bfloat16) and np.mean(np64(got) == _truncated_bfloat16(total)) > 0.99:
        return "truncate"
    raise AssertionError(f"this device's {dtype} MatMul neither rounds its float32 sums nor truncates them")


def matmul_roundoff(dtype) -> float:
    """The largest relative error of this device's 16-bit matmul result against its float32 sum: the
    unit roundoff where it rounds to nearest, twice that (a whole ulp) where it truncates."""
    u = UNIT_ROUNDOFF[tf.as_dtype(dtype).name]
    return u if matmul_rounding(dtype) == "nearest" else 2 * u


def as_matmul_result(x, dtype) -> np.ndarray:
    """Float64 values `x` as this device's 16-bit matmul kernel would store them (see matmul_rounding)."""
    if matmul_rounding(dtype) == "nearest":
        return np64(tf.cast(tf.constant(np.asarray(x, np.float64)), dtype))
    return _truncated_bfloat16(np.asarray(x, np.float32))


def _truncated_bfloat16(x) -> np.ndarray:
    bits = np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32).astype(np.float64)


def compute_dtype(policy_name):
    """The compute dtype of a Keras policy name."""
    return keras.dtype_policies.get(policy_name).compute_dtype


def u(policy_name):
    """Unit roundoff of the policy's compute dtype."""
    return UNIT_ROUNDOFF[compute_dtype(policy_name)]


def np64(x):
    """A tensor (any float dtype) as a float64 NumPy array, through float32 (exact for 16-bit floats)."""
    return np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(x, "float32")), np.float64)


def sigmoid(x):
    """Float64 reference."""
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x, axis=-1):
    """Float64 reference, max-shifted."""
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


class MyNorm(keras.layers.Layer):
    """Named like a normalisation, computes none."""

    def call(self, x):
        return x * 2.0


class Scaler(keras.layers.Layer):
    """An innocent name over an RMS normalisation in raw TensorFlow, which no op rule reaches."""

    def call(self, x):
        return x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=-1, keepdims=True) + 1e-6)


def regression_batch(n=64, poison_row=None):
    """(x, y): x uniform in [0.5, 1) of shape (n, 8), y normal (n, 1), seed 0; row `poison_row` of x set to inf."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, (n, 8)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    if poison_row is not None:
        x[poison_row] = np.inf
    return x, y


def two_dense_model():
    """Dense(8) under the global policy, then a float32 Dense(1) head, on 8 inputs."""
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(1, dtype="float32")])


def built_optimizer(opt_cls=LossScaleOptimizer, inner=None, **kwargs):
    """(v, opt): a 4-element float32 variable and `opt_cls` (keras_amp's LossScaleOptimizer by
    default) over `inner` (SGD(0.1) by default), built on it."""
    v = keras.Variable(np.linspace(-1.0, 1.0, 4).astype("float32"))
    opt = opt_cls(inner or keras.optimizers.SGD(0.1), **kwargs)
    opt.build([v])
    return v, opt


def step_runner(opt, v, mode):
    """A function applying one gradient `g * ones` per call, in the given execution mode
    ("eager", "tf_function" or "xla")."""

    def step(g):
        opt.apply([tf.fill([4], g)], [v])

    if mode == "eager":
        return lambda g: step(tf.constant(g, tf.float32))
    fn = tf.function(step, jit_compile=(mode == "xla"))
    return lambda g: fn(tf.constant(g, tf.float32))


# A CPU with a fast bfloat16 path (AVX512-BF16, oneDNN on): "auto" picks mixed_bfloat16 there.
ZEN4 = DeviceInfo(cpu_model="AMD EPYC", cpu_flags=frozenset({"avx512f", "avx512_bf16"}), onednn_enabled=True)


def gpus(*caps):
    """A DeviceInfo with one GPU per compute capability in `caps` (e.g. (7, 0); None: unknown)."""
    return DeviceInfo(gpus=tuple(GpuInfo(f"gpu{i}", cap) for i, cap in enumerate(caps)))


# MultiHeadAttention with identity projections (the layer, numerics and op-rule attention tests):
# heads, key_dim, model dimension, sequence length.
MHA_SHAPE = (2, 4, 8, 5)
_HEADS, _KEY_DIM, _DIM, _T = MHA_SHAPE


def mha_inputs():
    """(q, k, v) of shape (2, T, DIM). Query/key entries of 256 (exact in float16 and bfloat16) so
    the scaled QK^T is 0.5 * (a_t * b_s + 3 * 256**2) ~ 1e5 > 65504; only the first coordinate of
    each head varies (a_t in {+-1, +-2}, b_s small integers), giving O(1) logit differences.
    Every logit is exact in float32."""
    rng = np.random.default_rng(0)
    q = np.full((2, _T, _DIM), 256.0)
    k = np.full((2, _T, _DIM), 256.0)
    for h in range(_HEADS):
        q[:, :, h * _KEY_DIM] = rng.choice([-2.0, -1.0, 1.0, 2.0], size=(2, _T))
        k[:, :, h * _KEY_DIM] = rng.integers(-3, 4, size=(2, _T))
    v = rng.standard_normal((2, _T, _DIM))
    return q.astype("float32"), k.astype("float32"), v.astype("float32")


def identity_mha(cls=keras.layers.MultiHeadAttention, **kwargs):
    """A built `cls` (a MultiHeadAttention) with identity query/key/value/output kernels, zero biases."""
    layer = cls(_HEADS, _KEY_DIM, kernel_initializer="zeros", **kwargs)
    q, k, v = mha_inputs()
    layer.build(q.shape, v.shape, k.shape)
    eye = np.eye(_DIM, dtype="float32")
    for dense in (layer._query_dense, layer._key_dense, layer._value_dense):
        dense.kernel.assign(eye.reshape(_DIM, _HEADS, _KEY_DIM))
    layer._output_dense.kernel.assign(eye.reshape(_HEADS, _KEY_DIM, _DIM))
    return layer


def mha_reference(q, k, v, mask=None):
    """Float64 (output, probabilities, logits) of `identity_mha`; `mask`: (B, T, S) bool or None."""
    split = lambda x: x.reshape(x.shape[0], x.shape[1], _HEADS, _KEY_DIM)  # noqa: E731
    logits = np.einsum("bsnh,btnh->bnts", split(k), split(q)) / np.sqrt(_KEY_DIM)
    if mask is not None:
        logits = np.where(mask[:, None], logits, -np.inf)
    probs = softmax(logits)
    out = np.einsum("bnts,bsnh->btnh", probs, split(v))
    return out.reshape(out.shape[0], _T, _DIM), probs, logits


def mha_projections(layer, q, k, v):
    """The layer's own (B, T, N, H) projections, as `call` feeds `_compute_attention`."""
    return layer._query_dense(q), layer._key_dense(k), layer._value_dense(v)


def causal_mask(batch=2):
    """(batch, T, T) lower-triangular bool mask."""
    return np.broadcast_to(np.tril(np.ones((_T, _T), bool)), (batch, _T, _T))


def compiled_calls(fn, *args):
    """Function-call ops that XLA must compile, in the traced graph of `fn(*args)`."""
    graph = tf.function(fn).get_concrete_function(*args).graph
    return [op for op in graph.get_operations() if "_XlaMustCompile" in op.node_def.attr]


def gradient_function(model, jit_compile=False):
    """A `tf.function` of the gradients of sum(model(x)) (summed in float32) for the trainable variables."""

    @tf.function(jit_compile=jit_compile)
    def gradients(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.cast(model(x), tf.float32))
        return tape.gradient(loss, model.trainable_variables)

    return gradients


def while_bodies(graph):
    """The body graphs of every tf.while_loop (control flow v2) in `graph`, nested ones included."""
    for f in graph._functions.values():
        if isinstance(f.graph, control_flow_v2_func_graphs.WhileBodyFuncGraph):
            yield f.graph
        yield from while_bodies(f.graph)


class BatchLogRecorder(keras.callbacks.Callback):
    """Keeps a copy of the logs of every training batch end, in `batch_logs`."""

    def __init__(self):
        super().__init__()
        self.batch_logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_logs.append(dict(logs))


def count_walks(monkeypatch):
    """A list that gets the model of every read of a layer tree (`model_graph._walk`), from now on."""
    from keras_amp import model_graph

    walked, original = [], model_graph._walk

    def counted(model, *args, **kwargs):
        walked.append(model)
        return original(model, *args, **kwargs)

    monkeypatch.setattr(model_graph, "_walk", counted)
    return walked


class WalkSpy(keras.callbacks.Callback):
    """Listed after the callback under test: how many reads of the model's tree (`count_walks`) each of its hooks made."""

    def __init__(self, walked):
        super().__init__()
        self.walked, self.per_hook = walked, []

    def _take(self, hook):
        self.per_hook.append((hook, len(self.walked)))
        self.walked.clear()

    def on_train_begin(self, logs=None):
        self._take("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self._take(f"epoch_begin {epoch}")

    def on_train_batch_end(self, batch, logs=None):
        self._take(f"batch_end {batch}")

    def on_epoch_end(self, epoch, logs=None):
        self._take(f"epoch_end {epoch}")


def live_ops(graph):
    """The ops a traced function's outputs depend on, through the bodies of the functions it calls: a
    rule's rebuilt op leaves its original in the graph, read by nothing the outputs need (pruned)."""
    seen, stack, found = set(), [t.op for t in graph.outputs], []
    while stack:
        op = stack.pop()
        if (id(op.graph), op.name) in seen:  # a called body's op names repeat the caller's
            continue
        seen.add((id(op.graph), op.name))
        found.append(op)
        stack.extend(t.op for t in op.inputs)
        if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
            stack.extend(t.op for t in graph._get_function(op.get_attr("f").name).graph.outputs)
    return found

