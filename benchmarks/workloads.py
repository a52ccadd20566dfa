"""The benchmark suite's three workloads and its precision configurations.

Workloads (sizes of the recorded figures; `--quick` keeps the architectures and measures fewer
steps, `--smoke` shrinks everything to check that the code runs):

    cnn          ResNet-style CNN with BatchNorm, 32x32x3 images, batch 128, 10 classes
    transformer  2-block pre-norm Transformer LM, d256, 4 heads, ff 1024, seq 128, batch 32,
                 causal attention, dropout 0.1, a Dense head over a 2048-token vocabulary
    lstm         2x LSTM(256) language model, embedding 128, seq 64, batch 64, vocabulary 1000
    gru          the same with 2x GRU(256)

Configurations (`NAME_POLICY`):

    float32      everything float32
    stock_bf16   `keras.config.set_dtype_policy("mixed_bfloat16")`, stock layers, Adam
    amp_bf16     `keras_amp.enable("mixed_bfloat16")`, the stock model built, then
                 `model = keras_amp.apply_recipe(model, recipe)` and `keras_amp.wrap(Adam)`
    stock_fp16   mixed_float16 with Keras's `LossScaleOptimizer(Adam)`
    amp_fp16     as amp_bf16 under mixed_float16 (wrap() adds keras_amp's LossScaleOptimizer)

Investigation variants of amp_* (`--variants`), each a user rule on the output head (the
Transformer's and LSTM's vocabulary projection): `amp_bf16+head32` keeps it float32,
`amp_bf16+head16` in the compute dtype (float32 loss), `amp_bf16+logits` builds it as
`keras_amp.layers.logits.Logits` (16-bit matmul, float32 accumulation and logits). LSTM only:
`+amplstm` builds `keras_amp.layers.LSTM` (16-bit matmuls, float32 gates and cell state) instead
of the stock LSTM, GRU: `+ampgru` builds `keras_amp.layers.GRU`; `+lstm16` rules the stock
recurrences into the compute dtype. Tokens combine:
`amp_bf16+amplstm+logits`. `+f32scores` enables keras_amp with `xla_scores=False` (attention
QK^T as a float32 matmul instead of the XLA-compiled 16-bit one); `+norm16` rules the
LayerNormalization layers into the compute dtype (Keras computes their statistics in float32
anyway; the deny list's float32 policy also keeps gamma/beta and the output float32). `+lean` /
`+leansr` train with `keras_amp.optimizers.LeanAdam` (16-bit weights; split / stochastic
rounding). Any configuration: `+jit`
compiles it with XLA (`jit_compile=True`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import numpy as np
import tensorflow as tf

import keras_amp
from keras_amp.layers.logits import Logits

WORKLOADS = ("cnn", "transformer", "lstm", "gru")
RECIPE = {"cnn": "cnn", "transformer": "transformer", "lstm": "rnn", "gru": "rnn"}
# The layer a "+head32"/"+head16" variant rules on: the model's output projection.
HEAD = {"cnn": "logits", "transformer": "lm_head", "lstm": "lm_head", "gru": "lm_head"}
POLICY = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch: int
    seq: int = 0
    dim: int = 0
    vocab: int = 0
    width: int = 0  # CNN: channels of the first stage; LSTM: units
    image: int = 32


FULL = {
    "cnn": Sizes(batch=128, width=32, image=32),
    "transformer": Sizes(batch=32, seq=128, dim=256, vocab=2048),
    "lstm": Sizes(batch=64, seq=64, dim=128, vocab=1000, width=256),
    "gru": Sizes(batch=64, seq=64, dim=128, vocab=1000, width=256),
}
SMOKE = {
    "cnn": Sizes(batch=8, width=8, image=16),
    "transformer": Sizes(batch=4, seq=16, dim=32, vocab=64),
    "lstm": Sizes(batch=4, seq=8, dim=16, vocab=50, width=16),
    "gru": Sizes(batch=4, seq=8, dim=16, vocab=50, width=16),
}


def sizes(workload: str, smoke: bool) -> Sizes:
    return (SMOKE if smoke else FULL)[workload]


def units_per_step(workload: str, s: Sizes) -> tuple[int, str]:
    """Items one training step processes, and their name (for images/s or tokens/s)."""
    if workload == "cnn":
        return s.batch, "images"
    return s.batch * s.seq, "tokens"


def build_cnn(s: Sizes, head=keras.layers.Dense) -> keras.Model:
    """ResNet-style: stem conv, three stages of one basic residual block (BN after each conv)."""
    layers = keras.layers
    inp = keras.Input((s.image, s.image, 3), name="images")
    x = layers.Conv2D(s.width, 3, padding="same", use_bias=False, name="stem")(inp)
    x = layers.ReLU()(layers.BatchNormalization(name="stem_bn")(x))
    for stage, mult in enumerate((1, 2, 4)):
        filters, stride = s.width * mult, 1 if stage == 0 else 2
        shortcut = x
        y = layers.Conv2D(filters, 3, stride, padding="same", use_bias=False, name=f"s{stage}_conv1")(x)
        y = layers.ReLU()(layers.BatchNormalization(name=f"s{stage}_bn1")(y))
        y = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"s{stage}_conv2")(y)
        y = layers.BatchNormalization(name=f"s{stage}_bn2")(y)
        if stage:
            shortcut = layers.Conv2D(filters, 1, stride, use_bias=False, name=f"s{stage}_proj")(x)
            shortcut = layers.BatchNormalization(name=f"s{stage}_proj_bn")(shortcut)
        x = layers.ReLU()(layers.Add()([shortcut, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, head(10, name="logits")(x), name="cnn")


def build_transformer(s: Sizes, head=keras.layers.Dense) -> keras.Model:
    """Pre-norm GPT-style LM: token embedding, 2 causal blocks, final norm, vocabulary head."""
    layers = keras.layers
    heads, ff = 4, 4 * s.dim
    inp = keras.Input((s.seq,), dtype="int32", name="tokens")
    # No position embedding: a causal LM learns positions from the mask (NoPE); it would cost
    # the same in every configuration and needs a custom layer to survive apply_recipe's clone.
    x = layers.Embedding(s.vocab, s.dim, name="embed")(inp)
    for i in range(2):
        h = layers.LayerNormalization(name=f"ln_a_{i}")(x)
        a = layers.MultiHeadAttention(heads, s.dim // heads, dropout=0.1, name=f"mha_{i}")(
            h, h, use_causal_mask=True
        )
        x = layers.Add(name=f"res_a_{i}")([x, layers.Dropout(0.1)(a)])
        h = layers.LayerNormalization(name=f"ln_f_{i}")(x)
        h = layers.Dense(ff, activation="gelu", name=f"ffn_in_{i}")(h)
        h = layers.Dense(s.dim, name=f"ffn_out_{i}")(h)
        x = layers.Add(name=f"res_f_{i}")([x, layers.Dropout(0.1)(h)])
    x = layers.LayerNormalization(name="ln_final")(x)
    return keras.Model(inp, head(s.vocab, name="lm_head")(x), name="transformer_lm")


def build_lstm(s: Sizes, head=keras.layers.Dense, rnn=keras.layers.LSTM, name="lstm") -> keras.Model:
    layers = keras.layers
    inp = keras.Input((s.seq,), dtype="int32", name="tokens")
    x = layers.Embedding(s.vocab, s.dim, name="embed")(inp)
    x = rnn(s.width, return_sequences=True, name=f"{name}_0")(x)
    x = rnn(s.width, return_sequences=True, name=f"{name}_1")(x)
    return keras.Model(inp, head(s.vocab, name="lm_head")(x), name=f"{name}_lm")


def build_gru(s: Sizes, head=keras.layers.Dense, rnn=keras.layers.GRU) -> keras.Model:
    return build_lstm(s, head, rnn, name="gru")


BUILDERS: dict[str, Callable[..., keras.Model]] = {
    "cnn": build_cnn,
    "transformer": build_transformer,
    "lstm": build_lstm,
    "gru": build_gru,
}


def dataset(workload: str, s: Sizes) -> tf.data.Dataset:
    """Eight batches of random data, cached and repeated (no input cost inside a step)."""
    rng = np.random.default_rng(0)
    n = s.batch * 8
    if workload == "cnn":
        x = rng.normal(size=(n, s.image, s.image, 3)).astype("float32")
        y = rng.integers(0, 10, n).astype("int32")
    else:
        tokens = rng.integers(0, s.vocab, (n, s.seq + 1)).astype("int32")
        x, y = tokens[:, :-1], tokens[:, 1:]
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(s.batch, drop_remainder=True)
    return data.cache().repeat().prefetch(2)


def config_names(policies: tuple[str, ...], variants: tuple[str, ...] = ()) -> list[str]:
    """["float32", "stock_bf16", "amp_bf16", ...] for policies ("bf16", "fp16"), then the variants."""
    names = ["float32"]
    for p in policies:
        names += [f"stock_{p}", f"amp_{p}"]
    return names + [v for v in variants if v not in names]


def parse_config(name: str) -> tuple[str, str | None, str | None]:
    """"amp_bf16+head32" -> ("amp", "mixed_bfloat16", "head32"); "float32" -> ("float32", None, None)."""
    base, _, variant = name.partition("+")
    if base == "float32":
        return "float32", None, variant or None
    kind, _, p = base.partition("_")
    if kind not in ("stock", "amp") or p not in POLICY:
        raise ValueError(
            f"A configuration is float32, stock_<p> or amp_<p>[+variant] with p in {sorted(POLICY)}. "
            f"Received: name={name!r}"
        )
    return kind, POLICY[p], variant or None


# "+lean" / "+leansr": keras_amp.optimizers.LeanAdam with its default compensation (split under
# bfloat16) / stochastic rounding, instead of Adam with float32 master weights.
LEAN = {"lean": None, "leansr": "stochastic"}

# "+gradstats" / "+monitor": the same model trained with keras_amp's GradientStatistics (idle: it
# never fires during the timed steps) or LossScaleMonitor attached, for their cost when idle.
TRAINING_CALLBACKS = ("gradstats", "monitor")


def training_callbacks(name: str, data) -> list[keras.callbacks.Callback]:
    """The keras_amp callbacks a configuration's "+gradstats"/"+monitor" tokens ask for."""
    tokens = name.split("+")[1:]
    found = []
    if "gradstats" in tokens:
        x, y = next(iter(data))
        found.append(keras_amp.callbacks.GradientStatistics((x, y), every_n_steps=10**9))
    if "monitor" in tokens:
        found.append(keras_amp.callbacks.LossScaleMonitor(log_every=10**9))
    return found


def build(workload: str, name: str, s: Sizes, jit_compile="auto") -> keras.Model:
    """Builds and compiles configuration `name` of `workload`; leaves keras_amp enabled for amp_*.

    Trace (fit) a model before building the next configuration: keras_amp.enable() changes how
    layers trace, and a stock model must be traced with keras_amp disabled.
    """
    kind, policy, variant = parse_config(name)
    tokens = variant.split("+") if variant else []
    if "jit" in tokens:  # "+jit": this configuration with compile(jit_compile=True) (XLA)
        tokens.remove("jit")
        jit_compile = True
    for token in TRAINING_CALLBACKS:  # callbacks attached by bench_time, not part of the model
        if token in tokens:
            tokens.remove(token)
    if tokens and kind != "amp":
        raise ValueError(f"Only amp_* configurations take variants other than +jit. Received: name={name!r}")
    keras_amp.disable()
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)  # the same initial weights in every configuration
    optimizer = keras.optimizers.Adam(1e-4)
    if kind == "float32":
        model = BUILDERS[workload](s)
    elif kind == "stock":
        keras.config.set_dtype_policy(policy)
        model = BUILDERS[workload](s)
        if policy == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    else:
        keras_amp.enable(policy, xla_scores="f32scores" not in tokens)
        rules, kwargs = {}, {}
        for token in tokens:
            if token == "f32scores":
                continue
            if token in LEAN:  # keras_amp's lean tier: 16-bit weights, compensated updates
                optimizer = keras_amp.optimizers.LeanAdam(1e-4, compensation=LEAN[token])
                continue
            if token == "norm16":  # LayerNormalization layers in the compute dtype (a rule)
                rules[keras.layers.LayerNormalization] = policy
                rules[keras.layers.BatchNormalization] = policy
                continue
            if token == "head32":
                rules[HEAD[workload]] = "float32"
            elif token == "head16":
                rules[HEAD[workload]] = policy
            elif token == "logits":
                rules[HEAD[workload]], kwargs["head"] = policy, Logits
            elif token == "amplstm" and workload == "lstm":
                kwargs["rnn"] = keras_amp.layers.LSTM
            elif token == "ampgru" and workload == "gru":
                kwargs["rnn"] = keras_amp.layers.GRU
            elif token == "lstm16" and workload in ("lstm", "gru"):
                rules[rf"{workload}_\d"] = policy
            else:
                raise ValueError(
                    f"Unknown variant {token!r}. Received: name={name!r}. Allowed: head32, head16, logits, "
                    "f32scores, norm16, lean, leansr; "
                    "for lstm also amplstm (keras_amp.layers.LSTM), for gru ampgru (keras_amp.layers.GRU), "
                    "for both lstm16 (a rule: the recurrences in the compute dtype)"
                )
        model = BUILDERS[workload](s, **kwargs)
        model = keras_amp.apply_recipe(model, RECIPE[workload], rules=rules or None)
        optimizer = keras_amp.wrap(optimizer)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def head_dtype(workload: str, model: keras.Model) -> str:
    """Compute dtype of the model's output projection (what the table reports for amp_*)."""
    try:
        layer = model.get_layer(HEAD[workload])
    except ValueError:
        return "?"
    if isinstance(layer, Logits) and layer.compute_dtype != "float32":
        return f"{layer.compute_dtype}->float32"
    return layer.compute_dtype


def op_rules_state() -> str:
    """Whether keras_amp's op-level float32 rules exist and are installed right now."""
    try:
        from keras_amp import op_rules  # noqa: PLC0415 (optional: another issue adds it)
    except ImportError:
        return "op rules: not present"
    except Exception as e:  # noqa: BLE001 (a half-written module in a working tree)
        return f"op rules: import failed ({type(e).__name__})"
    for attr in ("installed", "is_installed"):
        fn = getattr(op_rules, attr, None)
        if callable(fn):
            return f"op rules: installed={fn()}"
    return "op rules: present (install state unknown)"


def child_json(cmd: list[str], timeout: float = 1800) -> dict:
    """Runs `cmd` (a benchmark script in a process of its own) and returns the last JSON line it printed;
    on failure {"error": the end of its stderr}."""
    import json  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": out.stderr[-2000:]}
    return json.loads(lines[-1])
