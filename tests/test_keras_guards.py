"""Guards: fail loudly when the Keras/TensorFlow internals keras_amp relies on change.

One table, `GUARDS`: every private (or overridden) Keras/TF object keras_amp depends on, one row
per object, with the digest of its source in the pinned versions (`tests/keras_guard.py::
source_digest`) and every keras_amp module that depends on it. When a row fails: re-read the named
object, port the change into each dependent module, then update the digest here (and, for an op
rule or the multi-worker fit fix, the install-time pin that the consistency tests below name).

Where keras_amp may replace the object at run time (the op rules while `keras_amp.enable()` is on,
the multi-worker fit fix once installed), the row holds the ORIGINAL: `op_rules.ORIGINALS[...]`,
`trainer_fix._ORIGINAL_*`, or the class `__dict__` entry. Behaviour a digest cannot pin (variable
layouts, compile's auto-wrapping) is guarded by the tests below the table and, for the recipes and
the model graph, in tests/test_keras_guards_recipes.py.

Add a row as one tuple: `Guard("<where it is defined>.<qualname>", <the object>, "<digest>",
("<keras_amp module>", ...))`.
"""

import importlib
from typing import Any, NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.common import variables
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.callbacks import callback_list
from keras.src.layers import layer as keras_layer
from keras.src.layers.attention import multi_head_attention
from keras.src.layers.preprocessing import normalization
from keras.src.layers.rnn import gru, lstm, rnn
from keras.src.models import functional
from keras.src.ops import operation

tf_rnn = importlib.import_module("keras.src.backend.tensorflow.rnn")  # `rnn` the module, not the function
from keras.src.optimizers import base_optimizer
from keras.src.optimizers import loss_scale_optimizer as stock_lso
from keras.src.utils import tracking
from tensorflow.python.distribute import merge_call_interim
from tensorflow.python.eager import backprop
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import control_flow_util, control_flow_v2_func_graphs, gradients_util

from keras_amp import op_rules
from keras_amp.distribute import trainer_fix
from tests.keras_guard import source_digest

KERAS_VERSION = "3.15"
TF_VERSION = "2.21"


class Guard(NamedTuple):
    """One pinned dependency: qualified name, the object, its source digest, who depends on it."""

    name: str
    obj: Any
    digest: str
    modules: tuple[str, ...]


_LSO = ("keras_amp.optimizers.loss_scale_optimizer",)
_TRAINER_FIX = ("keras_amp.distribute.trainer_fix",)
_OPS = ("keras_amp.op_rules.float32_ops",)
_OP_ATTENTION = ("keras_amp.op_rules.attention",)
_OP_MATMUL = ("keras_amp.op_rules.matmul",)
_LEAN = ("keras_amp.op_rules.lean",)
_ATTENTION = ("keras_amp.layers.attention",)
_RECURRENT = ("keras_amp.layers.recurrent",)
_FLOAT32 = ("keras_amp.layers.float32",)
_ATTRIBUTION = ("keras_amp.diagnostics.attribution",)
_CALLBACKS = ("keras_amp.callbacks",)
_RECIPES = ("keras_amp.recipes", "keras_amp.recipe_roles")
_AUTO = ("keras_amp.auto_precision.schedule", "keras_amp.auto_precision.fallback")

_STOCK = stock_lso.LossScaleOptimizer
_BASE = base_optimizer.BaseOptimizer
_MHA = multi_head_attention.MultiHeadAttention
_TRAINER = tf_trainer.TensorFlowTrainer
_O = op_rules.ORIGINALS  # what the op rules replace or rely on, as Keras defines it
_K = "keras.src"
_NN = "keras.src.backend.tensorflow.nn"
_MHA_NAME = "keras.src.layers.attention.multi_head_attention.MultiHeadAttention"
_TRAINER_NAME = "keras.src.backend.tensorflow.trainer.TensorFlowTrainer"
_LSO_NAME = "keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer"

GUARDS = [
    # Stock LossScaleOptimizer: overridden (build, apply, _tf_apply, _common_apply,
    # stateless_apply), re-implemented (the two handlers), or relied on as is.
    Guard(f"{_LSO_NAME}.__init__", _STOCK.__init__, "1a88b249924ffaf5", _LSO),
    Guard(f"{_LSO_NAME}.build", _STOCK.build, "93180a11e6397255", _LSO),
    Guard(f"{_LSO_NAME}.apply", _STOCK.apply, "1cc61fb4c21edb7a", _LSO),
    Guard(f"{_LSO_NAME}._tf_apply", _STOCK._tf_apply, "e702c4db1a0622e3", _LSO),
    Guard(f"{_LSO_NAME}._common_apply", _STOCK._common_apply, "4bb166c7e69089d7", _LSO),
    Guard(f"{_LSO_NAME}._stateful_handle_finite_grads", _STOCK._stateful_handle_finite_grads, "6e4577e03d1ef28d", _LSO),
    Guard(f"{_LSO_NAME}._stateful_handle_non_finite_grads", _STOCK._stateful_handle_non_finite_grads,
          "62cf46621318f165", _LSO),
    Guard(f"{_LSO_NAME}.stateless_apply", _STOCK.stateless_apply, "848e03d5e2276572", _LSO),
    Guard(f"{_LSO_NAME}.scale_loss", _STOCK.scale_loss, "2c14009a46386fdd", _LSO),
    Guard(f"{_LSO_NAME}.check_finite", _STOCK.check_finite, "b0ce693a4ff0133b", _LSO),
    Guard(f"{_LSO_NAME}.get_config", _STOCK.get_config, "25a7f3660ecf49f7", _LSO),
    Guard(f"{_LSO_NAME}.from_config", _STOCK.from_config, "3f6c367ccaafff32", _LSO),
    # Base optimizer: load_own_variables is overridden (stock-store mapping); the others are read.
    Guard(f"{_K}.optimizers.base_optimizer.BaseOptimizer.load_own_variables", _BASE.load_own_variables,
          "a6e0c5e7e88c4d33", _LSO),
    Guard(f"{_K}.optimizers.base_optimizer.BaseOptimizer.save_own_variables", _BASE.save_own_variables,
          "5c789905e2679bf5", _LSO),
    Guard(f"{_K}.optimizers.base_optimizer.BaseOptimizer.build", _BASE.build, "e9d310fddad51ed1", _LSO),
    Guard(f"{_K}.optimizers.base_optimizer.BaseOptimizer._overwrite_variable_with_gradient",
          _BASE._overwrite_variable_with_gradient, "f6fba7ddf9a6a95e", _LSO),
    Guard(f"{_K}.utils.tracking.no_automatic_dependency_tracking", tracking.no_automatic_dependency_tracking,
          "b69f1af066ac13e0", _LSO),
    Guard("tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext",
          control_flow_util.GraphOrParentsInXlaContext, "144a23c08793ec3d", _LSO),
    Guard("tensorflow.python.distribute.merge_call_interim.strategy_supports_no_merge_call",
          merge_call_interim.strategy_supports_no_merge_call, "2eac4f168b29d6a3", _LSO),
    # Multi-worker fit fix: the two it replaces (originals), and Keras's multi-worker predicate it reads.
    Guard(f"{_TRAINER_NAME}._maybe_symbolic_build", trainer_fix._ORIGINAL_BUILD, "92a504f5eba9b29f", _TRAINER_FIX),
    Guard(f"{_K}.backend.tensorflow.trainer.reduce_per_replica", trainer_fix._ORIGINAL_REDUCE, "2e7d54b1e6edc29a",
          _TRAINER_FIX),
    Guard(f"{_K}.backend.tensorflow.trainer._collective_all_reduce_multi_worker",
          tf_trainer._collective_all_reduce_multi_worker, "0302369d850e6694", _TRAINER_FIX),
    # Op rules: single ops computed in float32 (originals).
    Guard(f"{_NN}.softmax", _O[f"{_NN}.softmax"], "db2c578ff3a26c2e", _OPS),
    Guard(f"{_NN}.log_softmax", _O[f"{_NN}.log_softmax"], "7877ebb97ae1ce8f", _OPS),
    Guard(f"{_K}.backend.tensorflow.math.logsumexp", _O[f"{_K}.backend.tensorflow.math.logsumexp"],
          "715367831b0891ce", _OPS),
    Guard(f"{_NN}.batch_normalization", _O[f"{_NN}.batch_normalization"], "1cc80ed9bad6ea79", _OPS + _LEAN),
    # Lean rules: Keras's float32 ops computed the same way, 16-bit inputs kept for the backward pass.
    Guard(f"{_NN}.moments", _O[f"{_NN}.moments"], "57bcc01c34d85f72", _LEAN),
    Guard(f"{_K}.ops.nn._layer_normalization", _O[f"{_K}.ops.nn._layer_normalization"], "67b9792af8800337", _LEAN),
    Guard(f"{_K}.ops.nn._normalize", _O[f"{_K}.ops.nn._normalize"], "6d45ce2adc62638f", _OPS),
    Guard(f"{_K}.backend.tensorflow.numpy.std", _O[f"{_K}.backend.tensorflow.numpy.std"], "06356e76fd7e60f7", _OPS),
    Guard(f"{_NN}.gelu", _O[f"{_NN}.gelu"], "edb8d0940a01c8d5", _LEAN),
    Guard(f"{_NN}.categorical_crossentropy", _O[f"{_NN}.categorical_crossentropy"], "a2cb8f1dacc6a411", _OPS),
    Guard(f"{_K}.ops.nn.CategoricalCrossentropy.compute_output_spec",
          _O[f"{_K}.ops.nn.CategoricalCrossentropy.compute_output_spec"], "c729e7e6cb6f7d01", _OPS),
    Guard(f"{_NN}.sparse_categorical_crossentropy", _O[f"{_NN}.sparse_categorical_crossentropy"],
          "8dd1e34615666cea", _OPS + _LEAN),
    Guard(f"{_K}.ops.nn.SparseCategoricalCrossentropy.compute_output_spec",
          _O[f"{_K}.ops.nn.SparseCategoricalCrossentropy.compute_output_spec"], "1d2704fea7e2f6f6", _OPS),
    Guard(f"{_NN}.binary_crossentropy", _O[f"{_NN}.binary_crossentropy"], "3fb0e94214714db1", _OPS),
    Guard(f"{_K}.ops.nn.BinaryCrossentropy.compute_output_spec",
          _O[f"{_K}.ops.nn.BinaryCrossentropy.compute_output_spec"], "4dd48a4bb5ef1272", _OPS),
    # Attention: the op rule replaces _compute_attention (original here) and relies on call; the
    # MultiHeadAttention layer copies or relies on all six.
    Guard(f"{_MHA_NAME}._compute_attention", _O["keras.layers.MultiHeadAttention._compute_attention"],
          "88168a1a82dd0d31", _OP_ATTENTION + _ATTENTION),
    Guard(f"{_MHA_NAME}.call", _O["keras.layers.MultiHeadAttention.call"], "fd666cb2fe09b101",
          _OP_ATTENTION + _ATTENTION),
    Guard(f"{_MHA_NAME}.__init__", _MHA.__dict__["__init__"], "e35ec682b0a40265", _ATTENTION),  # _inverse_sqrt_key_dim
    Guard(f"{_MHA_NAME}._build_attention", _MHA.__dict__["_build_attention"], "26399b12f2810501", _ATTENTION),
    Guard(f"{_MHA_NAME}._masked_softmax", _MHA.__dict__["_masked_softmax"], "f2b05c4b4388a750", _ATTENTION),
    Guard(f"{_MHA_NAME}._compute_causal_mask", _MHA.__dict__["_compute_causal_mask"], "69d9aaf9eb2651f4",
          _ATTENTION),  # attention._causal_mask builds the same mask
    # The dataflow rules: the roots of normalisation statistics (originals) and the TensorFlow kernel
    # of ops.dot_product_attention with the mask helper it calls.
    Guard(f"{_K}.backend.tensorflow.numpy.sqrt", _O[f"{_K}.backend.tensorflow.numpy.sqrt"],
          "642f2ad26ab43d29", _OPS),
    Guard(f"{_K}.backend.tensorflow.math.rsqrt", _O[f"{_K}.backend.tensorflow.math.rsqrt"],
          "f901ca8dbba55e12", _OPS),
    Guard(f"{_NN}._dot_product_attention_xla", _O[f"{_NN}._dot_product_attention_xla"],
          "dee56832e55953fc", _OP_ATTENTION),
    Guard(f"{_NN}._apply_masks", _O[f"{_NN}._apply_masks"], "002efd810c138eeb", _OP_ATTENTION),
    # The matmul rule of Matmul16DTypePolicy layers (original), and the name-scope stack it reads
    # the calling layer from: Layer.__call__ enters _open_name_scope -> backend.name_scope(self.name, caller=self).
    Guard(f"{_K}.backend.tensorflow.numpy.matmul", _O[f"{_K}.backend.tensorflow.numpy.matmul"],
          "9f471e0ba26e3c20", _OP_MATMUL),
    Guard(f"{_K}.layers.layer.Layer.__call__", _O["keras.layers.Layer.__call__"], "4fb7e42e4ffd9b1a",
          _OP_ATTENTION + _OP_MATMUL + _FLOAT32 + _ATTRIBUTION),
    Guard(f"{_K}.layers.layer.Layer._open_name_scope", _O["keras.layers.Layer._open_name_scope"],
          "9197bac9543ef95a", _OP_ATTENTION + _OP_MATMUL),
    Guard(f"{_K}.backend.tensorflow.core.name_scope", _O[f"{_K}.backend.tensorflow.core.name_scope"],
          "bff9a1de6e491b0d", _OP_ATTENTION + _OP_MATMUL),
    Guard(f"{_K}.backend.common.name_scope.name_scope", _O[f"{_K}.backend.common.name_scope.name_scope"],
          "957dcd2ff7532ae8", _OP_ATTENTION + _OP_MATMUL),
    # Float32 islands: autocast of a layer's variables.
    Guard(f"{_K}.backend.common.variables.AutocastScope", variables.AutocastScope, "41c96933fcde87d4", _FLOAT32),
    Guard(f"{_K}.backend.common.variables.Variable._maybe_autocast", variables.Variable.__dict__["_maybe_autocast"],
          "1b42c967de4732d6", _FLOAT32),
    # Recurrent layers: the stock loop and gate code the float32-state cells copy or rely on.
    # RNN.call: copied by keras_amp.layers.recurrent; relied on by the "rnn" recipe in a model's own
    # code (states cast to the cell's compute dtype into the loop, outputs to the RNN's after it).
    Guard(f"{_K}.layers.rnn.rnn.RNN.call", rnn.RNN.__dict__["call"], "e580bb43258da9c3", _RECURRENT + _RECIPES),
    Guard(f"{_K}.layers.rnn.rnn.RNN.inner_loop", rnn.RNN.__dict__["inner_loop"], "95624f67dd86cc32", _RECURRENT),
    Guard(f"{_K}.layers.rnn.lstm.LSTM.__init__", lstm.LSTM.__dict__["__init__"], "74003dee042b8d6a", _RECURRENT),
    Guard(f"{_K}.layers.rnn.lstm.LSTM.inner_loop", lstm.LSTM.__dict__["inner_loop"], "8dc385b0e14a252e",
          _RECURRENT),  # use_cudnn=False -> RNN.inner_loop
    Guard(f"{_K}.layers.rnn.gru.GRU.__init__", gru.GRU.__dict__["__init__"], "ad6759233509ce98", _RECURRENT),
    Guard(f"{_K}.layers.rnn.gru.GRU.inner_loop", gru.GRU.__dict__["inner_loop"], "c60ea87cae404e16", _RECURRENT),
    Guard(f"{_K}.layers.rnn.lstm.LSTMCell.call", lstm.LSTMCell.__dict__["call"], "c71d0352f74b106d", _RECURRENT),
    Guard(f"{_K}.layers.rnn.gru.GRUCell.call", gru.GRUCell.__dict__["call"], "1019f8bce4307f38", _RECURRENT),
    # The "rnn" recipe: RNN layers keep a Matmul16DTypePolicy through .keras files (their from_config
    # passes the dtype config on), cells are rebuilt through Operation.from_config (which turns a
    # policy into its name); the cast of a weight read in the time loop is hoisted out of the loop
    # body (a v2 control-flow graph) that TF's `rnn` runs the step in.
    Guard(f"{_K}.ops.operation.Operation.from_config", operation.Operation.__dict__["from_config"].__func__,
          "0ad099055bf699d4", _RECIPES + _OP_MATMUL),
    Guard(f"{_K}.layers.rnn.rnn.RNN.from_config", rnn.RNN.__dict__["from_config"].__func__, "0ed0c76ff5f15a35",
          _RECIPES + _OP_MATMUL),
    Guard(f"{_K}.backend.tensorflow.rnn.rnn", tf_rnn.rnn, "e5253cfb13d19752", _FLOAT32),
    Guard("tensorflow.python.ops.control_flow_v2_func_graphs.WhileBodyFuncGraph",
          control_flow_v2_func_graphs.WhileBodyFuncGraph, "38630be4ecd558b9", _FLOAT32),
    Guard("tensorflow.python.ops.control_flow_v2_func_graphs.CondBranchFuncGraph",
          control_flow_v2_func_graphs.CondBranchFuncGraph, "fb01625dc3036def", _FLOAT32),
    # Diagnostics: per-layer attribution of ops and gradient ops (names "gradient_tape/<scope>/",
    # "gradients/<op>_grad/"), and the nested FuncGraph lookup of the audit.
    Guard(f"{_K}.ops.operation.Operation.__call__", operation.Operation.__dict__["__call__"], "54fc9fcb8839877d",
          _ATTRIBUTION),
    Guard("tensorflow.python.eager.backprop._gradient_function", backprop._gradient_function, "06a5cb31f1157eda",
          _ATTRIBUTION),
    Guard("tensorflow.python.ops.gradients_util._GradientsHelper", gradients_util._GradientsHelper,
          "1cf76bca60075bda", _ATTRIBUTION),
    Guard("tensorflow.python.framework.ops.Graph._get_function", tf_ops.Graph._get_function, "e2c2d3363e3e49a5",
          ("keras_amp.diagnostics.audit",)),
    # Callbacks: how (and when) batch-end logs reach them.
    Guard(f"{_K}.callbacks.callback_list.CallbackList._configure_async_dispatch",
          callback_list.CallbackList._configure_async_dispatch, "be3563e8da2546cd", _CALLBACKS),
    Guard(f"{_K}.callbacks.callback_list.CallbackList._on_train_batch_end",
          callback_list.CallbackList._on_train_batch_end, "def5a3d70b8b5f20", _CALLBACKS),
    # Recipes and the model graph: build-time casts, layer walking, retracing compiled functions.
    Guard(f"{_K}.layers.preprocessing.normalization.Normalization.build", normalization.Normalization.build,
          "a3b7f63133bc9cfc", _RECIPES),
    Guard(f"{_K}.layers.preprocessing.normalization.Normalization.finalize_state",
          normalization.Normalization.finalize_state, "80b9994fb9171aea", _RECIPES),
    Guard(f"{_K}.layers.layer.Layer._flatten_layers", keras_layer.Layer._flatten_layers, "662dcf281bc32c53",
          ("keras_amp.model_graph", "keras_amp.policy")),
    Guard(f"{_K}.models.functional.Functional.__init__", functional.Functional.__init__, "1c7c6c21886b2ac5",
          _RECIPES),  # _convert_input_args = False
    # make_train_function(force=True) rebuilds, a function set to None is rebuilt, and fit reads
    # self.train_function at every step: recipes reset them, auto_precision swaps them mid-fit.
    Guard(f"{_TRAINER_NAME}.make_train_function", _TRAINER.make_train_function, "a9703da4a49beb28",
          _RECIPES + _AUTO),
    Guard(f"{_TRAINER_NAME}.make_test_function", _TRAINER.make_test_function, "ad5e9155b9298ef1", _RECIPES),
    Guard(f"{_TRAINER_NAME}.make_predict_function", _TRAINER.make_predict_function, "a772a2efdd906f9a", _RECIPES),
    Guard(f"{_TRAINER_NAME}.fit", _TRAINER.fit, "a9a6dc02a7ddafa8", _AUTO),
]


def _resolve(qualified_name: str) -> Any:
    """The object a dotted name points to: the longest importable module, then attributes."""
    parts = qualified_name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(qualified_name)


def _function(obj: Any) -> Any:
    return getattr(obj, "__func__", obj)  # classmethods


@pytest.fixture
def stock_keras():
    """Keras as it ships: no op rule and no fit fix installed (restored afterwards)."""
    assert op_rules.installed() is None  # conftest disables keras_amp after every test
    fit_fix = trainer_fix.fit_fix_installed()
    trainer_fix.uninstall_fit_fix()
    yield
    if fit_fix:
        trainer_fix.install_fit_fix()


def test_versions_are_the_ones_the_table_was_written_against():
    assert keras.__version__.startswith(KERAS_VERSION), keras.__version__
    assert tf.__version__.startswith(TF_VERSION), tf.__version__


def test_table_is_well_formed():
    names = [g.name for g in GUARDS]
    assert len(names) == len(set(names)), "duplicate rows"
    objects = [id(_function(g.obj)) for g in GUARDS]
    assert len(objects) == len(set(objects)), "one row per object: list every dependent module in it"
    for guard in GUARDS:
        assert len(guard.digest) == 16 and set(guard.digest) <= set("0123456789abcdef"), guard
        assert isinstance(guard.modules, tuple) and guard.modules, guard
        assert len(guard.modules) == len(set(guard.modules)), guard
        for module in guard.modules:
            importlib.import_module(module)  # each dependent module exists


@pytest.mark.parametrize("guard", GUARDS, ids=[g.name for g in GUARDS])
def test_guarded_source_unchanged(guard, stock_keras):
    # The name is where the object is defined: a row cannot silently guard something else.
    assert _function(_resolve(guard.name)) is _function(guard.obj), guard.name
    found = source_digest(guard.obj)
    assert found == guard.digest, (
        f"{guard.name} changed (digest {found}, pinned {guard.digest}): re-read it, port the change "
        f"into {', '.join(guard.modules)}, then update the row."
    )


def _row(obj: Any) -> Guard:
    rows = [g for g in GUARDS if _function(g.obj) is _function(obj)]
    assert len(rows) == 1, f"no row guards {obj!r}"
    return rows[0]


def test_every_op_rule_target_has_a_row_with_the_install_time_pin():
    # op_rules installs a rule only when ORIGINAL_DIGESTS matches: the two pins must agree, and a
    # new rule target must get a row.
    assert set(op_rules.ORIGINAL_DIGESTS) == set(op_rules.ORIGINALS)
    for name, original in op_rules.ORIGINALS.items():
        row = _row(original)
        assert row.digest == op_rules.ORIGINAL_DIGESTS[name], (name, row.name)
        assert any(m.startswith("keras_amp.op_rules.") for m in row.modules), row


def test_fit_fix_targets_have_rows_with_the_install_time_pin():
    # trainer_fix installs only when its full sha256 pins match: the table's prefix must agree.
    originals = {
        "TensorFlowTrainer._maybe_symbolic_build": trainer_fix._ORIGINAL_BUILD,
        "reduce_per_replica": trainer_fix._ORIGINAL_REDUCE,
        "_collective_all_reduce_multi_worker": tf_trainer._collective_all_reduce_multi_worker,
    }
    assert set(originals) == set(trainer_fix.ORIGINAL_SOURCE_SHA256)
    for name, original in originals.items():
        row = _row(original)
        assert trainer_fix.ORIGINAL_SOURCE_SHA256[name][:16] == row.digest, (name, row.name)
        assert "keras_amp.distribute.trainer_fix" in row.modules, row


def test_tf_internal_route_to_no_merge_call_is_the_guarded_function():
    # The optimizer calls it through tf.__internal__; the row pins the function behind that route.
    assert tf.__internal__.distribute.strategy_supports_no_merge_call is merge_call_interim.strategy_supports_no_merge_call


def test_stock_variable_layout_is_what_load_own_variables_maps():
    # keras_amp's load_own_variables maps a stock store by position: iteration, learning_rate,
    # step_counter, dynamic_scale, then the inner optimizer's variables.
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    opt.build([keras.Variable([1.0])])
    assert [v.name for v in opt._variables] == ["iteration", "learning_rate", "step_counter", "dynamic_scale"]
    assert opt._iterations is opt._variables[0]  # total_steps reads `_iterations`


def test_overwrite_with_gradient_is_a_variable_attribute():
    # _apply_unscaled leaves such gradients unscaled, as stock does: they are values, not gradients.
    variable = keras.Variable(np.zeros(2, "float32"))
    variable.overwrite_with_gradient = True
    assert keras.optimizers.SGD()._overwrite_variable_with_gradient(variable) is True


def test_compile_auto_wraps_only_non_loss_scale_optimizers():
    # compile() keeps ours because it is an instance of the stock class.
    from keras_amp.optimizers import LossScaleOptimizer

    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = LossScaleOptimizer(keras.optimizers.SGD())
    model.compile(optimizer=opt, loss="mse")
    assert model.optimizer is opt
