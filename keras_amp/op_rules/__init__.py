"""Op-level float32 rules: numerically sensitive Keras ops compute in float32 under a 16-bit policy.

While `keras_amp.enable()` is in force with a float16 or bfloat16 compute dtype, the ops marked
"keras_amp" in `RULES` compute in float32 whichever layer, model or user function calls them
(Sequential, functional with operator nodes, subclassed, keras-hub). `disable()` restores every
replaced Keras object exactly. `rules_markdown()` prints the table.

Modules:
    table: the rules (`RULES`), the pinned Keras sources, what no rule reaches.
    float32_ops: float32 replacements of single ops (softmax, normalisation, losses, float16 arange).
    upcast_recompute: float32 normalisation, gelu and cross-entropy that keep 16-bit tensors, not float32
        copies, for the backward pass.
    dropout: 16-bit inputs' keep masks from half the random words (speed).
    bias_add: bfloat16 bias gradients summed with float32 accumulation (TF's CPU kernel sums in bfloat16).
    einsum_rows: an activation times a weight (EinsumDense) as one 2-D matmul of its rows: kernel gradient
        rounded once, bias fused.
    fused_layer_norm: layer normalisation's forward pass as oneDNN's fused float32 kernel, on a CPU.
    fused_batch_norm: batch normalisation of an upcast 16-bit activation as TensorFlow's fused kernels
        (speed, CPU), and the round-trip cast.
    attention: float32 attention scores in MultiHeadAttention and `ops.dot_product_attention`.
    dataflow: attention scores and normalisation statistics found by what the traced graph
        computes (a matmul of two activations feeding a softmax; a root of a mean of squares),
        rebuilt in float32.
    matmul: the matmul rule that makes `Matmul16DTypePolicy` layers' matmuls 16-bit.
    installer: replacing and restoring the Keras objects, driven by `keras_amp.enable()`.
"""

from keras_amp.op_rules.installer import (
    ORIGINALS,
    install,
    installed,
    replaced,
    rule_installed,
    source_digests,
    uninstall,
    why_not_installed,
)
from keras_amp.op_rules.table import (
    ATTENTION_OP,
    BIAS_GRADIENT_OP,
    BOTH,
    FLOAT16,
    GELU_BACKWARD_OP,
    HAZARD_DTYPES,
    LOW_PRECISION,
    MATMUL16_OP,
    NOT_REACHED,
    RULES,
    DOT_PRODUCT_ATTENTION_OP,
    NORM_STAT_OP,
    SCORES_OP,
    Rule,
    rules_markdown,
)

__all__ = [
    "ATTENTION_OP",
    "BIAS_GRADIENT_OP",
    "BOTH",
    "DOT_PRODUCT_ATTENTION_OP",
    "FLOAT16",
    "GELU_BACKWARD_OP",
    "HAZARD_DTYPES",
    "LOW_PRECISION",
    "MATMUL16_OP",
    "NORM_STAT_OP",
    "NOT_REACHED",
    "ORIGINALS",
    "RULES",
    "Rule",
    "SCORES_OP",
    "install",
    "installed",
    "replaced",
    "rule_installed",
    "rules_markdown",
    "source_digests",
    "uninstall",
    "why_not_installed",
]
