"""`check_model()`: a report of a model's mixed-precision hazards, each with its fix.

Findings are data (`Finding(kind, layer, message, fix)`) so diagnostics can build on them; the
report's `str()` is for people. Two sources, each finding from evidence, never from a name:

- the dynamic op audit (`keras_amp.diagnostics.audit_model`) of one batch, `x` or, without one, a
  probe batch of ones shaped like the model's inputs: every sensitive op that ran in 16 bits, by
  the layer whose call created it ("low_precision_normalization" for normalisation statistics,
  "low_precision_op" for the rest). Where no batch can be made (a subclassed model never called
  on symbolic inputs) the report's `notes` say so;
- a static read of Keras layer types, activations, dtype policies, variables, output specs and
  the compiled optimizer/loss, knowing which op rules (`keras_amp.op_rules`) are in force: the
  configuration findings (loss scaling, tensor-core dimensions, variables, staleness; outputs by
  what their loss computes from them, `keras_amp.diagnostics.outputs`)
  and the softmax / exp / recurrence / attention layers Keras defines; a graph layer's own ops are
  traced for a root of a mean of squares (`layer_kinds.normalization_dtype`).

A report only: it warns about nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import keras

from keras_amp import hardware, layer_kinds, model_graph, op_rules
from keras_amp import policy as amp_policy
from keras_amp import validation
from keras_amp.diagnostics import audit
from keras_amp.diagnostics.evidence import audit_findings, probe_batch
from keras_amp.diagnostics.finding import KINDS, Finding
from keras_amp.diagnostics.outputs import output_findings
from keras_amp.dtypes import LOW_PRECISION
from keras_amp.memory import frozen

# Stock BatchNormalization / RMSNormalization compute their statistics in float32 but autocast
# their inputs to the compute dtype first, so float32 inputs > 65504 become inf under
# mixed_float16; the audit sees only float32 statistics, so this one is read from the type. Flagged
# unless a graph shows only 16-bit layers feeding them. Guarded in test_keras_guards_recipes.py.
_INPUT_AUTOCAST_NORMS = (keras.layers.BatchNormalization, keras.layers.RMSNormalization)
@dataclasses.dataclass(frozen=True)
class ModelReport:
    """All findings for one model, in `KINDS` order then model order.

    Args:
        model: String. The model's name.
        findings: Tuple of `Finding`s.
        notes: Tuple of strings. How the ops were audited (a probe batch), or why they were not.
    """

    model: str
    findings: tuple[Finding, ...]
    notes: tuple[str, ...] = ()

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
            lines = [f"check_model({self.model!r}): no findings"]
        else:
            lines = [f"check_model({self.model!r}): {len(self.findings)} finding(s)"]
        for f in self.findings:
            lines.append(f"  [{f.kind}] {f.layer}: {f.message}")
            lines.append(f"      fix: {f.fix}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def _descends(layer) -> bool:
    """Whether the walk visits `layer`'s children (not for islands, recurrent or attention layers)."""
    return not (model_graph.is_island(layer) or isinstance(layer, (keras.layers.RNN, keras.layers.MultiHeadAttention)))


def _output_dtype(layer) -> str:
    """The dtype a layer hands on: an island's (its float32 result) or its compute dtype."""
    return "float32" if model_graph.is_island(layer) else layer.compute_dtype


def _op_finding(path: str, layer, fed: tuple[str, ...] | None = None) -> Finding | None:
    dtype = layer.compute_dtype
    if dtype not in LOW_PRECISION or model_graph.is_island(layer):
        return None
    name = type(layer).__name__
    float32_fix = (
        f"compute it in float32: dtype='float32' on the layer, keras_amp.layers.Float32(...), or "
        f"apply_recipe(..., rules={{{layer.name!r}: 'float32'}})"
    )
    if isinstance(layer, keras.layers.MultiHeadAttention):
        # The op rule computes the scores in float32 for this class and every subclass that keeps
        # the stock `_compute_attention` (flash attention is left to stock).
        stock_method = type(layer)._compute_attention is keras.layers.MultiHeadAttention._compute_attention
        if stock_method and not getattr(layer, "_flash_attention", False) and op_rules.rule_installed(op_rules.ATTENTION_OP):
            return None
        return Finding(
            "low_precision_softmax", path,
            f"{name} computes QK^T logits in {dtype}, and its softmax too when dropout > 0 "
            f"(here {layer.dropout}) or attention scores are returned",
            "keras_amp.enable() (its op rules compute the scores of keras.layers.MultiHeadAttention and of "
            "subclasses that keep its _compute_attention in float32; not with flash_attention=True), or "
            "keras_amp.layers.MultiHeadAttention",
        )
    if isinstance(layer, keras.layers.RNN):
        cell_dtype = getattr(getattr(layer, "cell", None), "compute_dtype", dtype)
        if cell_dtype not in LOW_PRECISION:
            return None  # a float32 cell (the "rnn" recipe inside a model's own code): gates and state float32
        return Finding(
            "low_precision_recurrence", path,
            f"{name} computes its gates and carries its state in {dtype}; the state rounds at every step",
            "apply_recipe(model, 'rnn') (stock RNNs then keep gates and state in float32 with 16-bit "
            "matmuls), keras_amp.layers.LSTM / GRU, or dtype='float32'",
        )
    kind = layer_kinds.op_kind(layer)
    if kind == "softmax" and op_rules.rule_installed("softmax") and op_rules.rule_installed("log_softmax"):
        return None  # keras.ops.softmax / log_softmax compute in float32 while the op rules are in force
    if kind == "softmax":
        return Finding("low_precision_softmax", path, f"{name} computes a softmax in {dtype}", float32_fix)
    if kind == "exp" and dtype == "float16":  # bfloat16 has float32's range: exp does not overflow.
        return Finding(
            "low_precision_exp", path, f"{name} computes an exp/log-type activation in float16 (exp overflows above 11.1)",
            float32_fix,
        )
    if kind == "normalization" and isinstance(layer, _INPUT_AUTOCAST_NORMS):
        if fed and all(d in LOW_PRECISION for d in fed):
            return None  # fed by 16-bit layers only: its input autocast rounds nothing
        return Finding(
            "low_precision_normalization", path,
            f"{name} autocasts its inputs to {dtype} before its float32 statistics "
            "(float32 inputs above 65504 overflow in float16; bfloat16 keeps 8 significant bits)",
            f"use keras_amp.layers.{name} (apply_recipe(model, 'cnn') sets it to float32) or {float32_fix}",
        )
    if kind == "normalization":
        # Evidence: the layer's own traced ops (None outside a graph: the audit attributes those).
        stats = layer_kinds.normalization_dtype(layer)
        if stats not in LOW_PRECISION:
            return None
        return Finding(
            "low_precision_normalization", path,
            f"{name}'s ops take a root of a mean of squares in {stats} (squares overflow float16 "
            "past 256; bfloat16 keeps 8 significant bits)",
            f"cast to float32 inside its call (as keras-hub's RMS norms do), or {float32_fix}",
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
    elif isinstance(layer, model_graph.CONV_LAYERS) and hasattr(layer, "filters"):
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


def _dimension_findings(path: str, layer, device: hardware.DeviceInfo) -> list[Finding]:
    # Multiples of 8 decide whether a 16-bit matmul runs on tensor cores; a CPU or TPU has none.
    if layer.compute_dtype not in LOW_PRECISION or not device.tensor_cores(layer.compute_dtype):
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


def check_model(model: keras.Model, x: Any = None, *, training: bool = False,
                device: hardware.DeviceInfo | None = None, loss: Any = None) -> ModelReport:
    """Checks `model` for mixed-precision hazards; returns a `ModelReport` of `Finding`s.

    Kinds (see `KINDS`): softmax / exp / loss / recurrence layers computing in 16 bits; every
    sensitive op that ran in 16 bits in one batch, by the layer that created it and op kind (the
    dynamic audit: normalisation statistics as "low_precision_normalization", the rest as
    "low_precision_op"); a model output that is not float32, unless its loss reads it only as
    logits of a float32 log-softmax (then a note says so); float16 or bfloat16 variables; a
    float16 model compiled without a `LossScaleOptimizer`; Dense/Conv/Embedding/attention
    dimensions not divisible by 8 in 16-bit layers (on GPUs with tensor cores for that dtype); a
    bfloat16 model compiled with `jit_compile=True` on a CPU with oneDNN's bfloat16 kernels (XLA does
    not use them); a model built before `enable()`. Layers whose
    ops compute in float32 (keras-hub's RMS norms, Keras's normalisation layers, keras_amp's
    islands, what the op rules in force cover) are not flagged, whatever they are called.

    Args:
        model: A `keras.Model` (Sequential, functional or subclassed; build it first so its
            variables and outputs are known).
        x: None (default) or one batch of the model's input (array, or the dict/list the model
            takes). The model runs it forward and backward once (`audit_model`). None: a probe
            batch of ones shaped like `model.input` (batch 2, other unknown dimensions 8) runs
            instead, and adds only the ops no static finding covers; without input specs (a
            subclassed model called eagerly) nothing runs and `notes` say so.
        training: Bool, default False. The `training` flag of that run.
        device: `hardware.DeviceInfo` or None (default: this machine's). Dimensions not divisible
            by 8 are reported only where its GPUs have tensor cores for the layer's dtype; XLA only
            where XLA skips fast bfloat16 kernels (`DeviceInfo.xla_skips_fast_bfloat16`).
        loss: None (default: the compiled loss) or the loss the outputs feed, for a model trained
            in a custom loop: a `keras.losses.Loss`, a loss function or name, or a list/dict of
            them per output as `compile` takes. It is traced on a 16-bit tensor shaped like each
            16-bit output: one read only by a float32 softmax cross-entropy from logits (or
            log_softmax) is a deliberate choice, reported in `notes`, not as a finding.

    Example:
        >>> report = keras_amp.check_model(model, x)
        >>> print(report)                       # one line per finding, with its fix
        >>> [f.layer for f in report.of_kind("low_precision_op")]
    """
    validation.check_type("model", model, keras.Model, "a keras.Model")
    validation.check_bool("training", training)
    validation.check_type("device", device, (hardware.DeviceInfo, type(None)), "a keras_amp.hardware.DeviceInfo or None")
    device = hardware.detect() if device is None else device
    tree = model_graph.layer_tree(model)  # the one walk of the model; every finding below reads it
    built = model.built
    layers = list(model_graph.walk(model, into=_descends, tree=tree))
    fed = model_graph.neighbour_dtypes(model, _output_dtype, upstream=True, tree=tree)
    found: list[Finding] = []
    # A wrapper's op finding already covers its inner layer (op_kind looks inside wrappers):
    # TimeDistributed(Dense(activation="softmax")) is one softmax, not two.
    covered: list[str] = []
    for path, layer in layers:
        finding = None
        if not any(path.startswith(f"{c}/") for c in covered):
            finding = _op_finding(path, layer, fed.get(id(layer)))
        if finding:
            found.append(finding)
            if isinstance(layer, keras.layers.Wrapper):
                covered.append(path)
        found.extend(_dimension_findings(path, layer, device))
    found.extend(_loss_findings(model))
    report, probed, note = None, False, None
    if x is not None:
        report = audit.audit_model(model, x, training=training, tree=tree)
    else:
        batch, note = probe_batch(model)
        if batch is not None:
            try:
                report, probed = audit.audit_model(model, batch, training=training, tree=tree), True
            except Exception as e:  # noqa: BLE001 - ones may not be a valid input; the report says so
                note = (f"not audited: the probe batch of ones could not run ({type(e).__name__}: {e}); "
                        "pass x= for the op findings")
    # The outputs' dtypes as the traced call gave them, where it ran: a layer's output spec may say otherwise.
    outputs_found, notes = output_findings(model, loss, ran=report.output_dtypes if report else None,
                                           ran_layers=report.output_layers if report else None)
    found.extend(outputs_found)
    if report is not None:
        found.extend(audit_findings(model, report, found, probe=probed))
    if note is not None:
        notes.append(note)
    if not built:
        tree = model_graph.layer_tree(model)  # the audit built it: sublayers made in build() are new
    found.extend(_variable_findings(layers, tree, _stored_16bit_on_purpose(model)))
    found.extend(_scaling_findings(model, layers))
    found.extend(_xla_findings(model, layers, device))
    found.extend(_stale_findings(model, tree))
    order = {kind: i for i, kind in enumerate(KINDS)}
    findings = tuple(sorted(found, key=lambda f: order[f.kind]))  # stable: model order within a kind
    return ModelReport(model=model.name, findings=findings, notes=tuple(notes))


def _stale_findings(model, tree: model_graph.LayerTree) -> list[Finding]:
    config = amp_policy.config()
    if not model_graph.is_stale(model, tree=tree):
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


def _stored_16bit_on_purpose(model) -> set[int]:
    """ids of the variables keras_amp stores in 16 bits itself: frozen weights (`enable(frozen_weights=)`),
    and the weights LeanAdam keeps in 16 bits beside their float32 masters."""
    kept = {id(v) for v in model.weights if frozen.is_frozen_16bit(v)}
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if hasattr(inner, "keeps_16bit"):
        kept.update(id(v) for v in model.trainable_weights if inner.keeps_16bit(v))
    return kept


def _variable_findings(layers, tree: model_graph.LayerTree, on_purpose: set[int] = frozenset()) -> list[Finding]:
    findings = []
    for path, layer in layers:
        # Children's weights are reported at the children, but only for children the walk visits:
        # an MHA/RNN/island layer reports every variable it (transitively) owns.
        children = tree.children(layer) if _descends(layer) else []
        inner = {id(v) for child in children for v in child.weights} | on_purpose
        dtypes = sorted({v.dtype for v in layer.weights if id(v) not in inner and v.dtype in LOW_PRECISION})
        for dtype in dtypes:
            findings.append(Finding(
                "low_precision_variables", path,
                f"variables are stored in {dtype}: small updates round away and float16 ones overflow to inf/NaN",
                f"use the mixed_{dtype} policy (float32 variables, {dtype} compute) instead of {dtype!r}",
            ))
    return findings


def _weighted_paths(layers, dtype: str) -> list[str]:
    """The paths of the layers with weights that compute in `dtype`."""
    return [path for path, layer in layers if layer.compute_dtype == dtype and layer.weights]


def _scaling_findings(model, layers) -> list[Finding]:
    optimizer = getattr(model, "optimizer", None)
    if not getattr(model, "compiled", False) or optimizer is None:
        return []
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return []
    fp16 = _weighted_paths(layers, "float16")
    if not fp16:
        return []
    return [Finding(
        "no_loss_scaling", model.name,
        f"{len(fp16)} layer(s) compute in float16 (e.g. {fp16[0]!r}) but the optimizer "
        f"{type(optimizer).__name__} does not scale the loss: small gradients underflow to 0. Keras only "
        f"auto-wraps when the model's own policy is mixed_float16 (here {model.dtype_policy.name})",
        "compile with keras_amp.optimizers.LossScaleOptimizer(optimizer) (or keras.optimizers.LossScaleOptimizer)",
    )]


def _xla_findings(model, layers, device: hardware.DeviceInfo) -> list[Finding]:
    # The compiled bfloat16 step loses what bfloat16 bought (BUILD_NOTES: "`jit_compile=True` on a CPU").
    # Keras's jit_compile="auto" leaves XLA off without GPUs or TPUs.
    if (not getattr(model, "compiled", False) or getattr(model, "jit_compile", False) is not True
            or not device.xla_skips_fast_bfloat16):
        return []
    bf16 = _weighted_paths(layers, "bfloat16")
    if not bf16:
        return []
    return [Finding(
        "xla_on_cpu", model.name,
        f"compiled with jit_compile=True, and {len(bf16)} layer(s) compute in bfloat16 (e.g. {bf16[0]!r}); on "
        f"this {device.summary()} XLA's matmuls and convolutions do not use oneDNN's bfloat16 kernels, so "
        "the compiled step can be slower than without XLA, even than float32",
        "compile with jit_compile=False (what jit_compile='auto', Keras's default, picks on a machine "
        "without GPUs or TPUs)",
    )]
