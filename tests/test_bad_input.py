"""Bad input to every public argument: the right error class, and a message naming the argument.

The one bad-input table of keras_amp's public API. Three tables:
- `API`: a name -> (the public callable whose parameters must all be covered, a function calling
  it with valid defaults overridden by keyword). Register a new public callable here once;
  `test_every_public_callable_is_registered` fails until it is (or until it joins `EXCLUDED`).
- `BAD`: one row per bad value, `(api, argument, value, error class)`. TypeError for a wrong
  type, ValueError for a wrong value. A new public argument joins `BAD`;
  `test_every_parameter_has_a_row` fails until it does.
- `GOOD`: values that must be accepted (NumPy numbers wherever a Python number is).

For a layer that subclasses a stock Keras layer through `*args, **kwargs` (or inherits its
constructor), the arguments that must have rows are keras_amp's own (its `ARGUMENT_CHECKS` and
explicit parameters): the other stock arguments are stock Keras's to check.

Nothing here trains, starts a process or initialises logical devices: calls that would do so
with a valid value run with that step replaced by `_refuse`, so a bad value that slips through
fails its row with a RuntimeError instead of doing the work.
"""

import importlib
import inspect
import math
import re
import sys
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_amp import auto_precision, callbacks, diagnostics, doctor, model_graph, policy, recipes
from keras_amp import layers as amp_layers
from keras_amp.distribute import local_cluster
from keras_amp.hardware import DeviceInfo, GpuInfo
from keras_amp.losses import as_compiled, float32_loss
from keras_amp.optimizers import LossScaleOptimizer, choose_tier, scale_rule, wrap

PLAIN_CPU = DeviceInfo(cpu_model="test", cpu_flags=frozenset({"avx2"}), onednn_enabled=True)
CONFIG = dict(policy="mixed_float16", compute_dtype="float16", variable_dtype="float32", loss_scaling=True,
              tf32=False, device="", requested="mixed_float16", reason="test")
X = np.ones((4, 4), "float32")
Y = np.ones((4, 1), "float32")
_DEFAULT = tf.distribute.get_strategy()
_DS = tf.data.Dataset.range(8)
MHA = dict(num_heads=2, key_dim=4)


def _sgd():
    return keras.optimizers.SGD()


def _model():
    """A tiny built and compiled functional model (fresh per call: recipes convert in place)."""
    inp = keras.Input((4,))
    h = keras.layers.Dense(4, name="d1")(inp)
    model = keras.Model(inp, keras.layers.Dense(1, name="out", dtype="float32")(h), name="m")
    model.compile(loss="mse")
    return model


def _wrap(**kw):
    keras.config.set_dtype_policy("float32")  # where wrap() used to return without any check
    return wrap(**{"optimizer": _sgd(), **kw})


def _refuse(*args, **kwargs):
    raise RuntimeError("a bad value was accepted: the call went on to start processes or devices")


def _launch(**kw):
    with mock.patch.object(local_cluster.subprocess, "Popen", _refuse):
        return local_cluster.launch(**{"argv": [sys.executable, "-c", ""], "timeout": 10, **kw})


def _configure_logical_cpus(**kw):
    with mock.patch.object(tf.config, "set_logical_device_configuration", _refuse):
        return local_cluster.configure_logical_cpus(**kw)


def _python_argv(script="train.py", args=()):
    return local_cluster.python_argv(script, *args)


def _with(fn, **defaults):
    return lambda **kw: fn(**{**defaults, **kw})


def _dense():
    layer = keras.layers.Dense(2)
    layer.build((None, 2))
    return layer


def _float32_weights(**kw):
    with keras_amp.memory.float32_weights(**{"model": _dense(), **kw}):
        pass


API = {
    # memory
    "memory.prepare": (keras_amp.memory.prepare, _with(keras_amp.memory.prepare, model=_dense())),
    "restore_frozen_float32": (keras_amp.memory.restore_frozen_float32,
                               _with(keras_amp.memory.restore_frozen_float32, model=_dense())),
    "float32_weights": (keras_amp.memory.float32_weights, _float32_weights),
    "save_float32_weights": (keras_amp.memory.save_float32_weights,
                             _with(keras_amp.memory.save_float32_weights, model=_dense(), filepath="x.weights.h5")),
    "set_storage": (keras_amp.memory.set_storage,
                    lambda **kw: keras_amp.memory.set_storage(**{"variable": _dense().kernel, "dtype": "bfloat16", **kw})),
    "state_bytes": (keras_amp.memory.state_bytes, _with(keras_amp.memory.state_bytes, model=_dense())),
    "storage_dtype": (keras_amp.memory.storage_dtype, keras_amp.memory.storage_dtype),
    "variable_bytes": (keras_amp.memory.variable_bytes, keras_amp.memory.variable_bytes),
    "frozen_16bit": (keras_amp.memory.frozen_16bit, keras_amp.memory.frozen_16bit),
    "LeanAdam": (keras_amp.optimizers.LeanAdam, keras_amp.optimizers.LeanAdam),
    "UpdateLossProbe": (keras_amp.diagnostics.UpdateLossProbe,
                        _with(keras_amp.diagnostics.UpdateLossProbe, model=_dense(), optimizer=keras.optimizers.SGD())),
    "LeanAdamW": (keras_amp.optimizers.LeanAdamW, keras_amp.optimizers.LeanAdamW),
    # pictures
    "plot_precision_plan": (keras_amp.plot_precision_plan, _with(keras_amp.plot_precision_plan, model=_model())),
    # core
    "enable": (keras_amp.enable, _with(keras_amp.enable, policy="float32", device=PLAIN_CPU)),
    "AmpConfig": (policy.AmpConfig, _with(policy.AmpConfig, **CONFIG)),
    "fingerprint_fields": (policy.AmpConfig.fingerprint_fields,
                           lambda **kw: policy.AmpConfig(**CONFIG).fingerprint_fields(**kw)),
    "DeviceInfo": (DeviceInfo, _with(DeviceInfo)),
    "GpuInfo": (GpuInfo, _with(GpuInfo, name="gpu")),
    "LossScaleOptimizer": (LossScaleOptimizer, lambda **kw: LossScaleOptimizer(**{"inner_optimizer": _sgd(), **kw})),
    "ScaleRule": (scale_rule.ScaleRule, _with(scale_rule.ScaleRule)),
    "wrap": (wrap, _wrap),
    "choose_tier": (choose_tier, _with(choose_tier, num_params=1000)),
    "float32_loss": (float32_loss, _with(float32_loss)),
    "as_compiled": (as_compiled, _with(as_compiled)),
    "doctor.collect": (doctor.collect, _with(doctor.collect)),
    "doctor.register_section": (doctor.register_section, _with(doctor.register_section)),
    "doctor.format_report": (doctor.format_report, _with(doctor.format_report)),
    "doctor.as_dict": (doctor.as_dict, _with(doctor.as_dict)),
    "doctor.Section": (doctor.Section, _with(doctor.Section, title="t", rows=())),
    # recipes, model_graph
    "plan_recipe": (recipes.plan_recipe, lambda **kw: recipes.plan_recipe(**{"model": _model(), "recipe": "cnn", **kw})),
    "apply_recipe": (recipes.apply_recipe, lambda **kw: recipes.apply_recipe(**{"model": _model(), "recipe": "cnn", **kw})),
    "model_graph.children": (model_graph.children, lambda **kw: model_graph.children(**{"layer": _model(), **kw})),
    "model_graph.walk": (model_graph.walk, lambda **kw: model_graph.walk(**{"model": _model(), **kw})),
    "model_graph.layer_tree": (model_graph.layer_tree, lambda **kw: model_graph.layer_tree(**{"model": _model(), **kw})),
    "model_graph.leaves": (model_graph.leaves, lambda **kw: model_graph.leaves(**{"model": _model(), **kw})),
    "model_graph.graph": (model_graph.graph, _with(model_graph.graph)),
    "model_graph.boundary": (model_graph.boundary,
                             lambda **kw: model_graph.boundary(**{"model": _model(), "first": True, **kw})),
    "model_graph.neighbour_dtypes": (
        model_graph.neighbour_dtypes,
        lambda **kw: model_graph.neighbour_dtypes(**{"model": _model(), "dtype_of": str, "upstream": True, **kw})),
    "model_graph.warn_if_built_before_enable": (
        model_graph.warn_if_built_before_enable,
        lambda **kw: model_graph.warn_if_built_before_enable(**{"model": _model(), **kw})),
    # distribute
    "multi_worker": (keras_amp.distribute.multi_worker, _with(keras_amp.distribute.multi_worker)),
    "mirrored": (keras_amp.distribute.mirrored, _with(keras_amp.distribute.mirrored)),
    "verify": (keras_amp.distribute.verify, _with(keras_amp.distribute.verify, strategy=_DEFAULT)),
    "VerifyPrecision": (keras_amp.distribute.VerifyPrecision, _with(keras_amp.distribute.VerifyPrecision)),
    "global_batch_size": (keras_amp.distribute.global_batch_size,
                          _with(keras_amp.distribute.global_batch_size, per_replica_batch_size=8, strategy=_DEFAULT)),
    "per_replica_batch_size": (keras_amp.distribute.per_replica_batch_size,
                               _with(keras_amp.distribute.per_replica_batch_size, global_batch_size=16,
                                     strategy=_DEFAULT)),
    "prepare": (keras_amp.distribute.prepare,
                _with(keras_amp.distribute.prepare, dataset=_DS, strategy=_DEFAULT, per_replica_batch_size=2)),
    "with_auto_shard_policy": (keras_amp.distribute.with_auto_shard_policy,
                               _with(keras_amp.distribute.with_auto_shard_policy, dataset=_DS, policy="data")),
    "auto_shard_policy": (keras_amp.distribute.auto_shard_policy,
                          _with(keras_amp.distribute.auto_shard_policy, dataset=_DS)),
    "free_ports": (local_cluster.free_ports, _with(local_cluster.free_ports, count=2)),
    "configure_logical_cpus": (local_cluster.configure_logical_cpus, _configure_logical_cpus),
    "tf_config": (local_cluster.tf_config, _with(local_cluster.tf_config, ports=[1111, 2222], index=0)),
    "launch": (local_cluster.launch, _launch),
    "LocalCluster": (local_cluster.LocalCluster, _with(local_cluster.LocalCluster, argv=[sys.executable, "-c", ""])),
    "python_argv": (local_cluster.python_argv, _python_argv),
    # layers
    "BatchNormalization": (amp_layers.BatchNormalization, _with(amp_layers.BatchNormalization)),
    "GroupNormalization": (amp_layers.GroupNormalization, _with(amp_layers.GroupNormalization, groups=2)),
    "LayerNormalization": (amp_layers.LayerNormalization, _with(amp_layers.LayerNormalization)),
    "RMSNormalization": (amp_layers.RMSNormalization, _with(amp_layers.RMSNormalization)),
    "Softmax": (amp_layers.Softmax, _with(amp_layers.Softmax)),
    "MultiHeadAttention": (amp_layers.MultiHeadAttention, _with(amp_layers.MultiHeadAttention, **MHA)),
    "LSTM": (amp_layers.LSTM, _with(amp_layers.LSTM, units=3)),
    "GRU": (amp_layers.GRU, _with(amp_layers.GRU, units=3)),
    "LSTMCell": (amp_layers.LSTMCell, _with(amp_layers.LSTMCell, units=3)),
    "GRUCell": (amp_layers.GRUCell, _with(amp_layers.GRUCell, units=3)),
    "Float32": (amp_layers.Float32, lambda **kw: amp_layers.Float32(**{"layer": keras.layers.Dense(2), **kw})),
    "OutputHead": (amp_layers.OutputHead, _with(amp_layers.OutputHead, units=3)),
    "Logits": (amp_layers.Logits, _with(amp_layers.Logits, units=3)),
    "Matmul16DTypePolicy": (keras_amp.Matmul16DTypePolicy, _with(keras_amp.Matmul16DTypePolicy)),
    # callbacks
    "LossScaleMonitor": (callbacks.LossScaleMonitor, _with(callbacks.LossScaleMonitor)),
    "GradientStatistics": (callbacks.GradientStatistics, _with(callbacks.GradientStatistics, probe=(X,))),
    # diagnostics
    "GradientProbe": (diagnostics.GradientProbe, lambda **kw: diagnostics.GradientProbe(**{"model": _model(), "x": X, **kw})),
    "audit_model": (diagnostics.audit_model, lambda **kw: diagnostics.audit_model(**{"model": _model(), "x": X, **kw})),
    "check_model": (diagnostics.check_model, lambda **kw: diagnostics.check_model(**{"model": _model(), **kw})),
    "find_overflow": (diagnostics.find_overflow, lambda **kw: diagnostics.find_overflow(**{"model": _model(), "x": X, **kw})),
    "gradient_statistics": (diagnostics.gradient_statistics,
                            lambda **kw: diagnostics.gradient_statistics(**{"model": _model(), "x": X, **kw})),
    "saved_activations": (diagnostics.saved_activations,
                          lambda **kw: diagnostics.saved_activations(**{"model": _model(), "x": X, **kw})),
    # automatic precision
    "Float32Fallback": (auto_precision.Float32Fallback, _with(auto_precision.Float32Fallback, probe=(X, Y))),
    "ProgressivePrecision": (auto_precision.ProgressivePrecision,
                             _with(auto_precision.ProgressivePrecision, schedule={0: ["d1"]})),
    "export_for_inference": (auto_precision.export_for_inference,
                             lambda **kw: auto_precision.export_for_inference(**{"model": _model(), "sample": X, **kw})),
    "search_precision": (auto_precision.search_precision,
                         lambda **kw: auto_precision.search_precision(
                             **{"model": _model(), "data": [(X, Y)], "policy": "mixed_bfloat16", **kw})),
    "weight_bytes": (auto_precision.weight_bytes, _with(auto_precision.weight_bytes)),
}

# Public names that take no user input or need no row, each with the reason. The coverage test
# fails for a public callable that is neither here nor in `API`.
EXCLUDED = {
    # Functions without arguments.
    "keras_amp.config", "keras_amp.disable",
    "keras_amp.distribute.fit_fix_installed", "keras_amp.distribute.install_fit_fix",
    "keras_amp.distribute.uninstall_fit_fix",
    # Exceptions and warnings: raised by keras_amp, not called by users.
    "keras_amp.AmpWarning", "keras_amp.MinScaleError", "keras_amp.distribute.FingerprintMismatchError",
    # Result records: frozen dataclasses keras_amp builds and returns; users read them.
    "keras_amp.AuditReport", "keras_amp.Finding", "keras_amp.ModelReport", "keras_amp.OpRecord",
    "keras_amp.model_graph.LayerTree",  # built by model_graph.layer_tree, never by users
    "keras_amp.OverflowReport", "keras_amp.RecipePlan", "keras_amp.recipes.LayerPolicy",
    "keras_amp.diagnostics.GradientReport", "keras_amp.diagnostics.LayerGradientStats",
    "keras_amp.diagnostics.LayerOverflowStats", "keras_amp.diagnostics.Producer",
    "keras_amp.diagnostics.SavedActivationsReport", "keras_amp.diagnostics.SavedTensor",
    "keras_amp.auto_precision.Errors", "keras_amp.auto_precision.FallbackDecision",
    "keras_amp.auto_precision.InferenceExport", "keras_amp.auto_precision.LayerDecision",
    "keras_amp.auto_precision.PrecisionChange", "keras_amp.auto_precision.SearchResult",
    "keras_amp.optimizers.ScaleState", "keras_amp.optimizers.TierValues", "keras_amp.memory.Prepared",
    "keras_amp.distribute.local_cluster.WorkerResult", "keras_amp.model_graph.Graph",
    # A marker base class without arguments (isinstance test for float32 islands).
    "keras_amp.model_graph.Float32Island",
    # Predicates over any object: every value is a valid input, the answer is True/False/None.
    "keras_amp.model_graph.is_graph", "keras_amp.model_graph.is_island", "keras_amp.model_graph.is_layer",
    "keras_amp.model_graph.is_stale", "keras_amp.layer_kinds.op_kind", "keras_amp.layer_kinds.normalization_dtype",
}

# Parameters without a bad value to put in a row, by design:
# - a walk's root or a predicate's subject accepts any object (a non-layer has no children);
# - a batch in the structure the model takes (`y`, an optional `x`, `sample`): any array,
#   tensor or nest may be right for some model, so, as in `model.fit`, a wrong one fails in the
#   model's own call (check_model's and audit_model's error names `x`: test_check.py). (A required `x` has its
#   row: None is never an input.)
ANY_VALUE = {
    ("model_graph.children", "layer"), ("model_graph.walk", "model"), ("model_graph.layer_tree", "model"), ("model_graph.leaves", "model"),
    ("model_graph.warn_if_built_before_enable", "model"),
    ("GradientProbe", "y"), ("find_overflow", "y"), ("gradient_statistics", "y"), ("check_model", "x"),
    ("saved_activations", "y"),
    ("export_for_inference", "sample"),
}

# The public modules whose callables must all be registered: their `__all__`, or for a module
# without `__all__`, the public names it defines itself.
PUBLIC_MODULES = (
    "keras_amp", "keras_amp.distribute", "keras_amp.distribute.local_cluster", "keras_amp.layers",
    "keras_amp.callbacks", "keras_amp.diagnostics", "keras_amp.auto_precision", "keras_amp.recipes",
    "keras_amp.model_graph", "keras_amp.layer_kinds", "keras_amp.optimizers", "keras_amp.memory", "keras_amp.losses",
)


NAN, INF = float("nan"), float("inf")
BAD = [
    # pictures
    ("plot_precision_plan", "model", "m", TypeError),
    ("plot_precision_plan", "model", keras.Sequential([keras.layers.Dense(4)]), ValueError),  # not built
    ("plot_precision_plan", "path", 5, TypeError),
    ("plot_precision_plan", "recipe", "cnnn", ValueError),
    ("plot_precision_plan", "rules", {"d1": "float32"}, ValueError),  # rules without a recipe
    # keras_amp.memory
    ("memory.prepare", "model", "model", TypeError),
    ("memory.prepare", "optimizer", "adam", TypeError),
    ("memory.prepare", "frozen_weights", "bfloat16", ValueError),
    ("restore_frozen_float32", "model", None, TypeError),
    ("restore_frozen_float32", "weights_path", 3, TypeError),
    ("restore_frozen_float32", "weights_path", "/nonexistent/w.weights.h5", FileNotFoundError),
    ("float32_weights", "model", [], TypeError),
    ("float32_weights", "optimizer", "adam", TypeError),
    ("save_float32_weights", "model", "m", TypeError),
    ("save_float32_weights", "filepath", 5, TypeError),
    ("save_float32_weights", "optimizer", "adam", TypeError),
    ("set_storage", "variable", np.zeros(2), TypeError),
    ("set_storage", "dtype", "int8", ValueError),
    ("set_storage", "value", np.zeros((3, 3), "float32"), ValueError),
    ("state_bytes", "model", "m", TypeError),
    ("state_bytes", "optimizer", "adam", TypeError),
    ("storage_dtype", "variable", "kernel", TypeError),
    ("variable_bytes", "variables", "kernel", TypeError),
    ("variable_bytes", "variables", [np.zeros(2)], TypeError),
    ("frozen_16bit", "model", 1, TypeError),
    ("check_model", "loss", 3, TypeError),
    ("check_model", "loss", "bogus", ValueError),
    ("check_model", "device", "gpu", TypeError),
    ("search_precision", "verbose", "loud", TypeError),
    ("search_precision", "verbose", 3, ValueError),
    ("UpdateLossProbe", "model", "m", TypeError),
    ("UpdateLossProbe", "optimizer", "sgd", TypeError),
    ("LeanAdam", "compensation", "exact", ValueError),
    ("LeanAdam", "jit_update", "yes", TypeError),
    ("LeanAdam", "compensation", 1, TypeError),
    ("LeanAdam", "moments", "float16", ValueError),
    ("LeanAdamW", "weight_decay", -1.0, ValueError),
    ("LeanAdamW", "weight_decay", "0.1", TypeError),
    # enable()
    ("enable", "frozen_weights", "bf16", ValueError),
    ("enable", "frozen_weights", None, TypeError),
    ("enable", "policy", "bogus", ValueError),
    ("enable", "policy", 16, TypeError),
    ("enable", "policy", keras.DTypePolicy("float16"), ValueError),
    ("enable", "tf32", "yes", TypeError),
    ("enable", "tf32", 1, TypeError),
    ("enable", "device", "cpu", TypeError),
    ("enable", "xla_scores", "yes", TypeError),
    ("enable", "xla_scores", None, TypeError),
    # AmpConfig
    ("AmpConfig", "frozen_weights", "half", ValueError),
    ("AmpConfig", "policy", "bogus", ValueError),
    ("AmpConfig", "policy", None, TypeError),
    ("AmpConfig", "compute_dtype", "bfloat16", ValueError),
    ("AmpConfig", "xla_scores", 1, TypeError),
    ("AmpConfig", "enabled", "no", TypeError),
    ("AmpConfig", "variable_dtype", "float16", ValueError),
    ("AmpConfig", "loss_scaling", "yes", TypeError),
    ("AmpConfig", "loss_scaling", False, ValueError),
    ("AmpConfig", "tf32", 0, TypeError),
    ("AmpConfig", "device", None, TypeError),
    ("AmpConfig", "requested", 3, TypeError),
    ("AmpConfig", "reason", b"x", TypeError),
    ("fingerprint_fields", "layers", "x", TypeError),
    ("fingerprint_fields", "optimizer", "x", TypeError),
    # DeviceInfo / GpuInfo
    ("DeviceInfo", "gpus", ("A100",), TypeError),
    ("DeviceInfo", "gpus", "A100", TypeError),
    ("DeviceInfo", "tpu_count", -1, ValueError),
    ("DeviceInfo", "tpu_count", 1.5, TypeError),
    ("DeviceInfo", "tpu_count", True, TypeError),
    ("DeviceInfo", "cpu_model", None, TypeError),
    ("DeviceInfo", "onednn_max_isa", 2, TypeError),
    ("DeviceInfo", "cpu_flags", "avx2", TypeError),
    ("DeviceInfo", "cpu_flags", {1, 2}, TypeError),
    ("DeviceInfo", "onednn_enabled", "on", TypeError),
    ("GpuInfo", "name", None, TypeError),
    ("GpuInfo", "compute_capability", (8,), ValueError),
    ("GpuInfo", "compute_capability", "8.0", TypeError),
    ("GpuInfo", "compute_capability", (8.0, 0), TypeError),
    ("GpuInfo", "compute_capability", (-1, 0), ValueError),
    # LossScaleOptimizer
    ("LossScaleOptimizer", "inner_optimizer", "sgd", TypeError),
    ("LossScaleOptimizer", "initial_scale", 0.0, ValueError),
    ("LossScaleOptimizer", "initial_scale", 1e39, ValueError),
    ("LossScaleOptimizer", "initial_scale", NAN, ValueError),
    ("LossScaleOptimizer", "initial_scale", "1", TypeError),
    ("LossScaleOptimizer", "dynamic_growth_steps", 0, ValueError),
    ("LossScaleOptimizer", "dynamic_growth_steps", 10**20, ValueError),
    ("LossScaleOptimizer", "dynamic_growth_steps", 2.0, TypeError),
    ("LossScaleOptimizer", "name", 3, ValueError),  # the stock constructor's type (drop-in subclass)
    ("LossScaleOptimizer", "tier", "bogus", ValueError),
    ("LossScaleOptimizer", "tier", ["small"], TypeError),
    ("LossScaleOptimizer", "min_scale", -1, ValueError),
    ("LossScaleOptimizer", "min_scale", 1e-39, ValueError),
    ("LossScaleOptimizer", "min_scale", INF, ValueError),
    ("LossScaleOptimizer", "max_scale", 1e39, ValueError),
    ("LossScaleOptimizer", "max_scale", 0.5, ValueError),  # below the default floor, 1
    ("LossScaleOptimizer", "growth_factor", 1.0, ValueError),
    ("LossScaleOptimizer", "growth_factor", None, TypeError),
    ("LossScaleOptimizer", "backoff_factor", 1.0, ValueError),
    ("LossScaleOptimizer", "backoff_factor", 1e-40, ValueError),
    ("LossScaleOptimizer", "hysteresis", 0, ValueError),
    ("LossScaleOptimizer", "hysteresis", 10**20, ValueError),
    ("LossScaleOptimizer", "hysteresis", 1.5, TypeError),
    ("LossScaleOptimizer", "dynamic", "no", TypeError),
    ("LossScaleOptimizer", "on_min_scale", "panic", ValueError),
    ("LossScaleOptimizer", "on_min_scale", None, TypeError),
    ("LossScaleOptimizer", "foo", 1, ValueError),  # **kwargs: unknown names; ValueError as stock raises
    # ScaleRule (the pure rule's constants)
    ("ScaleRule", "dynamic", 1, TypeError),
    ("ScaleRule", "dynamic_growth_steps", -3, ValueError),
    ("ScaleRule", "growth_factor", 0.5, ValueError),
    ("ScaleRule", "backoff_factor", 2.0, ValueError),
    ("ScaleRule", "min_scale", 0.0, ValueError),
    ("ScaleRule", "max_scale", INF, ValueError),
    ("ScaleRule", "hysteresis", "2", TypeError),
    ("ScaleRule", "min_scale_patience", 0, ValueError),
    # wrap(), under float32
    ("wrap", "optimizer", 3, TypeError),
    ("wrap", "optimizer", "not_an_optimizer", ValueError),
    ("wrap", "tier", "bogus", ValueError),
    ("wrap", "force", "no", TypeError),
    ("wrap", "min_scale", -1, ValueError),
    ("wrap", "hysteresis", 10**20, ValueError),
    ("wrap", "foo", 1, TypeError),  # **kwargs: unknown names
    # losses, doctor
    ("float32_loss", "fn", "mse", TypeError),
    ("as_compiled", "loss", 3, TypeError),
    ("doctor.collect", "device", "cpu", TypeError),
    ("doctor.register_section", "fn", 3, TypeError),
    ("doctor.format_report", "sections", "Versions", TypeError),
    ("doctor.format_report", "sections", ["Versions"], TypeError),
    ("doctor.as_dict", "sections", None, TypeError),
    ("doctor.Section", "title", None, TypeError),
    ("doctor.Section", "rows", (("key", 1),), TypeError),
    ("choose_tier", "num_params", -1, ValueError),
    ("choose_tier", "num_params", "10", TypeError),
    ("choose_tier", "num_params", 1.5, TypeError),
    # recipes
    ("plan_recipe", "model", keras.layers.Dense(2), TypeError),
    ("plan_recipe", "recipe", "vit", ValueError),
    ("plan_recipe", "recipe", None, TypeError),
    ("plan_recipe", "rules", [("d1", "float32")], TypeError),
    ("plan_recipe", "rules", {"d1": "int8"}, ValueError),
    ("apply_recipe", "model", "model", TypeError),
    ("apply_recipe", "model", keras.Sequential([keras.layers.Dense(4)]), ValueError),  # not built
    ("apply_recipe", "recipe", "vit", ValueError),
    ("apply_recipe", "recipe", ["cnn"], TypeError),
    ("apply_recipe", "rules", [("d1", "float32")], TypeError),
    ("apply_recipe", "rules", {"d1": "int8"}, ValueError),
    ("apply_recipe", "rules", {"d1": "bfloat16"}, ValueError),  # would need 16-bit variables
    ("apply_recipe", "rules", {"(d1": "float32"}, ValueError),  # not a regex
    ("apply_recipe", "rules", {3: "float32"}, TypeError),
    ("apply_recipe", "rules", {int: "float32"}, TypeError),
    ("apply_recipe", "model", keras.layers.Dense(2), TypeError),
    # model_graph
    ("model_graph.children", "operations", "yes", TypeError),
    ("model_graph.walk", "operations", 1, TypeError),
    ("model_graph.walk", "into", "dense", TypeError),
    ("model_graph.walk", "tree", "tree", TypeError),
    ("model_graph.layer_tree", "tree", "tree", TypeError),
    ("model_graph.leaves", "into", 3, TypeError),
    ("model_graph.graph", "model", "model", TypeError),
    ("model_graph.boundary", "model", "model", TypeError),
    ("model_graph.boundary", "first", "yes", TypeError),
    ("model_graph.warn_if_built_before_enable", "caller", 3, TypeError),
    ("model_graph.neighbour_dtypes", "model", "model", TypeError),
    ("model_graph.neighbour_dtypes", "dtype_of", "float32", TypeError),
    ("model_graph.neighbour_dtypes", "upstream", "yes", TypeError),
    ("model_graph.neighbour_dtypes", "tree", "tree", TypeError),
    # distribute
    ("multi_worker", "timeout_seconds", NAN, ValueError),
    ("multi_worker", "timeout_seconds", True, TypeError),
    ("multi_worker", "timeout_seconds", "10", TypeError),
    ("multi_worker", "timeout_seconds", 0, ValueError),
    ("multi_worker", "implementation", ["ring"], TypeError),
    ("multi_worker", "implementation", "gloo", ValueError),
    ("multi_worker", "cluster_resolver", "x", TypeError),
    ("mirrored", "devices", "/cpu:0", TypeError),
    ("mirrored", "devices", [0], TypeError),
    ("mirrored", "cross_device_ops", "nccl", TypeError),
    ("verify", "strategy", "mirrored", TypeError),
    ("verify", "timeout_seconds", NAN, ValueError),
    ("verify", "timeout_seconds", True, TypeError),
    ("verify", "timeout_seconds", "10", TypeError),
    ("verify", "model", "x", TypeError),
    ("verify", "model", _DS, TypeError),
    ("verify", "optimizer", "x", TypeError),
    ("VerifyPrecision", "timeout_seconds", "10", TypeError),
    ("VerifyPrecision", "timeout_seconds", -1, ValueError),
    ("global_batch_size", "strategy", "x", TypeError),
    ("global_batch_size", "per_replica_batch_size", 8.0, TypeError),
    ("global_batch_size", "per_replica_batch_size", True, TypeError),
    ("global_batch_size", "per_replica_batch_size", 0, ValueError),
    ("per_replica_batch_size", "strategy", object(), TypeError),
    ("per_replica_batch_size", "global_batch_size", "16", TypeError),
    ("per_replica_batch_size", "global_batch_size", 0, ValueError),
    ("prepare", "dataset", "x", TypeError),
    ("prepare", "dataset", [1, 2], TypeError),
    ("prepare", "dataset", np.zeros(4), TypeError),
    ("prepare", "dataset", _DS.batch(4), ValueError),  # already batched
    ("prepare", "strategy", "x", TypeError),
    ("prepare", "per_replica_batch_size", 0, ValueError),
    ("prepare", "per_replica_batch_size", 2.0, TypeError),
    ("prepare", "shard", ["data"], TypeError),
    ("prepare", "shard", "rows", ValueError),
    ("with_auto_shard_policy", "dataset", "x", TypeError),
    ("with_auto_shard_policy", "policy", ["data"], TypeError),
    ("with_auto_shard_policy", "policy", "rows", ValueError),
    ("auto_shard_policy", "dataset", None, TypeError),
    ("free_ports", "count", 100000, ValueError),
    ("free_ports", "count", 0, ValueError),
    ("free_ports", "count", "2", TypeError),
    ("configure_logical_cpus", "count", 0, ValueError),
    ("configure_logical_cpus", "count", 2.0, TypeError),
    ("configure_logical_cpus", "count", True, TypeError),
    ("tf_config", "ports", 1111, TypeError),
    ("tf_config", "ports", ["1111"], TypeError),
    ("tf_config", "index", 2, ValueError),
    ("tf_config", "index", -1, ValueError),
    ("tf_config", "index", "0", TypeError),
    ("tf_config", "host", 127, TypeError),
    ("launch", "argv", "python train.py", TypeError),
    ("launch", "argv", [], ValueError),
    ("launch", "timeout", NAN, ValueError),
    ("launch", "timeout", 0, ValueError),
    ("launch", "timeout", "10", TypeError),
    ("launch", "num_workers", 0, ValueError),
    ("launch", "num_workers", 2.0, TypeError),
    ("launch", "env", {"A": 1}, TypeError),
    ("launch", "env", "A=1", TypeError),
    ("launch", "worker_env", {5: {"A": "1"}}, ValueError),  # no worker 5
    ("launch", "worker_env", {0: {"A": 1}}, TypeError),
    ("LocalCluster", "argv", [], ValueError),
    ("LocalCluster", "argv", [sys.executable, 3], TypeError),
    ("LocalCluster", "num_workers", 0, ValueError),
    ("LocalCluster", "num_workers", "2", TypeError),
    ("LocalCluster", "env", {"A": 1}, TypeError),
    ("LocalCluster", "worker_env", {5: {"A": "1"}}, ValueError),
    ("LocalCluster", "log_dir", 3, TypeError),
    ("python_argv", "script", 3, TypeError),
    ("python_argv", "args", ("--steps", 3), TypeError),
    # layers: keras_amp checks at construction what stock Keras checks at build, at call or never
    ("LayerNormalization", "epsilon", -1.0, ValueError),
    ("LayerNormalization", "epsilon", NAN, ValueError),
    ("LayerNormalization", "epsilon", "x", TypeError),
    ("LayerNormalization", "axis", [1.5], TypeError),
    ("LayerNormalization", "center", "no", TypeError),
    ("LayerNormalization", "scale", 1, TypeError),
    ("LayerNormalization", "rms_scaling", "yes", TypeError),
    ("BatchNormalization", "axis", "x", TypeError),
    ("BatchNormalization", "axis", 1.5, TypeError),
    ("BatchNormalization", "momentum", 2.0, ValueError),
    ("BatchNormalization", "momentum", "x", TypeError),
    ("BatchNormalization", "epsilon", -1.0, ValueError),
    ("BatchNormalization", "center", "no", TypeError),
    ("BatchNormalization", "scale", None, TypeError),
    ("BatchNormalization", "synchronized", "no", TypeError),
    ("BatchNormalization", "renorm", 1, TypeError),
    ("GroupNormalization", "axis", "x", TypeError),
    ("GroupNormalization", "epsilon", -1.0, ValueError),
    ("GroupNormalization", "center", "no", TypeError),
    ("GroupNormalization", "scale", "no", TypeError),
    ("RMSNormalization", "axis", "x", TypeError),
    ("RMSNormalization", "axis", [0.5], TypeError),
    ("RMSNormalization", "epsilon", -1.0, ValueError),
    ("Softmax", "axis", "x", TypeError),
    ("Softmax", "axis", 1.5, TypeError),
    ("Softmax", "output_dtype", "bogus", ValueError),
    ("Softmax", "output_dtype", 3, TypeError),
    ("MultiHeadAttention", "num_heads", 0, ValueError),
    ("MultiHeadAttention", "num_heads", "2", ValueError),  # stock's check, pinned by Keras's tests
    ("MultiHeadAttention", "key_dim", 0, ValueError),
    ("MultiHeadAttention", "key_dim", "4", ValueError),  # stock's check, pinned by Keras's tests
    ("MultiHeadAttention", "dropout", 2.0, ValueError),
    ("MultiHeadAttention", "xla_scores", "yes", TypeError),
    ("MultiHeadAttention", "dropout", "x", TypeError),
    ("MultiHeadAttention", "use_bias", "no", TypeError),
    ("MultiHeadAttention", "attention_axes", [1.5], TypeError),
    ("MultiHeadAttention", "flash_attention", True, ValueError),
    ("LSTM", "units", "3", TypeError),
    ("LSTM", "units", 3.0, TypeError),
    ("LSTM", "units", 0, ValueError),
    ("LSTM", "use_bias", "no", TypeError),
    ("LSTM", "dropout", 2.0, ValueError),
    ("LSTM", "recurrent_dropout", -1.0, ValueError),
    ("LSTM", "return_sequences", "no", TypeError),
    ("LSTM", "return_state", 1, TypeError),
    ("LSTM", "go_backwards", "no", TypeError),
    ("LSTM", "stateful", None, TypeError),
    ("LSTM", "unroll", "no", TypeError),
    ("LSTM", "unit_forget_bias", 1, TypeError),
    ("LSTM", "use_cudnn", True, ValueError),
    ("LSTM", "use_cudnn", "x", ValueError),
    ("GRU", "units", "3", TypeError),
    ("GRU", "units", -1, ValueError),
    ("GRU", "use_bias", 0, TypeError),
    ("GRU", "dropout", 2.0, ValueError),
    ("GRU", "recurrent_dropout", NAN, ValueError),
    ("GRU", "return_sequences", "yes", TypeError),
    ("GRU", "return_state", "yes", TypeError),
    ("GRU", "go_backwards", 1, TypeError),
    ("GRU", "stateful", None, TypeError),
    ("GRU", "unroll", "no", TypeError),
    ("GRU", "reset_after", "no", TypeError),
    ("GRU", "use_cudnn", True, ValueError),
    ("LSTMCell", "units", "3", TypeError),
    ("LSTMCell", "units", 0, ValueError),
    ("LSTMCell", "use_bias", "no", TypeError),
    ("LSTMCell", "dropout", 2.0, ValueError),
    ("LSTMCell", "recurrent_dropout", -0.5, ValueError),
    ("LSTMCell", "unit_forget_bias", "no", TypeError),
    ("GRUCell", "units", 1.5, TypeError),
    ("GRUCell", "use_bias", "no", TypeError),
    ("GRUCell", "dropout", "x", TypeError),
    ("GRUCell", "recurrent_dropout", 1.5, ValueError),
    ("GRUCell", "reset_after", 1, TypeError),
    ("Float32", "layer", "dense", TypeError),
    ("Float32", "output_dtype", "bogus", ValueError),
    ("Float32", "output_dtype", "int8", ValueError),
    ("Matmul16DTypePolicy", "source_name", "float32", ValueError),  # a float32 policy has no 16-bit matmuls
    ("Matmul16DTypePolicy", "source_name", "bfloat16", ValueError),  # variables would be 16-bit
    ("Matmul16DTypePolicy", "source_name", keras.DTypePolicy("mixed_bfloat16"), TypeError),
    ("OutputHead", "units", 0, ValueError),
    ("OutputHead", "units", "3", ValueError),  # stock Dense's check, pinned by Keras's tests
    ("OutputHead", "activation", "bogus", ValueError),
    ("OutputHead", "activation", 3, TypeError),
    ("OutputHead", "dtype", "mixed_float16", ValueError),
    ("Logits", "units", 0, ValueError),
    ("Logits", "units", "3", ValueError),  # stock Dense's check
    ("Logits", "activation", "bogus", ValueError),
    ("Logits", "activation", 3, TypeError),
    # callbacks
    ("LossScaleMonitor", "update_freq", "10", TypeError),
    ("LossScaleMonitor", "update_freq", 0, ValueError),
    ("LossScaleMonitor", "counters_in_logs", "yes", TypeError),
    ("LossScaleMonitor", "update_loss_every", 0, ValueError),
    ("LossScaleMonitor", "update_loss_every", "5", TypeError),
    ("LossScaleMonitor", "log_every", "10", TypeError),  # the deprecated names are still checked
    ("LossScaleMonitor", "log_every", 0, ValueError),
    ("LossScaleMonitor", "check_every", 0, ValueError),
    ("LossScaleMonitor", "check_every", 1.5, TypeError),
    ("LossScaleMonitor", "on_nan", "raise", ValueError),
    ("LossScaleMonitor", "on_nan", None, TypeError),
    ("LossScaleMonitor", "probe", [1, 2], TypeError),
    ("LossScaleMonitor", "zero_grad_steps", 0, ValueError),
    ("LossScaleMonitor", "zero_grad_steps", "200", TypeError),
    ("LossScaleMonitor", "val_swing", -0.5, ValueError),
    ("LossScaleMonitor", "val_swing", NAN, ValueError),
    ("LossScaleMonitor", "val_swing", "0.5", TypeError),
    ("LossScaleMonitor", "memory_epochs", 0, ValueError),
    ("LossScaleMonitor", "memory_epochs", 2.5, TypeError),
    ("LossScaleMonitor", "step_time_factor", 0.5, ValueError),
    ("LossScaleMonitor", "step_time_factor", INF, ValueError),
    ("LossScaleMonitor", "step_time_factor", None, TypeError),
    ("LossScaleMonitor", "log_dir", 3, TypeError),
    ("GradientStatistics", "probe", [1, 2], TypeError),
    ("GradientStatistics", "update_freq", 0, ValueError),
    ("GradientStatistics", "update_freq", "100", TypeError),
    ("GradientStatistics", "every_n_steps", 0, ValueError),  # the deprecated name is still checked
    ("GradientStatistics", "every_n_steps", "100", TypeError),
    ("GradientStatistics", "loss", 3, TypeError),
    ("GradientStatistics", "threshold", 1.5, ValueError),
    ("GradientStatistics", "threshold", NAN, ValueError),
    ("GradientStatistics", "threshold", "0.5", TypeError),
    ("GradientStatistics", "log_dir", 3, TypeError),
    # diagnostics
    ("GradientProbe", "model", "model", TypeError),
    ("GradientProbe", "x", None, TypeError),
    ("GradientProbe", "loss", 3, TypeError),
    ("GradientProbe", "loss", "bogus", ValueError),
    ("GradientProbe", "training", "yes", TypeError),
    ("GradientProbe", "jit_compile", 1, TypeError),
    ("audit_model", "model", keras.layers.Dense(2), TypeError),
    ("audit_model", "x", None, TypeError),
    ("audit_model", "training", 1, TypeError),
    ("audit_model", "tree", "tree", TypeError),
    ("audit_model", "backward", "yes", TypeError),
    ("check_model", "model", "model", TypeError),
    ("check_model", "training", "no", TypeError),
    ("find_overflow", "model", "model", TypeError),
    ("find_overflow", "x", None, TypeError),
    ("find_overflow", "loss", 3, TypeError),
    ("find_overflow", "loss", "bogus", ValueError),
    ("find_overflow", "loss_scale", -1.0, ValueError),
    ("find_overflow", "loss_scale", NAN, ValueError),
    ("find_overflow", "loss_scale", "1", TypeError),
    ("find_overflow", "training", "yes", TypeError),
    ("find_overflow", "jit_compile", "yes", TypeError),
    ("find_overflow", "tree", "tree", TypeError),
    ("gradient_statistics", "model", "model", TypeError),
    ("gradient_statistics", "x", None, TypeError),
    ("gradient_statistics", "loss", 3, TypeError),
    ("gradient_statistics", "loss", "bogus", ValueError),
    ("gradient_statistics", "loss_scale", 0.0, ValueError),
    ("gradient_statistics", "loss_scale", "1", TypeError),
    ("gradient_statistics", "training", "yes", TypeError),
    ("saved_activations", "model", "model", TypeError),
    ("saved_activations", "x", None, TypeError),
    ("saved_activations", "loss", 3, TypeError),
    ("saved_activations", "loss", "bogus", ValueError),
    ("saved_activations", "training", "yes", TypeError),
    # automatic precision
    ("Float32Fallback", "probe", "x", TypeError),
    ("Float32Fallback", "max_layers", 0, ValueError),
    ("Float32Fallback", "max_layers", "2", TypeError),
    ("Float32Fallback", "patience", 1.5, TypeError),
    ("Float32Fallback", "patience", 0, ValueError),
    ("Float32Fallback", "check_every", 0, ValueError),
    ("Float32Fallback", "underflow_threshold", 0.0, ValueError),
    ("Float32Fallback", "underflow_threshold", NAN, ValueError),
    ("Float32Fallback", "underflow_threshold", "0.5", TypeError),
    ("Float32Fallback", "probe_batches", "4", TypeError),
    ("Float32Fallback", "probe_batches", 0, ValueError),
    ("ProgressivePrecision", "schedule", {}, ValueError),
    ("ProgressivePrecision", "schedule", ["d1"], TypeError),
    ("ProgressivePrecision", "schedule", {-1: ["d1"]}, ValueError),
    ("ProgressivePrecision", "schedule", {0: "d1"}, TypeError),
    ("ProgressivePrecision", "schedule", {0: ["("]}, ValueError),
    ("ProgressivePrecision", "unit", "batch", ValueError),
    ("ProgressivePrecision", "unit", 1, TypeError),
    ("export_for_inference", "model", "model", TypeError),
    ("export_for_inference", "dtype", "float32", ValueError),
    ("export_for_inference", "dtype", 16, TypeError),
    ("export_for_inference", "keep_float32", "d1", TypeError),
    ("export_for_inference", "keep_float32", [3], TypeError),
    ("export_for_inference", "keep_float32", ["zz"], ValueError),  # matches no layer: was silently nothing
    ("export_for_inference", "keep_float32", ["("], ValueError),
    ("search_precision", "model", "model", TypeError),
    ("search_precision", "data", "x", TypeError),
    ("search_precision", "policy", "float32", ValueError),
    ("search_precision", "policy", 16, TypeError),
    ("search_precision", "budget", "2", TypeError),
    ("search_precision", "budget", -1, ValueError),
    ("search_precision", "tolerance", -1.0, ValueError),
    ("search_precision", "tolerance", NAN, ValueError),
    ("search_precision", "gradient_tolerance", "x", TypeError),
    ("search_precision", "gradient_tolerance", -1.0, ValueError),
    ("search_precision", "batches", 0, ValueError),
    ("search_precision", "batches", 1.5, TypeError),
    ("search_precision", "loss", 3, TypeError),
    ("search_precision", "candidates", "d1", TypeError),
    ("search_precision", "candidates", [3], TypeError),
    ("search_precision", "candidates", ["("], ValueError),  # was a bare re.error
    ("search_precision", "data", tf.data.Dataset.from_tensor_slices(np.ones((4, 4), "float32")).batch(2), ValueError),
    ("search_precision", "candidates", ["nomatch"], ValueError),  # was an empty search
    ("weight_bytes", "model", "model", TypeError),
]

GOOD = [
    ("DeviceInfo", "tpu_count", np.int64(2)),
    ("GpuInfo", "compute_capability", (np.int32(8), np.int64(0))),
    ("LossScaleOptimizer", "dynamic_growth_steps", np.int64(10)),
    ("LossScaleOptimizer", "hysteresis", np.uint8(2)),
    ("LossScaleOptimizer", "initial_scale", np.float32(1024.0)),
    ("LossScaleOptimizer", "dynamic", np.bool_(True)),
    ("ScaleRule", "min_scale_patience", np.int16(3)),
    ("wrap", "dynamic_growth_steps", np.int32(5)),
    ("enable", "tf32", np.bool_(False)),
    ("choose_tier", "num_params", np.int64(10**6)),
    ("global_batch_size", "per_replica_batch_size", np.int64(8)),
    ("per_replica_batch_size", "global_batch_size", np.int32(16)),
    ("prepare", "per_replica_batch_size", np.int64(2)),
    ("tf_config", "index", np.int64(1)),
    ("LossScaleMonitor", "update_freq", np.int64(10)),
    ("LossScaleMonitor", "val_swing", np.float32(0.25)),
    ("GradientStatistics", "update_freq", np.int32(5)),
    ("RMSNormalization", "axis", np.int64(-1)),
    ("RMSNormalization", "epsilon", np.float32(1e-5)),
    ("LSTM", "units", np.int64(3)),
    ("LSTM", "dropout", np.float64(0.25)),
    ("Float32Fallback", "max_layers", np.int64(3)),
    ("search_precision", "tolerance", np.float32(0.5)),
    ("find_overflow", "loss_scale", np.float32(1024.0)),
    ("verify", "timeout_seconds", np.float64(30.0)),
]


def _names(message: str, argument: str) -> bool:
    """The message names `argument`: `argument`, `argument ...`, argument=..., argument[i] or in a
    list of unknown names."""
    a = re.escape(argument)
    return re.search(rf"`{a}[`\[ ]|\b{a}(=|\[)|argument\(s\): (\w+, )*{a}\b", message) is not None


def _id(row):
    value = row[2]
    shown = repr(value) if isinstance(value, (str, int, float, list, tuple, dict, set, type(None))) else type(value).__name__
    return f"{row[0]}-{row[1]}-{shown}"[:80]


@pytest.mark.parametrize("row", BAD, ids=[_id(r) for r in BAD])
def test_bad_value_raises_naming_the_argument(row):
    api, argument, value, error = row
    with pytest.raises(Exception) as info:
        API[api][1](**{argument: value})
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert _names(str(info.value), argument), str(info.value)


@pytest.mark.parametrize("row", GOOD, ids=[_id(r) for r in GOOD])
def test_numpy_numbers_are_accepted(row):
    api, argument, value = row
    API[api][1](**{argument: value})


def _parameters(target):
    """The arguments a row must cover: the signature's, less self, *args and **kwargs; for a
    keras_amp layer over a stock one, also the stock arguments keras_amp checks itself."""
    fn = target.__init__ if isinstance(target, type) else target
    if not fn.__module__.startswith("keras_amp"):
        return set(getattr(target, "ARGUMENT_CHECKS", ()))  # a stock constructor, inherited
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    names |= set(getattr(target, "ARGUMENT_CHECKS", ()))
    if target is local_cluster.python_argv:
        names.add("args")  # *args: the row passes them as `args=`
    return names


@pytest.mark.parametrize("api", sorted(API))
def test_every_parameter_has_a_row(api):
    covered = {argument for name, argument, _, _ in BAD if name == api}
    covered |= {argument for name, argument in ANY_VALUE if name == api}
    missing = _parameters(API[api][0]) - covered
    assert not missing, f"{api}: add BAD rows for {sorted(missing)}"


def _public_callables():
    """(qualified name, object) for every public callable of `PUBLIC_MODULES`, modules left out."""
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None)
        if names is None:
            names = [n for n, o in vars(module).items()
                     if not n.startswith("_") and getattr(o, "__module__", None) == module_name]
        for name in names:
            obj = getattr(module, name)
            if callable(obj) and not inspect.ismodule(obj):
                yield f"{module_name}.{name}", obj


def test_every_public_callable_is_registered():
    registered = {id(target) for target, _ in API.values()}
    found = dict(_public_callables())
    assert len(found) > 60  # guard: the walk reached the subpackages
    missing = sorted(q for q, obj in found.items() if id(obj) not in registered and q not in EXCLUDED
                     and not any(q2 in EXCLUDED for q2, o2 in found.items() if o2 is obj))
    assert not missing, f"register in API (or list in EXCLUDED, with the reason): {missing}"
    stale = sorted(q for q in EXCLUDED if q not in found)
    assert not stale, f"EXCLUDED names no public callable: {stale}"


def test_a_failed_enable_leaves_nothing_behind():
    before = keras.config.dtype_policy().name
    for name, argument, value, _ in BAD:
        if name == "enable":
            with pytest.raises((TypeError, ValueError)):
                API["enable"][1](**{argument: value})
    assert not keras_amp.config().enabled and keras.config.dtype_policy().name == before
