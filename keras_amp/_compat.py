"""The one boundary to Keras's and TensorFlow's private surface: imports, originals, pins, verdict.

keras_amp replaces or relies on Keras 3.15.1 / TensorFlow 2.21 internals where there is no public
hook (the op rules, the loss-scale optimizer's branches, the multi-worker fit fix, the float32
islands, the model walk). Every such object is one `Pin` in `PINS`: where it is defined, the
sha256 digest of its source (first 16 hex digits, `digest()`), and the keras_amp features that
stand on it. Nothing else in keras_amp imports `keras.src` or `tensorflow.python`: it asks
`original(name)` / `get(name)` here.

At import this module resolves every pin (before anything is replaced: `ORIGINALS` keeps the
objects as Keras defines them) and reaches one verdict per feature (`VERDICT`): on the Keras and
TensorFlow it was written for, every feature is on; where a pinned object is missing or its
source changed, or the version is another minor release, the features standing on it are off,
each with its reasons. keras_amp still imports. An off feature warns once, naming itself and the
cause (`warn_off`), and does not run: the op rules skip the affected rules, and a feature used
while off raises `FeatureOff` naming what changed, so no override is bypassed in silence.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import threading
import warnings
from typing import Any, Iterable

import keras
import tensorflow as tf
from tensorflow.core.framework import op_def_pb2
from tensorflow.python.framework import op_def_registry

from keras_amp.policy import AmpWarning

TESTED_KERAS = "3.15."
# A pin named OP_DEF + an op type is that op's registered OpDef (digest: of its serialised proto).
OP_DEF = "tensorflow op "
TESTED_TENSORFLOW = "2.21."

# Features: the keras_amp parts that stand on private objects, and what a user loses when one is off.
LSO = "keras_amp.LossScaleOptimizer (floor, ceiling, counters, replica-consistent skips)"
FIT_FIX = "the multi-worker fit fix (keras_amp.distribute)"
OP_RULES = "op rules (float32 softmax, normalisation, losses)"
OP_ATTENTION = "op rules (float32 attention scores)"
OP_MATMUL = "op rules (16-bit matmuls in Matmul16DTypePolicy layers)"
OP_LEAN = "op rules (16-bit tensors kept for the backward pass)"
OP_DROPOUT = "op rules (16-bit dropout masks from half the random words)"
OP_GELU_FUSION = "op rules (a bfloat16 gelu fused into its matmul for inference)"
OP_LAYER_NORM_FUSION = "op rules (layer normalisation's forward pass as oneDNN's fused kernel)"
OP_CONV = "op rules (16-bit convolutions' gradients from float32 kernels on CPUs without 16-bit ones)"
ATTENTION_LAYER = "keras_amp.layers.MultiHeadAttention"
RECURRENT_LAYERS = "keras_amp.layers.LSTM / GRU"
FLOAT32_LAYERS = "keras_amp float32-island layers"
ATTRIBUTION = "op-to-layer attribution (audit_model, find_overflow)"
AUDIT = "audit_model's view into compiled calls"
CALLBACKS = "keras_amp callbacks' per-batch logs"
RECIPES = "apply_recipe"
AUTO_PRECISION = "automatic precision (Float32Fallback, ProgressivePrecision)"
MODEL_GRAPH = "the model walk (functional graphs, layer lists)"
MEMORY = "16-bit storage (frozen weights in their compute dtype, keras_amp.optimizers.LeanAdam)"
GRADIENTS = ("keras_amp's graph-mode custom gradients freed with their graph (off: tf.custom_gradient, "
             "which keeps every traced graph that used one)")


@dataclasses.dataclass(frozen=True)
class Pin:
    """One private object keras_amp replaces or relies on.

    Args:
        name: String. Where it is defined: "<module>.<qualname>" ("keras.src.backend.tensorflow.nn.softmax").
        digest: String or None. `digest()` of its source in the tested versions; None when only its
            presence is relied on.
        features: Tuple of strings. The features (constants above) that stand on it.
    """

    name: str
    digest: str | None
    features: tuple[str, ...]


PINS: tuple[Pin, ...] = (
    Pin("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.__init__", "1a88b249924ffaf5", (LSO,)),
    Pin("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.build", "93180a11e6397255", (LSO,)),
    Pin("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.apply", "1cc61fb4c21edb7a", (LSO,)),
    Pin("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer._tf_apply", "e702c4db1a0622e3", (LSO,)),
    Pin("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer._common_apply", "4bb166c7e69089d7", (LSO,)),
    Pin("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer._stateful_handle_finite_grads", "6e4577e03d1ef28d", (LSO,)),
    Pin("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer._stateful_handle_non_finite_grads", "62cf46621318f165", (LSO,)),
    Pin("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.stateless_apply", "848e03d5e2276572", (LSO,)),
    Pin("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.scale_loss", "2c14009a46386fdd", (LSO,)),
    Pin("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.check_finite", "b0ce693a4ff0133b", (LSO,)),
    Pin("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.get_config", "25a7f3660ecf49f7", (LSO,)),
    Pin("keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.from_config", "3f6c367ccaafff32", (LSO,)),
    Pin("keras.src.optimizers.base_optimizer.BaseOptimizer.load_own_variables", "a6e0c5e7e88c4d33", (LSO,)),
    Pin("keras.src.optimizers.base_optimizer.BaseOptimizer.save_own_variables", "5c789905e2679bf5", (LSO,)),
    Pin("keras.src.optimizers.base_optimizer.BaseOptimizer.build", "e9d310fddad51ed1", (LSO, MEMORY,)),
    Pin("keras.src.optimizers.base_optimizer.BaseOptimizer._overwrite_variable_with_gradient", "f6fba7ddf9a6a95e", (LSO,)),
    Pin("keras.src.utils.tracking.no_automatic_dependency_tracking", "b69f1af066ac13e0", (LSO,)),
    Pin("tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext", "144a23c08793ec3d", (LSO, OP_LAYER_NORM_FUSION, OP_CONV)),
    Pin("tensorflow.python.distribute.merge_call_interim.strategy_supports_no_merge_call", "2eac4f168b29d6a3", (LSO,)),
    Pin("keras.src.backend.tensorflow.trainer.TensorFlowTrainer._maybe_symbolic_build", "92a504f5eba9b29f", (FIT_FIX,)),
    Pin("keras.src.backend.tensorflow.trainer.reduce_per_replica", "2e7d54b1e6edc29a", (FIT_FIX,)),
    Pin("keras.src.backend.tensorflow.trainer._collective_all_reduce_multi_worker", "0302369d850e6694", (FIT_FIX,)),
    Pin("keras.src.backend.tensorflow.nn.softmax", "db2c578ff3a26c2e", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.nn.log_softmax", "7877ebb97ae1ce8f", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.math.logsumexp", "715367831b0891ce", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.numpy.exp", "4fa4caca033c9a58", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.nn.batch_normalization", "1cc80ed9bad6ea79", (OP_RULES, OP_LEAN,)),
    Pin("keras.src.backend.tensorflow.nn.moments", "57bcc01c34d85f72", (OP_LEAN,)),
    Pin("keras.src.ops.nn._layer_normalization", "67b9792af8800337", (OP_LEAN,)),
    Pin("keras.src.ops.nn._normalize", "6d45ce2adc62638f", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.numpy.std", "06356e76fd7e60f7", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.linalg.norm", "d17a0da5a6a64810", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.numpy.arange", "9c656b29403a9806", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.nn.gelu", "edb8d0940a01c8d5", (OP_LEAN,)),
    Pin("keras.src.backend.tensorflow.nn.silu", "5c8ba702568877a6", (OP_LEAN,)),
    Pin("keras.src.backend.tensorflow.nn.conv", "1bae7c0469d44106", (OP_CONV,)),
    Pin("keras.src.backend.tensorflow.nn.depthwise_conv", "492c94d51f85389f", (OP_CONV,)),
    Pin("keras.src.backend.tensorflow.nn.separable_conv", "d163319653f9a846", (OP_CONV,)),
    Pin("keras.src.backend.tensorflow.nn.conv_transpose", "8b0f43bf39e13a57", (OP_CONV,)),
    # The silu rule repeats this function's arithmetic op for op.
    Pin("tensorflow.python.ops.nn_impl.swish", "cee3bd2cc8d60dde", (OP_LEAN,)),
    Pin("keras.src.backend.tensorflow.random.dropout", "47a159de0b6729e2", (OP_DROPOUT,)),
    Pin("keras.src.backend.tensorflow.random._cast_seed", "7a39858b011b145d", (OP_DROPOUT,)),
    Pin("keras.src.backend.tensorflow.random._get_concrete_noise_shape", "9a5a926ba4daa72a", (OP_DROPOUT,)),
    Pin("keras.src.random.seed_generator.draw_seed", "fa9c160c92e8fb0e", (OP_DROPOUT,)),
    Pin("keras.src.backend.tensorflow.nn.categorical_crossentropy", "a2cb8f1dacc6a411", (OP_RULES,)),
    Pin("keras.src.ops.nn.CategoricalCrossentropy.compute_output_spec", "c729e7e6cb6f7d01", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.nn.sparse_categorical_crossentropy", "8dd1e34615666cea", (OP_RULES, OP_LEAN,)),
    Pin("keras.src.ops.nn.SparseCategoricalCrossentropy.compute_output_spec", "1d2704fea7e2f6f6", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.nn.binary_crossentropy", "3fb0e94214714db1", (OP_RULES,)),
    Pin("keras.src.ops.nn.BinaryCrossentropy.compute_output_spec", "4dd48a4bb5ef1272", (OP_RULES,)),
    Pin("keras.src.layers.attention.multi_head_attention.MultiHeadAttention._compute_attention", "88168a1a82dd0d31", (OP_ATTENTION, ATTENTION_LAYER,)),
    Pin("keras.src.layers.attention.multi_head_attention.MultiHeadAttention.call", "fd666cb2fe09b101", (OP_ATTENTION, ATTENTION_LAYER,)),
    Pin("keras.src.layers.attention.multi_head_attention.MultiHeadAttention.__init__", "e35ec682b0a40265", (ATTENTION_LAYER,)),
    Pin("keras.src.layers.attention.multi_head_attention.MultiHeadAttention._build_attention", "26399b12f2810501", (ATTENTION_LAYER,)),
    Pin("keras.src.layers.attention.multi_head_attention.MultiHeadAttention._masked_softmax", "f2b05c4b4388a750", (ATTENTION_LAYER,)),
    Pin("keras.src.layers.attention.multi_head_attention.MultiHeadAttention._compute_causal_mask", "69d9aaf9eb2651f4", (ATTENTION_LAYER,)),
    Pin("keras.src.backend.tensorflow.numpy.sqrt", "642f2ad26ab43d29", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.math.rsqrt", "f901ca8dbba55e12", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.nn._dot_product_attention_xla", "dee56832e55953fc", (OP_ATTENTION,)),
    Pin("keras.src.backend.tensorflow.nn._apply_masks", "002efd810c138eeb", (OP_ATTENTION,)),
    Pin("keras.src.backend.tensorflow.numpy.matmul", "9f471e0ba26e3c20", (OP_MATMUL,)),
    Pin("keras.src.backend.tensorflow.numpy.add", "1653b2b6aa63cb40", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.numpy.einsum", "9eb60d0ed811e577", (OP_RULES,)),
    Pin("keras.src.backend.tensorflow.core.cast", "844aea66b0364ca4", (OP_RULES,)),
    Pin("keras.src.layers.layer.Layer.__call__", "4fb7e42e4ffd9b1a", (OP_ATTENTION, OP_MATMUL, FLOAT32_LAYERS, ATTRIBUTION,)),
    Pin("keras.src.layers.layer.Layer._open_name_scope", "9197bac9543ef95a", (OP_ATTENTION, OP_MATMUL,)),
    Pin("keras.src.backend.tensorflow.core.name_scope", "bff9a1de6e491b0d", (OP_ATTENTION, OP_MATMUL,)),
    Pin("keras.src.backend.common.name_scope.name_scope", "957dcd2ff7532ae8", (OP_ATTENTION, OP_MATMUL,)),
    Pin("keras.src.backend.common.variables.AutocastScope", "41c96933fcde87d4", (FLOAT32_LAYERS,)),
    Pin("keras.src.backend.common.variables.Variable._maybe_autocast", "1b42c967de4732d6", (FLOAT32_LAYERS,)),
    Pin("keras.src.layers.rnn.rnn.RNN.call", "e580bb43258da9c3", (RECURRENT_LAYERS, RECIPES,)),
    Pin("keras.src.layers.rnn.rnn.RNN.inner_loop", "95624f67dd86cc32", (RECURRENT_LAYERS,)),
    Pin("keras.src.layers.rnn.lstm.LSTM.__init__", "74003dee042b8d6a", (RECURRENT_LAYERS,)),
    Pin("keras.src.layers.rnn.lstm.LSTM.inner_loop", "8dc385b0e14a252e", (RECURRENT_LAYERS,)),
    Pin("keras.src.layers.rnn.gru.GRU.__init__", "ad6759233509ce98", (RECURRENT_LAYERS,)),
    Pin("keras.src.layers.rnn.gru.GRU.inner_loop", "c60ea87cae404e16", (RECURRENT_LAYERS,)),
    Pin("keras.src.layers.rnn.lstm.LSTMCell.call", "c71d0352f74b106d", (RECURRENT_LAYERS,)),
    Pin("keras.src.layers.rnn.gru.GRUCell.call", "1019f8bce4307f38", (RECURRENT_LAYERS,)),
    Pin("keras.src.ops.operation.Operation.from_config", "0ad099055bf699d4", (RECIPES, OP_MATMUL,)),
    Pin("keras.src.layers.rnn.rnn.RNN.from_config", "0ed0c76ff5f15a35", (RECIPES, OP_MATMUL,)),
    Pin("keras.src.backend.tensorflow.rnn.rnn", "e5253cfb13d19752", (FLOAT32_LAYERS,)),
    Pin("tensorflow.python.ops.control_flow_v2_func_graphs.WhileBodyFuncGraph", "38630be4ecd558b9", (FLOAT32_LAYERS,)),
    Pin("tensorflow.python.ops.control_flow_v2_func_graphs.CondBranchFuncGraph", "fb01625dc3036def", (FLOAT32_LAYERS,)),
    Pin("keras.src.ops.operation.Operation.__call__", "54fc9fcb8839877d", (ATTRIBUTION,)),
    Pin("tensorflow.python.eager.backprop._gradient_function", "06a5cb31f1157eda", (ATTRIBUTION,)),
    Pin("tensorflow.python.ops.gradients_util._GradientsHelper", "1cf76bca60075bda", (ATTRIBUTION,)),
    Pin("tensorflow.python.framework.ops.Graph._get_function", "e2c2d3363e3e49a5", (AUDIT,)),
    Pin("keras.src.callbacks.callback_list.CallbackList._configure_async_dispatch", "be3563e8da2546cd", (CALLBACKS,)),
    Pin("keras.src.callbacks.callback_list.CallbackList._on_train_batch_end", "def5a3d70b8b5f20", (CALLBACKS,)),
    Pin("keras.src.layers.preprocessing.normalization.Normalization.build", "a3b7f63133bc9cfc", (RECIPES,)),
    Pin("keras.src.layers.preprocessing.normalization.Normalization.finalize_state", "80b9994fb9171aea", (RECIPES,)),
    Pin("keras.src.layers.layer.Layer._flatten_layers", "662dcf281bc32c53", (MODEL_GRAPH,)),
    Pin("keras.src.models.functional.Functional.__init__", "1c7c6c21886b2ac5", (RECIPES,)),
    Pin("keras.src.backend.tensorflow.trainer.TensorFlowTrainer.make_train_function", "a9703da4a49beb28", (RECIPES, AUTO_PRECISION, MEMORY,)),
    Pin("keras.src.backend.tensorflow.trainer.TensorFlowTrainer.make_test_function", "ad5e9155b9298ef1", (RECIPES, MEMORY,)),
    Pin("keras.src.backend.tensorflow.trainer.TensorFlowTrainer.make_predict_function", "a772a2efdd906f9a", (RECIPES, MEMORY,)),
    Pin("keras.src.backend.tensorflow.trainer.TensorFlowTrainer.fit", "a9a6dc02a7ddafa8", (AUTO_PRECISION,)),
    Pin("tensorflow.python.eager.record.record_operation", "6717cb36031a93d2", (GRADIENTS,)),
    Pin("tensorflow.python.eager.record.could_possibly_record", "c69b28411f4c773c", (OP_GELU_FUSION,)),
    # A TensorFlow op with no Python function, created by name: pinned by its registered op def.
    Pin(f"{OP_DEF}_MklLayerNorm", "d15a4d5e8a6d26b7", (OP_LAYER_NORM_FUSION,)),
    Pin("tensorflow.python.saved_model.save_context.in_save_context", "243c3df0ecb435b0", (OP_LAYER_NORM_FUSION,)),
    # The precision decisions ride in Keras's checkpoints: a saveable attribute the saving walk visits.
    Pin("keras.src.saving.keras_saveable.KerasSaveable", "873b7d4c0312252b", (AUTO_PRECISION,)),
    Pin("keras.src.saving.saving_lib._save_state", "472e9cc9267e3c4b", (AUTO_PRECISION,)),
    Pin("keras.src.saving.saving_lib._load_state", "6dcef2082c1d2c75", (AUTO_PRECISION,)),
    # Keras's layer call stack (calling_layers: float32 islands, the matmul rule).
    Pin("keras.src.backend.common.global_state.get_global_attribute", "d39da35cc653dfaa",
        (FLOAT32_LAYERS, OP_MATMUL)),
    # The model walk: a functional model's layer graph lives in Function's private attributes.
    Pin("keras.src.ops.function.Function.__init__", "ce10a47709268ad7", (MODEL_GRAPH,)),
    Pin("keras.src.models.functional.Functional", None, (MODEL_GRAPH,)),
    # 16-bit storage: a Keras variable's value is a tf.Variable in `_value` (swapped for one of
    # another dtype); a layer's creation-time trainable list tells frozen weights from statistics.
    Pin("keras.src.backend.tensorflow.core.Variable._initialize", "ab759c22f87fb300", (MEMORY,)),
    Pin("keras.src.layers.layer.Layer._initialize_tracker", "d3c5eb26d32b8868", (MEMORY,)),
    Pin("keras.src.trainers.trainer.Trainer._symbolic_build", "96220cc3b88fe768", (MEMORY,)),
    # LeanAdam computes Adam's update itself (and the decoupled weight decay) for 16-bit variables.
    Pin("keras.src.optimizers.adam.Adam.update_step", "05a229bf362b7227", (MEMORY,)),
    Pin("keras.src.backend.tensorflow.optimizer.TFOptimizer._apply_weight_decay", "fee6526b6ad02f94", (MEMORY,)),
    # Its slots are found by `_var_key` (the tf.Variable's id): a weight whose storage changes is re-keyed.
    Pin("keras.src.backend.tensorflow.optimizer.TFOptimizer._var_key", "726df115036636bc", (MEMORY,)),
)


class FeatureOff(RuntimeError):
    """A keras_amp feature was used on a Keras/TensorFlow whose private surface it does not match."""


def digest(obj: Any) -> str:
    """sha256 of `inspect.getsource(obj)` (a function, method or class), or of an OpDef's
    deterministic serialisation, first 16 hex digits."""
    if isinstance(obj, op_def_pb2.OpDef):
        return hashlib.sha256(obj.SerializeToString(deterministic=True)).hexdigest()[:16]
    obj = getattr(obj, "__func__", obj)  # classmethod / staticmethod
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def lookup(name: str) -> Any:
    """The object `name` points to (the longest importable module, then attributes); a class
    attribute comes from the class's own `__dict__` when it has one (so restoring it restores
    identity); `OP_DEF` + an op type is that op's registered OpDef. Raises LookupError when it is
    not there."""
    if name.startswith(OP_DEF):
        found = op_def_registry.get(name[len(OP_DEF):])
        if found is None:
            raise LookupError(f"{name}: not registered in this TensorFlow")
        return found
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if isinstance(obj, type) and attr in obj.__dict__:
                obj = obj.__dict__[attr]
            elif hasattr(obj, attr):
                obj = getattr(obj, attr)
            else:
                raise LookupError(f"{name}: no attribute {attr!r}")
        return obj
    raise LookupError(f"{name}: no importable module")


def resolve(pins: Iterable[Pin]) -> dict[str, Any]:
    """name -> object for every pin that can be found (missing ones are left out)."""
    found = {}
    for pin in pins:
        try:
            found[pin.name] = lookup(pin.name)
        except (LookupError, ImportError, AttributeError):
            pass
    return found


def evaluate(pins: Iterable[Pin], objects: dict[str, Any], keras_version: str,
             tf_version: str) -> dict[str, tuple[str, ...]]:
    """feature -> the reasons it is off (empty when on), for `pins` resolved to `objects`."""
    pins = tuple(pins)
    version = _version_reasons(keras_version, tf_version)
    reasons: dict[str, list[str]] = {f: list(version) for p in pins for f in p.features}
    for pin in pins:
        problem = pin_problem(pin, objects)
        if problem:
            for feature in pin.features:
                reasons[feature].append(problem)
    return {f: tuple(r) for f, r in reasons.items()}


def _version_reasons(keras_version: str, tf_version: str) -> list[str]:
    """Why these versions are not the tested ones (empty when they are)."""
    reasons = []
    if not keras_version.startswith(TESTED_KERAS):
        reasons.append(f"Keras {keras_version} is installed; keras_amp was written for {TESTED_KERAS}x")
    if not tf_version.startswith(TESTED_TENSORFLOW):
        reasons.append(f"TensorFlow {tf_version} is installed; keras_amp was written for {TESTED_TENSORFLOW}x")
    return reasons


def pin_problem(pin: Pin, objects: dict[str, Any]) -> str | None:
    """Why `pin` does not hold for `objects` ("missing", "changed"), or None."""
    if pin.name not in objects:
        return f"{pin.name} is missing"
    if pin.digest is None:
        return None
    try:
        found = digest(objects[pin.name])
    except (OSError, TypeError):
        return f"{pin.name} has no readable source"
    return None if found == pin.digest else f"{pin.name} changed (source digest {found}, pinned {pin.digest})"


PIN_BY_NAME = {pin.name: pin for pin in PINS}
ORIGINALS: dict[str, Any] = resolve(PINS)
VERDICT: dict[str, tuple[str, ...]] = evaluate(PINS, ORIGINALS, keras.__version__, tf.__version__)
_warned: set[str] = set()
_lock = threading.Lock()


def original(name: str) -> Any:
    """The pinned object `name` as Keras/TensorFlow defined it at import, or None when missing."""
    if name not in PIN_BY_NAME:
        raise KeyError(f"`name` must be a pinned object (keras_amp._compat.PINS). Received: name={name!r}")
    return ORIGINALS.get(name)


def problems(names: Iterable[str]) -> list[str]:
    """Why the pinned objects `names` do not hold (version, missing, changed); empty when they do."""
    out = _version_reasons(keras.__version__, tf.__version__)
    for name in names:
        problem = pin_problem(PIN_BY_NAME[name], ORIGINALS)
        if problem:
            out.append(problem)
    return out


def is_on(feature: str) -> bool:
    """Whether `feature` (a constant above) matches this Keras/TensorFlow."""
    if feature not in VERDICT:
        raise KeyError(f"`feature` must be one of keras_amp._compat's features. Received: feature={feature!r}")
    return not VERDICT[feature]


def warn_off(feature: str) -> bool:
    """Warns once (AmpWarning) when `feature` is off, naming it and why; returns whether it is on."""
    if is_on(feature):
        return True
    with _lock:
        if feature not in _warned:
            _warned.add(feature)
            warnings.warn(_message(feature), AmpWarning, stacklevel=3)
    return False


def require(feature: str) -> None:
    """Raises `FeatureOff` when `feature` is off (used where running it anyway would be wrong)."""
    if not is_on(feature):
        raise FeatureOff(_message(feature))


def _message(feature: str) -> str:
    return (f"keras_amp: {feature} is off on Keras {keras.__version__} / TensorFlow {tf.__version__}: "
            f"{'; '.join(VERDICT[feature])}. Install the tested versions (keras {TESTED_KERAS}x, "
            f"tensorflow {TESTED_TENSORFLOW}x) or a keras_amp written for these.")


def off_features() -> dict[str, tuple[str, ...]]:
    """The features that are off here, with their reasons."""
    return {f: r for f, r in VERDICT.items() if r}


# The verdict, said once at import: one warning per feature that is off here.
for _feature in off_features():
    warn_off(_feature)
