"""`check_model()`: a static report of a model's mixed-precision hazards, each with its fix.

Findings are data (`Finding(kind, layer, message, fix)`) so diagnostics can build on them; the
report's `str()` is for people. Nothing is run: the check reads layer classes, dtype policies,
variables, output specs and the compiled optimizer/loss.
"""

from __future__ import annotations

import dataclasses

import keras

from keras_amp import layers as amp_layers
from keras_amp import policy as amp_policy
from keras_amp import recipes

LOW_PRECISION = ("float16", "bfloat16")
# Finding kinds, in the order the report lists them.
KINDS = (
    "built_before_enable",
    "low_precision_softmax",
    "low_precision_normalization",
    "low_precision_exp",
    "low_precision_loss",
    "low_precision_recurrence",
    "output_not_float32",
    "low_precision_variables",
    "no_loss_scaling",
    "dimension_not_multiple_of_8",
)
# Stock normalisation layers that take float32 inputs as they are and compute in float32
# (Keras 3.15.1). Stock BatchNormalization / RMSNormalization also compute their statistics in
# float32 but autocast their inputs to the compute dtype first, so float32 inputs > 65504 become
# inf under mixed_float16: they are flagged. Both facts guarded in test_keras_guards_recipes.py.
_FLOAT32_INSIDE_NORMS = (keras.layers.LayerNormalization, keras.layers.GroupNormalization)
_INPUT_AUTOCAST_NORMS = (keras.layers.BatchNormalization, keras.layers.RMSNormalization)
# keras_amp's float32-island layers: correct by construction under any policy, not descended into.
_ISLANDS = (
    amp_layers.Softmax,
    amp_layers.LayerNormalization,
    amp_layers.BatchNormalization,
    amp_layers.GroupNormalization,
    amp_layers.RMSNormalization,
    amp_layers.MultiHeadAttention,
    amp_layers.LSTM,
    amp_layers.GRU,
    amp_layers.Float32,
    amp_layers.OutputHead,
)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One hazard.

    Args:
        kind: String. One of `keras_amp.check.KINDS`.
        layer: String. Path of the layer concerned ("block/conv"), or the model name for
            model-wide findings.
        message: String. What is wrong and why it matters.
        fix: String. What to change.
    """

    kind: str
    layer: str
    message: str
    fix: str


@dataclasses.dataclass(frozen=True)
class ModelReport:
    """All findings for one model, in `KINDS` order then model order."""

    model: str
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        """True when there are no findings."""
        return not self.findings

    def kinds(self) -> set[str]:
        """The distinct finding kinds present."""
        return {f.kind for f in self.findings}

    def of_kind(self, kind: str) -> list[Finding]:
        """The findings of one kind."""
        if kind not in KINDS:
            raise ValueError(f"Unknown finding `kind`. Received: kind={kind!r}. Allowed: {', '.join(KINDS)}")
        return [f for f in self.findings if f.kind == kind]

    def __str__(self) -> str:
        if self.ok:
            return f"check_model({self.model!r}): no findings"
        lines = [f"check_model({self.model!r}): {len(self.findings)} finding(s)"]
        for f in self.findings:
            lines.append(f"  [{f.kind}] {f.layer}: {f.message}")
            lines.append(f"      fix: {f.fix}")
        return "\n".join(lines)


def _children(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    # Keras 3.15 API (also used by summary()); guarded in tests/test_keras_guards_recipes.py.
    return list(layer._flatten_layers(include_self=False, recursive=False))


def _descends(layer, islands: tuple[type, ...]) -> bool:
    """Whether `_walk` visits `layer`'s children (not for islands, recurrent or attention layers)."""
    return not isinstance(layer, islands + (keras.layers.RNN, keras.layers.MultiHeadAttention))


def _walk(layer, prefix: str, islands: tuple[type, ...], out: list) -> None:
    """(path, layer) pairs; float32 islands and recurrent/attention layers are not descended into."""
    for child in _children(layer):
        if isinstance(child, keras.layers.InputLayer):
            continue
        path = f"{prefix}{child.name}"
        out.append((path, child))
        if _descends(child, islands):
            _walk(child, f"{path}/", islands, out)


def _op_finding(path: str, layer, islands: tuple[type, ...]) -> Finding | None:
    dtype = layer.compute_dtype
    if dtype not in LOW_PRECISION or isinstance(layer, islands):
        return None
    name = type(layer).__name__
    float32_fix = (
        f"compute it in float32: dtype='float32' on the layer, keras_amp.layers.Float32(...), or "
        f"apply_recipe(..., rules={{{layer.name!r}: 'float32'}})"
    )
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return Finding(
            "low_precision_softmax", path,
            f"{name} computes QK^T logits in {dtype}, and its softmax too when dropout > 0 "
            f"(here {layer.dropout}) or attention scores are returned",
            "use keras_amp.layers.MultiHeadAttention (apply_recipe(model, 'transformer') swaps it in)",
        )
    if isinstance(layer, keras.layers.RNN):
        return Finding(
            "low_precision_recurrence", path,
            f"{name} computes its gates and carries its state in {dtype}; the state rounds at every step",
            "use keras_amp.layers.LSTM / GRU (apply_recipe(model, 'rnn') swaps them in), or dtype='float32'",
        )
    kind = recipes.op_kind(layer)
    if kind == "softmax":
        return Finding("low_precision_softmax", path, f"{name} computes a softmax in {dtype}", float32_fix)
    if kind == "exp" and dtype == "float16":  # bfloat16 has float32's range: exp does not overflow.
        return Finding(
            "low_precision_exp", path, f"{name} computes an exp/log-type activation in float16 (exp overflows above 11.1)",
            float32_fix,
        )
    if kind == "normalization" and isinstance(layer, _INPUT_AUTOCAST_NORMS):
        return Finding(
            "low_precision_normalization", path,
            f"{name} autocasts its inputs to {dtype} before its float32 statistics "
            "(float32 inputs above 65504 overflow in float16; bfloat16 keeps 8 significant bits)",
            f"use keras_amp.layers.{name} (apply_recipe(model, 'cnn') sets it to float32) or {float32_fix}",
        )
    if kind == "normalization" and not isinstance(layer, _FLOAT32_INSIDE_NORMS):
        return Finding(
            "low_precision_normalization", path,
            f"{name} computes normalisation statistics in {dtype} (squares overflow or lose precision)",
            f"use a keras_amp.layers normalisation layer or {float32_fix}",
        )
    if kind == "loss":
        return Finding(
            "low_precision_loss", path,
            f"{name}'s activity regularizer computes its penalty on {dtype} activations",
            float32_fix,
        )
    return None


def _dims(layer) -> dict[str, int]:
    """The matmul/conv dimensions that decide tensor-core use, by argument name."""
    dims: dict[str, int] = {}
    if isinstance(layer, keras.layers.Dense):
        dims["units"] = layer.units
        if layer.built:
            dims["input dimension"] = int(layer.kernel.shape[0])
    elif isinstance(layer, keras.layers.Embedding):
        dims["output_dim"] = layer.output_dim
    elif isinstance(layer, keras.layers.MultiHeadAttention):
        dims["key_dim"] = layer.key_dim
        dims["value_dim"] = layer.value_dim
    elif isinstance(layer, recipes.CONV_LAYERS) and hasattr(layer, "filters"):
        dims["filters"] = layer.filters
        if not layer.built or isinstance(layer, _DEPTHWISE):
            pass
        elif isinstance(layer, _SEPARABLE):
            # The pointwise kernel (1, ..., in_channels * depth_multiplier, filters) is the matmul.
            dims["input channels"] = int(layer.pointwise_kernel.shape[-2])
        elif isinstance(layer, _TRANSPOSE):
            dims["input channels"] = int(layer.kernel.shape[-1])  # kernel (..., filters, in_channels)
        else:
            dims["input channels"] = int(layer.kernel.shape[-2]) * getattr(layer, "groups", 1)
    return {k: v for k, v in dims.items() if v is not None}


_DEPTHWISE = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)
_SEPARABLE = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
_TRANSPOSE = (keras.layers.Conv1DTranspose, keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose)


def _dimension_findings(path: str, layer) -> list[Finding]:
    if layer.compute_dtype not in LOW_PRECISION:
        return []
    bad = {k: v for k, v in _dims(layer).items() if v % 8}
    if not bad:
        return []
    desc = ", ".join(f"{k}={v}" for k, v in bad.items())
    pad = ", ".join(f"{k} {v} -> {-(-v // 8) * 8}" for k, v in bad.items())
    return [Finding(
        "dimension_not_multiple_of_8", path,
        f"{type(layer).__name__} has {desc}, not a multiple of 8: {layer.compute_dtype} matmuls miss tensor cores",
        f"pad to a multiple of 8 ({pad}), or compute this layer in float32 if it is small",
    )]


def check_model(model: keras.Model) -> ModelReport:
    """Checks `model` for mixed-precision hazards; returns a `ModelReport` of `Finding`s.

    Kinds (see `KINDS`): softmax / normalisation / exp / loss / recurrence computed in 16 bits;
    a model output that is not float32; float16 or bfloat16 variables; a float16 model compiled
    without a `LossScaleOptimizer`; Dense/Conv/Embedding/attention dimensions not divisible by 8
    in 16-bit layers. Keras's built-in normalisation layers, which upcast internally, and
    keras_amp's float32-island layers are not flagged.

    Args:
        model: A `keras.Model` (Sequential, functional or subclassed; build it first so its
            variables and outputs are known).

    Example:
        >>> report = keras_amp.check_model(model)
        >>> print(report)                       # one line per finding, with its fix
        >>> [f.layer for f in report.of_kind("output_not_float32")]
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"`model` must be a keras.Model. Received: model of type {type(model).__name__}")
    islands = _ISLANDS
    layers: list = []
    _walk(model, "", islands, layers)
    found: list[Finding] = []
    # A wrapper's op finding already covers its inner layer (op_kind looks inside wrappers):
    # TimeDistributed(Dense(activation="softmax")) is one softmax, not two.
    covered: list[str] = []
    for path, layer in layers:
        finding = None
        if not any(path.startswith(f"{c}/") for c in covered):
            finding = _op_finding(path, layer, islands)
        if finding:
            found.append(finding)
            if isinstance(layer, keras.layers.Wrapper):
                covered.append(path)
        found.extend(_dimension_findings(path, layer))
    found.extend(_loss_findings(model))
    found.extend(_output_findings(model))
    found.extend(_variable_findings(layers, islands))
    found.extend(_scaling_findings(model, layers))
    found.extend(_stale_findings(model))
    order = {kind: i for i, kind in enumerate(KINDS)}
    findings = tuple(sorted(found, key=lambda f: order[f.kind]))  # stable: model order within a kind
    return ModelReport(model=model.name, findings=findings)


def _stale_findings(model) -> list[Finding]:
    config = amp_policy.config()
    if not amp_policy.warn_if_built_before_enable(model, caller="check_model"):
        return []
    return [Finding(
        "built_before_enable", model.name,
        f"no Dense/Conv/Embedding/attention layer computes in keras_amp.enable()'s {config.policy!r}: "
        "the model was probably built before enable(), so mixed precision does nothing for it",
        "build the model after keras_amp.enable(), or convert it with keras_amp.apply_recipe()",
    )]


def _loss_findings(model) -> list[Finding]:
    losses = keras.tree.flatten(getattr(model, "loss", None)) if getattr(model, "compiled", False) else []
    return [
        Finding(
            "low_precision_loss", model.name,
            f"compiled loss {getattr(loss, 'name', type(loss).__name__)!r} computes in {loss.dtype}",
            "construct the loss without dtype= (Keras losses compute in float32 by default)",
        )
        for loss in losses
        if isinstance(loss, keras.losses.Loss) and loss.dtype in LOW_PRECISION
    ]


def _output_findings(model) -> list[Finding]:
    try:
        outputs = keras.tree.flatten(model.outputs)
    except (AttributeError, ValueError):  # subclassed or unbuilt: output dtypes unknown statically
        return []
    return [
        Finding(
            "output_not_float32", t._keras_history.operation.name,
            f"model output {i} is {t.dtype}: the loss and metrics see {t.dtype}-rounded values",
            "make the last layer float32 (keras_amp.layers.OutputHead, dtype='float32', or apply_recipe)",
        )
        for i, t in enumerate(outputs)
        if keras.backend.is_float_dtype(t.dtype) and t.dtype != "float32"
    ]


def _variable_findings(layers, islands: tuple[type, ...]) -> list[Finding]:
    findings = []
    for path, layer in layers:
        # Children's weights are reported at the children, but only for children `_walk` visits:
        # an MHA/RNN/island layer reports every variable it (transitively) owns.
        children = _children(layer) if _descends(layer, islands) else []
        inner = {id(v) for child in children for v in child.weights}
        dtypes = sorted({v.dtype for v in layer.weights if id(v) not in inner and v.dtype in LOW_PRECISION})
        for dtype in dtypes:
            findings.append(Finding(
                "low_precision_variables", path,
                f"variables are stored in {dtype}: small updates round away and float16 ones overflow to inf/NaN",
                f"use the mixed_{dtype} policy (float32 variables, {dtype} compute) instead of {dtype!r}",
            ))
    return findings


def _scaling_findings(model, layers) -> list[Finding]:
    optimizer = getattr(model, "optimizer", None)
    if not getattr(model, "compiled", False) or optimizer is None:
        return []
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return []
    fp16 = [path for path, layer in layers if layer.compute_dtype == "float16" and layer.weights]
    if not fp16:
        return []
    return [Finding(
        "no_loss_scaling", model.name,
        f"{len(fp16)} layer(s) compute in float16 (e.g. {fp16[0]!r}) but the optimizer "
        f"{type(optimizer).__name__} does not scale the loss: small gradients underflow to 0. Keras only "
        f"auto-wraps when the model's own policy is mixed_float16 (here {model.dtype_policy.name})",
        "compile with keras_amp.optimizers.LossScaleOptimizer(optimizer) (or keras.optimizers.LossScaleOptimizer)",
    )]
