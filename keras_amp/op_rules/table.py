"""The op table: which Keras ops compute in float32 under a 16-bit policy, how, and why.

`RULES` is the one table (`rules_markdown()` prints it); `RELIED_ON` names what a rule relies on
besides its targets (keras_amp._compat pins both); `NOT_REACHED` lists what no op-level rule
reaches. `keras_amp.op_rules.installer` applies the rows marked "keras_amp".

Output dtype convention (the table's "output" column), in the spirit of TF grappler's
auto-mixed-precision lists and torch.autocast's "fp32" / "promote" policies:

    runs in float32, output "input dtype": inputs cast up, computed, result cast back to the
        caller's dtype, so the next matmul inside the layer stays in the compute dtype (Keras
        promotes float16 + float32 to float32, which would make it a float32 matmul);
    runs in float32, output "float32": losses; their value is reduced and logged in float32;
    runs in "widest input": Keras's own promotion of mixed inputs (no override);
    runs in "compute dtype": left alone, with the reason.
"""

from __future__ import annotations

import dataclasses

# The dtype vocabulary (`keras_amp.dtypes`), re-exported as `op_rules.LOW_PRECISION` etc.
from keras_amp.dtypes import BOTH, FLOAT16, HAZARD_DTYPES, LOW_PRECISION  # noqa: F401
from keras_amp.op_rules.dropout import DROPOUT
from keras_amp.op_rules.dropout import RELIED_ON as DROPOUT_RELIED_ON


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of the op table.

    Args:
        op: String. The public op(s), as users call them.
        kind: String. Hazard family, shared with the dynamic audit: "softmax", "attention",
            "normalization", "exp", "loss", "reduction" or "" (not sensitive).
        runs_in: String. "float32", "compute dtype" or "widest input".
        output: String. The result's dtype: "input dtype", "float32", "compute dtype", "widest".
        dtypes: Tuple of strings. The 16-bit compute dtypes the rule is for (where the op is a
            hazard; for a rule of kind "" that fixes no hazard, the compute dtypes it is
            installed under); empty when it is neither.
        by: String. "keras_amp" (replaced while enabled), "keras" (Keras 3.15.1 already does
            it) or "none" (left alone on purpose).
        targets: Tuple of strings. Qualified names of the Keras objects replaced while enabled.
        reason: String. Why.
    """

    op: str
    kind: str
    runs_in: str
    output: str
    dtypes: tuple[str, ...]
    by: str
    targets: tuple[str, ...]
    reason: str


TF_NN = "keras.src.backend.tensorflow.nn"
MHA_COMPUTE = "keras.src.layers.attention.multi_head_attention.MultiHeadAttention._compute_attention"
MHA_CALL = "keras.src.layers.attention.multi_head_attention.MultiHeadAttention.call"
LAYER_CALL = "keras.src.layers.layer.Layer.__call__"
LAYER_OPEN_SCOPE = "keras.src.layers.layer.Layer._open_name_scope"
# The memory half of the normalisation rules (`keras_amp.op_rules.upcast_recompute`).
LEAN = (
    "Memory: the backward pass keeps the 16-bit input, not its float32 upcast, and redoes the "
    "exact upcast there (graph mode; a float32 input that is no upcast is kept as is)"
)
MATMUL = "keras.src.backend.tensorflow.numpy.matmul"
XLA_CONTEXT = "tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext"
# The TF backend's convolutions the convolution-gradient rule replaces.
CONVOLUTIONS = tuple(f"{TF_NN}.{name}" for name in ("conv", "depthwise_conv", "separable_conv", "conv_transpose"))
ADD = "keras.src.backend.tensorflow.numpy.add"
EINSUM = "keras.src.backend.tensorflow.numpy.einsum"
CAST = "keras.src.backend.tensorflow.core.cast"
FUSED_BATCH_NORM_OP = "moments and batch_normalization of a float32 or upcast 16-bit activation (BatchNormalization)"
ROUND_TRIP_CAST_OP = "cast of an exact float32 upcast back to its 16-bit dtype"
GROUPED_CONV_OP = "grouped convolution with one input channel per group (a depthwise one) on a CPU"
BIAS_GRADIENT_OP = "bias add (Dense, EinsumDense, convolution biases: `add` of a channel vector), backward pass"
CONV_GRADIENT_OP = ("convolution (Conv, DepthwiseConv, SeparableConv, ConvTranspose layers) on a CPU without 16-bit "
                    "convolution kernels, backward pass")
EINSUM_ROWS_OP = "einsum of an activation by a weight (EinsumDense's equations), graph mode"
MATMUL16_OP = "matmul in a layer with a Matmul16DTypePolicy (the \"rnn\" recipe's recurrences)"
UNAUTOCAST_WEIGHT_OP = "matmul of a 16-bit activation by a weight read without autocasting"
UPCAST_WEIGHT_OP = "matmul or einsum of a 16-bit activation by a weight on a CPU without 16-bit matmul kernels"
ATTENTION_OP = "MultiHeadAttention scores (QK^T, scale, mask, softmax)"
GELU_BACKWARD_OP = "gelu, backward pass"
SCORES_OP = "attention scores feeding softmax / log_softmax (any matmul, einsum or `@` of two activations)"
NORM_STAT_OP = "rsqrt, sqrt of a normalisation statistic (a mean or sum of squares or deviations)"
DOT_PRODUCT_ATTENTION_OP = "dot_product_attention"
SQRT = "keras.src.backend.tensorflow.numpy.sqrt"
RSQRT = "keras.src.backend.tensorflow.math.rsqrt"
LOGSUMEXP = "keras.src.backend.tensorflow.math.logsumexp"
EXP = "keras.src.backend.tensorflow.numpy.exp"
SOFTMAX_EXP_OP = "exp(x - logsumexp(x, axis, keepdims=True))"
DPA = f"{TF_NN}._dot_product_attention_xla"
RULES: tuple[Rule, ...] = (
    Rule("softmax", "softmax", "float32", "input dtype", BOTH, "keras_amp", (f"{TF_NN}.softmax",),
         "exp and the normaliser (a sum over the axis) in float32, one rounding at the end; the "
         "backward sum over the axis runs in float32 too"),
    Rule("log_softmax", "softmax", "float32", "input dtype", BOTH, "keras_amp", (f"{TF_NN}.log_softmax",),
         "the float16 normaliser overflows past 65504 terms: over 70000 classes stock gives -inf"),
    Rule(SCORES_OP, "attention", "float32", "float32 (into the softmax)", BOTH, "keras_amp",
         (f"{TF_NN}.softmax", f"{TF_NN}.log_softmax"),
         "found by dataflow, not by names: in graph mode the softmax's input is walked back through "
         "scale, bias, mask, add, reshape, transpose, gather, slice and cast to the first matmul "
         "on each path; a matmul of two activations (no weight operand) with a 16-bit result is "
         "a score term (DeBERTa has three). The chain is rebuilt in float32: each term a 16-bit "
         "product with float32 accumulation (XLA-compiled) and 16-bit gradient matmuls (on a CPU "
         "without 16-bit matmul kernels, float32 kernels on exact upcasts, rounded once), the ops "
         "after it in float32; the 16-bit originals are left without a consumer and pruned. A "
         "16-bit infinite constant on the chain (T5's `(1 - mask) * -1e9` in float16) is rebuilt "
         "as float32's largest finite value / 1024. Value matmuls and Dense layers are not on such a "
         "path and keep the compute dtype; eager execution has no graph to walk"),
    Rule(NORM_STAT_OP, "normalization", "float32", "input dtype", BOTH, "keras_amp", (RSQRT, SQRT),
         "found by dataflow: in graph mode a root whose argument comes (through + eps, a scale, "
         "E[x^2] - E[x]^2) from a mean or sum of squares or deviations, with a 16-bit op on that "
         "chain, is rebuilt in float32 from the 16-bit values being normalised (T5's "
         "`x * rsqrt(mean(x**2) + eps)`: float16 squares overflow past |x| = 256); the result is "
         "rounded to the dtype the layer's code expects"),
    Rule(DOT_PRODUCT_ATTENTION_OP, "attention", "float32", "compute dtype", BOTH, "keras_amp", (DPA,),
         "Keras's TensorFlow kernel computes QK^T in the inputs' dtype and casts it up for the "
         "softmax, after a float16 overflow; the rule computes it as 16-bit products with float32 "
         "accumulation, then the same scale, bias, mask and float32 softmax, and the value "
         "einsum in the compute dtype (as the score gradients: float32 kernels on exact upcasts, rounded "
         "once, on a CPU without 16-bit matmul kernels)"),
    Rule("logsumexp", "softmax", "float32", "input dtype", BOTH, "keras_amp", (LOGSUMEXP,),
         "TF sums exp(x - max) in the input dtype: inf in float16 past 65504 terms; the logits are "
         "the softmax rule's (score matmuls found by dataflow, rebuilt in float32)"),
    Rule(SOFTMAX_EXP_OP, "softmax", "float32", "input dtype", BOTH, "keras_amp", (EXP,),
         "probabilities written without a softmax (what `keras.layers.Softmax` computes over two or "
         "more axes): in graph mode an exp of `x` minus the logsumexp rule's result for `x` is a float32 "
         "softmax over that axis of the softmax rule's logits, rounded once; QK^T past 65504 made "
         "`inf - inf` (NaN) in float16. Any other exp is the original"),
    Rule(ATTENTION_OP, "attention", "float32", "compute dtype",
         BOTH, "keras_amp", (MHA_COMPUTE,),
         "QK^T sums key_dim products: entries near 300 overflow float16 (NaN softmax); bfloat16 "
         "rounds logits to 8 bits. QK^T: an XLA-compiled 16-bit matmul with float32 accumulation "
         "and result (a float32 matmul under `enable(xla_scores=False)`); probabilities rounded "
         "once to the compute dtype, softmax gradient in float32. Value einsum and score gradients "
         "in the compute dtype (float32 kernels on exact upcasts, rounded once, on a CPU without 16-bit "
         "matmul kernels); subclasses that keep the stock method (keras-hub) get it too"),
    Rule(MATMUL16_OP, "", "compute dtype", "float32", BOTH, "keras_amp", (MATMUL,),
         "a float32 layer (gates, nonlinearities, carried state, bias and output in float32) whose "
         "matmuls take 16-bit operands: cast(matmul(cast(a), cast(b)), float32), float32 "
         "accumulation, one rounding; the input and recurrent projections are an RNN's cost, its "
         "gates and state its hazard. A product by a weight runs on float32 kernels from the exact "
         "upcasts, forward and backward, each rounded once, on a CPU without 16-bit matmul kernels "
         "(Eigen's: no oneDNN bfloat16, no float16 instructions; slower than float32's, and the "
         "bfloat16 one truncates), outside XLA and SavedModel export; keras_amp.layers.LSTM and GRU's "
         "likewise. Only when the innermost calling layer has the policy; every other matmul is the "
         "original"),
    Rule(UNAUTOCAST_WEIGHT_OP, "", "compute dtype", "float32", BOTH, "keras_amp", (MATMUL,),
         "a mixed layer that turned autocasting off (Keras's Embedding) multiplying a 16-bit activation by "
         "its own float32 weight: ReversibleEmbedding's reverse projection, keras-hub's vocabulary head, "
         "reads the weight in float32 and upcasts the activation (a float32 matmul of the largest weight; "
         "Keras documents the compute dtype). Computed as 16-bit operands with float32 accumulation and "
         "Keras's float32 result, so a frozen head weight is stored in 16 bits with the same results. A "
         "float32 activation (reverse_dtype=\"float32\") and autocast layers are left alone"),
    Rule(BIAS_GRADIENT_OP, "", "float32", "input dtype", ("bfloat16",), "keras_amp", (ADD,),
         "TensorFlow's CPU BiasAddGrad sums bfloat16 in bfloat16: 16,384 rows of 1.0 sum to 256 (stock trains "
         "every bias on that); the rule keeps the forward bias_add and sums the bias gradient with float32 "
         "accumulation (a bfloat16 matmul by ones where oneDNN runs bfloat16 natively, else TF's Sum, which "
         "accumulates in float32; a float32 copy's sum on a GPU), rounded once. A bias after a projection's "
         "reshaped 2-D matmul (Dense on a sequence, EinsumDense under the einsum rule) is added to the matmul's "
         "rows, which oneDNN fuses (one rounding)"),
    Rule(CONV_GRADIENT_OP, "", "float32", "input dtype", BOTH, "keras_amp", CONVOLUTIONS,
         "speed: without oneDNN's native bfloat16 (AVX2-only CPUs, oneDNN off) TensorFlow's 16-bit convolutions "
         "are Eigen's, whose two backward kernels take many times float32's time (most of a CNN's step in stock "
         "mixed_bfloat16); the rule keeps the forward convolution and computes both gradients with float32 "
         "kernels from exact upcasts, each rounded once (the depthwise and separable ones too; a transposed "
         "convolution's forward pass, itself an input-gradient kernel, stays Keras's). Not on a GPU, TPU or a CPU "
         "with native bfloat16 (for bfloat16), nor under XLA; except there a bfloat16 depthwise or separable "
         "convolution other than 2-D 3x3 at stride 1, whose oneDNN gradient kernels took 2-20x float32's"),
    Rule(GROUPED_CONV_OP, "", "compute dtype", "input dtype", BOTH, "keras_amp", (f"{TF_NN}.conv",),
         "speed: Keras runs a grouped convolution on a CPU as an XLA computation, whose convolutions took 5-40x "
         "the time of TensorFlow's depthwise kernels (forward + backward, float32 and bfloat16 alike); with one "
         "input channel per group it is a depthwise convolution (keras.applications' ConvNeXt, keras-hub's "
         "MobileNet), and the rule runs it as TensorFlow's, its kernel reshaped, with the depthwise convolutions' "
         "gradients above; where the 16-bit kernels are Eigen's (float16 on most CPUs), the forward pass too from "
         "float32 kernels on exact upcasts, rounded once. Not on a GPU or TPU, under XLA, while a SavedModel is "
         "written, channels first, nor with several input channels per group (Keras's XLA computation)"),
    Rule(UPCAST_WEIGHT_OP, "", "float32", "input dtype", BOTH, "keras_amp", (MATMUL, EINSUM),
         "speed and rounding: without oneDNN's native bfloat16 (AVX2-only CPUs, oneDNN off), and for float16 on "
         "a CPU without float16 instructions, TensorFlow's 16-bit matmuls are Eigen's, slower than its float32 "
         "ones and truncating their sums (bfloat16). Dense's and "
         "EinsumDense's products (an autocast weight, or a variable's value in graph mode) run on float32 "
         "kernels from exact upcasts, forward and backward, each rounded once. Not on other devices, under XLA "
         "or in SavedModel export. Attention's products of two activations do the same inside the attention "
         "rules (value product, score gradients); a value product the model writes itself stays TF's"),
    Rule(EINSUM_ROWS_OP, "", "compute dtype", "compute dtype", BOTH, "keras_amp", (EINSUM,),
         "Keras's TF einsum writes an EinsumDense as a batched matmul by the kernel broadcast over the batch: "
         "its kernel gradient is a product per batch element, each rounded to 16 bits, then summed (57.6% "
         "of entries correctly rounded, bfloat16), and no bias fuses into it. The rule rebuilds it as one "
         "2-D matmul of the input's rows (the same dot products): the kernel gradient one float32-"
         "accumulated matmul, rounded once (99.98%), and the bias add beside it"),
    Rule("batch_normalization", "normalization", "float32", "input dtype", BOTH, "keras_amp",
         (f"{TF_NN}.batch_normalization",),
         "x*inv - mean*inv cancels catastrophically in 16 bits when |mean| >> std; float32 "
         "statistics with 16-bit x are accepted (stock raises on mixed dtypes). " + LEAN),
    Rule(FUSED_BATCH_NORM_OP, "", "float32", "input dtype", BOTH, "keras_amp",
         (f"{TF_NN}.moments", f"{TF_NN}.batch_normalization"),
         "speed, the same float32 arithmetic: in graph mode on a CPU, channels last, the moments over every "
         "axis but the last and the normalisation with per-channel statistics (the batch's, or moving ones) "
         "run as TensorFlow's FusedBatchNormV3 and FusedBatchNormGradV3 on the 16-bit tensor itself "
         "(float32 statistics and arithmetic, y rounded once) instead of float32 ops over float32 copies; "
         "a float32 layer's activation (the cnn recipe's stem) likewise, in float32; "
         "channels first, GPUs and TPUs keep the rows below"),
    Rule(ROUND_TRIP_CAST_OP, "", "compute dtype", "input dtype", BOTH, "keras_amp", (CAST,),
         "speed: in graph mode `cast(cast(x16, float32), x16.dtype)` is x16 itself, the same values and "
         "gradient without two passes over the activation (Keras casts a normalisation's float32 result "
         "back to the compute dtype)"),
    Rule("moments", "normalization", "float32", "input dtype", BOTH, "keras_amp", (f"{TF_NN}.moments",),
         "Keras casts 16-bit inputs to float32 and clips the statistics to float16's range, bfloat16's too "
         "(a variance of 7.5e4 comes back as 65536); the rule computes the same ops and clips float16's "
         "only. " + LEAN),
    Rule("layer_normalization", "normalization", "float32", "input dtype", BOTH, "keras_amp",
         ("keras.src.ops.nn._layer_normalization",),
         "Keras computes it in float32; the rule computes the same ops (over the last axis on a CPU with oneDNN, "
         "the forward pass is one fused float32 kernel: the same numbers, the same gradient). " + LEAN),
    Rule("normalize", "normalization", "float32", "input dtype", BOTH, "keras_amp",
         ("keras.src.ops.nn._normalize",),
         "the sum of squares overflows float16 (|x| ~ 300 over 64 entries): stock returns zeros"),
    Rule("std", "reduction", "float32", "input dtype", FLOAT16, "keras_amp", ("keras.src.backend.tensorflow.numpy.std",),
         "squared deviations overflow float16; Keras upcasts var but not std"),
    Rule("norm", "reduction", "float32", "input dtype", FLOAT16, "keras_amp",
         ("keras.src.backend.tensorflow.linalg.norm",),
         "Keras computes it with TensorFlow ops in the input dtype: the sum of squares overflows float16 (|x| ~ 300 "
         "over 64 entries: stock returns inf)"),
    Rule("arange with dtype float16", "", "float32", "input dtype", FLOAT16, "keras_amp",
         ("keras.src.backend.tensorflow.numpy.arange",),
         "TF has no float16 Range kernel: in a graph, `ops.arange(..., dtype=\"float16\")` fails at graph "
         "construction in stock Keras (keras-hub ESM, RoFormerV2, Flux, D-FINE and SAM3 build position or "
         "timestep tables with it); computed as a float32 range cast to float16"),
    Rule("dropout", "", "compute dtype", "input dtype", BOTH, "keras_amp", (DROPOUT,),
         "speed, no hazard: a 16-bit input's keep mask is drawn as two 16-bit integers per 32-bit "
         "random word, half the words of stock's one uniform number per element (keep probability "
         "1 - rate to within 2^-17); the kept values and the gradient are Keras's `x / (1 - rate)` "
         "through that mask. Another random stream than stock's for the same seed, still "
         "deterministic per seed; float32 inputs keep stock's"),
    Rule("gelu", "exp", "float32", "input dtype", FLOAT16, "keras_amp", (f"{TF_NN}.gelu",),
         "the tanh approximation evaluates x**3 (Pow): its gradient 3x**2 overflows float16 past "
         "|x| = 256 and stock's gradient is NaN (inf * 0); bfloat16 has the range"),
    Rule(GELU_BACKWARD_OP, "", "float32", "input dtype", BOTH, "keras_amp", (f"{TF_NN}.gelu",),
         "memory: TensorFlow's gelu is composite (0.5 x erfc(-x/sqrt(2)), or the tanh form), so "
         "its autodiff keeps three activation-sized tensors; the rule keeps only the 16-bit x and "
         "evaluates the derivative Phi(x) + x phi(x) (or the tanh form's) in float32 from it. The "
         "forward pass is float32 too, rounded once (the row above). Under `enable(xla_scores=True)` "
         "each direction is one XLA computation from the 16-bit x (no float32 tensor between ops)"),
    Rule("silu", "", "compute dtype", "input dtype", BOTH, "keras_amp", (f"{TF_NN}.silu",),
         "memory: TensorFlow's silu is a tf.custom_gradient, whose graph-mode gradient closure is never "
         "freed, so every traced graph through it stayed alive with the variables it captured (a LoRA "
         "model kept its float32 frozen weights beside their 16-bit copies); the rule runs on "
         "keras_amp's custom_gradient, freed with its graph. Speed: on a 16-bit input under "
         "`enable(xla_scores=True)` the backward pass is one XLA computation in float32, rounded once "
         "(TensorFlow's: six 16-bit ops), and so is the forward pass except for bfloat16 where oneDNN "
         "runs it natively (TensorFlow's two ops are faster there)"),
    Rule("categorical_crossentropy", "loss", "float32", "float32", BOTH, "keras_amp",
         (f"{TF_NN}.categorical_crossentropy", "keras.src.ops.nn.CategoricalCrossentropy.compute_output_spec"),
         "a loss is reduced, scaled and logged in float32; 16-bit results round to 8-11 bits"),
    Rule("sparse_categorical_crossentropy", "loss", "float32", "float32", BOTH, "keras_amp",
         (f"{TF_NN}.sparse_categorical_crossentropy",
          "keras.src.ops.nn.SparseCategoricalCrossentropy.compute_output_spec"),
         "as categorical_crossentropy. With logits, the backward pass recomputes softmax - onehot "
         "from the 16-bit logits instead of keeping it in float32 (one vocabulary-sized float32 "
         "tensor less; the same gradient bit for bit)"),
    Rule("binary_crossentropy", "loss", "float32", "float32", BOTH, "keras_amp",
         (f"{TF_NN}.binary_crossentropy", "keras.src.ops.nn.BinaryCrossentropy.compute_output_spec"),
         "small per-element losses (< 6e-8) flush to 0 in float16"),
    Rule("rms_normalization", "normalization", "float32", "input dtype", BOTH, "keras", (),
         "Keras computes it in at least float32"),
    Rule("mean, var", "reduction", "float32", "input dtype", FLOAT16, "keras", (),
         "Keras reduces in float32 and casts back"),
    Rule("ctc_loss; keras.losses.* classes", "loss", "float32", "float32", BOTH, "keras", (),
         "Keras casts to float32 (a Loss casts y_pred to its float32 dtype)"),
    Rule("sum", "reduction", "compute dtype", "input dtype", FLOAT16, "none", (),
         "TF accumulates 16-bit sums in float32; the hazard is a result above 65504, which a "
         "cast back cannot fix and a float32 result would change the op's dtype contract"),
    Rule("exp, expm1", "exp", "compute dtype", "input dtype", FLOAT16, "none", (),
         "TF evaluates them in float32 and rounds once; exp(x > 11.09) overflows the float16 "
         "result itself, so the fix is a float32 layer (the audit names it); exp of `x - logsumexp(x)` "
         "is a softmax (its own row)"),
    Rule("log, log1p, softplus, log_sigmoid", "", "compute dtype", "input dtype", (), "none", (),
         "the result fits the input's range and TF's kernels round once (measured <= 1 ulp)"),
    Rule("add, multiply, matmul, einsum, ... (mixed inputs)", "", "widest input", "widest", (), "keras", (),
         "Keras promotes float16 + float32 to float32; the next layer casts back to its compute dtype"),
)

# The rules' targets and what they rely on are pinned (source digests) in keras_amp._compat.PINS.
# Relied on, not replaced: `MultiHeadAttention.call` passes `use_causal_mask` only when
# `type(self)._compute_attention is MultiHeadAttention._compute_attention`; the matmul rule reads the
# calling layer from the name-scope stack: `Layer.__call__` calls `call` inside `_open_name_scope()`,
# which enters `backend.name_scope(self.name, caller=self)`; the TensorFlow backend's name_scope (and
# its common base) push the entry, `.caller` included, onto the global "name_scope_stack".
_NAME_SCOPE_STACK = (
    LAYER_CALL,
    LAYER_OPEN_SCOPE,
    "keras.src.backend.tensorflow.core.name_scope",
    "keras.src.backend.common.name_scope.name_scope",
)
RELIED_ON = {
    DROPOUT: DROPOUT_RELIED_ON,
    MHA_COMPUTE: (MHA_CALL,),
    DPA: (f"{TF_NN}._apply_masks",),
    MATMUL: _NAME_SCOPE_STACK,
    **{name: (XLA_CONTEXT,) for name in CONVOLUTIONS},
    f"{TF_NN}.conv": (XLA_CONTEXT, f"{TF_NN}.depthwise_conv"),  # grouped convolutions as depthwise ones
}

# What no op-level rule reaches (README "what op-level rules cannot reach").
NOT_REACHED = (
    "raw `tf.*` calls (`tf.nn.softmax`, `tf.math.rsqrt`, `tf.exp`, ...): they bypass Keras's "
    "backend functions, which are where the rules sit; the audit (`audit_model`, `check_model` "
    "with a batch) reports each such op that ran in 16 bits, with its layer",
    "eager execution: the dataflow rules (attention scores, normalisation statistics) read the "
    "traced graph, and an eager tensor has no producer to read; `fit`, `predict` and any "
    "`tf.function` trace. The softmax and normalisation rules still compute in float32 from the "
    "16-bit input; the audit traces a step and reports the QK^T it would run in 16 bits",
    "score chains through ops outside the walk's list (a custom op, a `tf.custom_gradient`, a `tf.while_loop` or "
    "another function call between the matmul and the softmax, a chain over 400 ops): left "
    "as written; the audit names the matmul in 16 bits. Roots written as `x ** -0.5` or "
    "`1 / x ** 0.5` are not recognised as statistics (the audit lists Pow in float16 as an "
    "exp-type hazard)",
    "scores that pass through a matmul by a weight before the softmax (talking-heads attention mixing its "
    "heads with a learned matrix: the walk stops there, and the audit reports no 16-bit QK^T); "
    "probabilities written as `exp(s - logsumexp(s))` are reached only when the logsumexp is "
    "`keras.ops.logsumexp(s, keepdims=True)` of the same `s`, subtracted directly",
    "fused RNN kernels (cuDNN) and flash attention (`flash_attention=True` on "
    "MultiHeadAttention, the user's explicit choice of a fused kernel; the TensorFlow backend has "
    "none for `ops.dot_product_attention`)",
    "LSTM/GRU gate and state precision in a cell with a 16-bit policy: the recurrence runs in "
    "the cell's compute dtype (the \"rnn\" recipe's `Matmul16DTypePolicy` and "
    "`keras_amp.layers.LSTM` / `GRU` keep it float32); matmuls written as einsum or convolutions "
    "in a `Matmul16DTypePolicy` layer stay float32 (the recurrence's dtype is a layer's policy, "
    "not an op: `check_model` reports a 16-bit cell as low_precision_recurrence)",
    "code that casts for itself: a rule sees the dtype it is given, so a value already rounded "
    "(or overflowed) to 16 bits before the op stays rounded; a float32 input stays float32 (the "
    "audit records the dtype each sensitive op actually ran in)",
    "results whose range is the hazard (exp(x > 11.09), a sum above 65504 in float16): the "
    "output dtype contract is kept, so these need a float32 layer (`apply_recipe` rules); the "
    "audit lists Exp and forward Sum/Mean in float16 with their layer",
    "gradient reductions TensorFlow's autodiff inserts (broadcast `Sum`s) in the compute dtype; "
    "the loss-scale optimizer skips a step whose gradients overflow, and `find_overflow` names "
    "the layer whose gradient did",
)


def rules_markdown() -> str:
    """`RULES` (and what they cannot reach) as a markdown table, for README."""
    lines = [
        "| op | kind | runs in | output | hazard in | applied by | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in RULES:
        cells = (r.op, r.kind or "-", r.runs_in, r.output, ", ".join(r.dtypes) or "-", r.by, r.reason)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", "Op-level rules cannot reach:", ""] + [f"- {item}" for item in NOT_REACHED]
    return "\n".join(lines)

