"""Keras's own test files for each stock layer, run against the keras_amp subclass.

Drop-in means drop-in: every `keras_amp.layers` class, `keras_amp.LossScaleOptimizer` and
`keras_amp.optimizers.LeanAdam` / `LeanAdamW` must pass the tests Keras ships for the class it
subclasses or stands in for (Keras 3.15.1, `keras/src/layers/**/*_test.py`,
`keras/src/optimizers/{loss_scale_optimizer,adam,adamw,optimizer}_test.py`).

Mechanism: each Keras test file is executed as a fresh module (its own globals, so the
real `keras.src...._test` modules are untouched), then the names its tests look up at
call time (`layers`, or the `softmax` module) are replaced by copies in which the stock
class is ours; a class imported by name (`LossScaleOptimizer`) is replaced itself. Its `testing.TestCase` classes are exposed here under `Keras<Class>_...`
names for pytest to collect. Where ours deliberately differs, the test is skipped with
the reason written in DIVERGENCES (the table is also in BUILD_NOTES.md).
"""

import fnmatch
import importlib.util
import os
import sys
import types
import unittest

import keras

from keras_amp import layers as amp_layers
from keras_amp.optimizers.lean_adam import LeanAdam, LeanAdamW
from keras_amp.optimizers.loss_scale_optimizer import LossScaleOptimizer

KERAS_SRC_DIR = os.path.join(os.path.dirname(keras.__file__), "src")
KERAS_LAYERS_DIR = os.path.join(KERAS_SRC_DIR, "layers")

# Keras test file (relative to keras/src/layers) -> {global name in that file: {stock name: ours}}.
SUITES = {
    "activations/softmax_test.py": {"softmax": {"Softmax": amp_layers.Softmax}},
    "normalization/layer_normalization_test.py": {"layers": {"LayerNormalization": amp_layers.LayerNormalization}},
    "normalization/batch_normalization_test.py": {"layers": {"BatchNormalization": amp_layers.BatchNormalization}},
    "normalization/group_normalization_test.py": {"layers": {"GroupNormalization": amp_layers.GroupNormalization}},
    "normalization/rms_normalization_test.py": {"layers": {"RMSNormalization": amp_layers.RMSNormalization}},
    "attention/multi_head_attention_test.py": {"layers": {"MultiHeadAttention": amp_layers.MultiHeadAttention}},
    "rnn/lstm_test.py": {"layers": {"LSTM": amp_layers.LSTM, "LSTMCell": amp_layers.LSTMCell}},
    "rnn/gru_test.py": {"layers": {"GRU": amp_layers.GRU, "GRUCell": amp_layers.GRUCell}},
    "core/dense_test.py": {"layers": {"Dense": amp_layers.OutputHead}},
    "core/wrapper_test.py": {"layers": {"Wrapper": amp_layers.Float32}},
    # Relative to keras/src/layers, like the rest; the test file imports the class by name.
    "../optimizers/loss_scale_optimizer_test.py": {"LossScaleOptimizer": LossScaleOptimizer},
    # LeanAdam subclasses Adam; LeanAdamW is LeanAdam with AdamW's default decay (Keras's AdamW tests).
    "../optimizers/adam_test.py": {"Adam": LeanAdam},
    "../optimizers/adamw_test.py": {"AdamW": LeanAdamW},
    # The base optimizer's tests, run on Adam: gradient accumulation is not among them (LeanAdam refuses it).
    "../optimizers/optimizer_test.py": {"optimizers": {"Adam": LeanAdam}},
}

_QUANTIZE = (
    "Keras's `Dense.quantize` refuses every subclass (`type(self) is not Dense`, Keras 3.15.1), "
    "and OutputHead is the float32 loss input: quantizing it is not its purpose"
)
_FLOAT32_ONLY = (
    "run_layer_test's mixed-precision check builds the layer with dtype='mixed_float16'; "
    "OutputHead computes in float32 by contract and refuses a non-float32 policy"
)

_LEAN_REFUSES = (
    "LeanAdam refuses `amsgrad` and `use_ema` (ValueError): a float32 maximum of the second moment, or a "
    "float32 moving average of every weight, would take back the bytes its 16-bit storage saves"
)

# fnmatch pattern of "<file>::<TestCase>.<method>" -> why ours differs from stock there, on purpose.
DIVERGENCES = {
    "../optimizers/adam_test.py::AdamTest.test_config": _LEAN_REFUSES,
    "../optimizers/adam_test.py::AdamTest.test_correctness_with_golden": _LEAN_REFUSES,
    "../optimizers/adam_test.py::AdamTest.test_ema*": _LEAN_REFUSES,
    "../optimizers/adamw_test.py::AdamWTest.test_config": _LEAN_REFUSES,
    "../optimizers/optimizer_test.py::OptimizerTest.test_optimizer_auto_naming": (
        "Keras names an optimizer after its class: LeanAdam's default name is 'lean_adam'"
    ),
    "../optimizers/optimizer_test.py::OptimizerTest.test_set_weights": (
        "LeanAdam.build on weights none of which keras_amp.memory.prepare stored in 16 bits waits for "
        "prepare (Keras's model loading and fit's symbolic build call build first); the first apply "
        "builds it as Keras's Adam, with an AmpWarning (tests/optimizers/test_lean_adam.py)"
    ),
    **{
        f"core/dense_test.py::DenseTest.{pattern}": _QUANTIZE
        for pattern in (
            "test_awq_*",
            "test_gptq_*",
            "test_int4_*",
            "test_dense_int*_quantizer",
            "test_dense_quantize_config_*",
            "test_quantize_by_setting_dtype_policy_*",
            "test_quantize_dtype_argument_*",
            "test_quantize_float8*",
            "test_quantize_int_*",
            "test_quantize_lora_integration_*",
            "test_quantize_when_already_quantized_*",
        )
    },
    "core/dense_test.py::DenseTest.test_dense_basics": _FLOAT32_ONLY,
    "core/dense_test.py::DenseTest.test_dense_sparse": _FLOAT32_ONLY,
    "core/dense_test.py::DenseTest.test_lora_rank_argument": _FLOAT32_ONLY,
    "../optimizers/loss_scale_optimizer_test.py::LossScaleOptimizerTest.test_init_dynamic_arg": (
        "keras_amp.LossScaleOptimizer(dynamic=False) is static loss scaling (a fixed scale, non-finite "
        "steps still skipped); stock Keras 3 removed it and raises ValueError"
    ),
    "../optimizers/loss_scale_optimizer_test.py::LossScaleOptimizerTest.test_serialization": (
        "the test counts the config's keys (4); keras_amp's get_config returns all 12 constructor "
        "arguments (tier, min_scale, max_scale, growth_factor, backoff_factor, hysteresis, dynamic, "
        "on_min_scale besides stock's 4), and the values it checks are tested in "
        "tests/optimizers/test_loss_scale_optimizer.py"
    ),
    "core/wrapper_test.py::WrapperTest.test_wrapper_invalid_layer": (
        "house rule: a wrong type raises TypeError (stock Wrapper raises ValueError for a non-layer)"
    ),
}


def _divergence(key):
    return next((reason for pattern, reason in DIVERGENCES.items() if fnmatch.fnmatchcase(key, pattern)), None)


def _patched(original, replacements):
    """A copy of module `original` whose attributes `replacements` are ours."""
    copy = types.ModuleType(original.__name__)
    copy.__dict__.update(vars(original))
    copy.__dict__.update(replacements)
    return copy


def _load(relative_path, patches):
    path = os.path.join(KERAS_LAYERS_DIR, relative_path)
    # Registered under a `keras.` name (in sys.modules only) so that Keras's deserializer,
    # which imports the module of an unregistered class only for keras packages, finds the
    # helper classes a test file defines (wrapper_test's ExampleWrapper).
    stem = relative_path.replace("../", "").replace("/", "_").removesuffix(".py")
    name = "keras.src.layers.keras_amp_suite_" + stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    for global_name, replacements in patches.items():
        if isinstance(replacements, dict):
            replacements = _patched(getattr(module, global_name), replacements)
        setattr(module, global_name, replacements)
    return module


def _ours(patches):
    """The names of our classes in `patches`."""
    found = []
    for replacements in patches.values():
        found += [t.__name__ for t in (replacements.values() if isinstance(replacements, dict) else [replacements])]
    return "_".join(found)


def _collect():
    collected = {}
    for relative_path, patches in SUITES.items():
        module = _load(relative_path, patches)
        for cls_name, cls in vars(module).items():
            if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)) or cls.__module__ != module.__name__:
                continue
            ours = _ours(patches)
            # A subclass per file, so skips below never touch the Keras class itself.
            suite = type(f"Keras{cls_name}_{ours}", (cls,), {"__module__": __name__})
            for method in dir(suite):
                reason = _divergence(f"{relative_path}::{cls_name}.{method}")
                if reason is not None and method.startswith("test"):
                    setattr(suite, method, unittest.skip(reason)(getattr(suite, method)))
            collected[suite.__name__] = suite
    return collected


globals().update(_collect())
