"""Step time on keras-hub backbones we did not write: float32, stock mixed precision and keras_amp.

    python benchmarks/bench_hub.py                          # every family below, mixed_bfloat16
    python benchmarks/bench_hub.py --families llama t5 --blocks 10
    python benchmarks/bench_hub.py --policy mixed_float16   # stock with Keras's LossScaleOptimizer
    python benchmarks/bench_hub.py --smoke                  # tiny sizes: checks that it runs

`make bench`'s workloads are models this project wrote; this runs the same comparison on keras-hub's
own backbones, as a user would train them: built with random weights from a small config (2 layers,
hidden 256, 4 heads, feed-forward 1024; text: sequences of 128 tokens and a 2048-token vocabulary
head per token; images: 64x64, a 10-class head on the mean of the last feature map), Adam, sparse
cross-entropy. The three configurations of one family are built and traced first (stock and float32
with keras_amp disabled, keras_amp after `keras_amp.enable(policy)`, its optimizer through
`keras_amp.wrap`: no recipe, the op rules alone), then trained alternately in blocks, the order
rotated from block to block, on one cached, repeated `tf.data` input; a block's figure is the median
interval between batch ends (warm-up and each fit's first batch dropped). Ratios are medians of
per-block ratios: each compares runs made side by side. One family at a time, in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import warnings
from typing import Callable

from keras_amp_console import import_tensorflow_quietly  # noqa: E402

import_tensorflow_quietly()  # the start-up banner filtered out; a TF_CPP_MIN_LOG_LEVEL the user set is kept
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

try:
    import keras_hub
    from keras_hub import models as hub
except ImportError:  # a test dependency (pyproject's [test] extra), not one of keras_amp's
    sys.exit("bench_hub.py needs keras-hub: pip install -e '.[test]' (what `make bench` uses) or pip install keras-hub")

import keras_amp  # noqa: E402
from bench_time import _traces, fit_block, rotated  # noqa: E402
from report import paired  # noqa: E402

CONFIGS = ("float32", "stock", "keras_amp")
POLICIES = ("mixed_bfloat16", "mixed_float16")


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch: int
    seq: int
    vocab: int
    hidden: int
    heads: int
    image: int
    classes: int = 10


FULL = Sizes(batch=16, seq=128, vocab=2048, hidden=256, heads=4, image=64)
SMOKE = Sizes(batch=2, seq=8, vocab=32, hidden=16, heads=2, image=16)


def _text(s: Sizes, **extra) -> dict:
    return dict(vocabulary_size=s.vocab, num_layers=2, hidden_dim=s.hidden, intermediate_dim=4 * s.hidden, **extra)


# Family -> backbone builder. Attention written every way keras-hub writes it: MultiHeadAttention
# subclasses (BERT, GPT-2, OPT, BART, ALBERT, ViT, DINOv2), einsum with a computed equation (Llama,
# Mistral, Gemma, Gemma3, Qwen3) or a literal one (Falcon, GPT-NeoX, Phi3, T5, DeBERTaV3 and XLNet with
# their relative-position score terms), `ops.matmul` (Bloom), `q @ k` (SegFormer's MiT); rotary
# embeddings (ESM, RoFormerV2); norms computed by the model (T5's rsqrt, Phi3's and Qwen3's float32
# casts); and convnets (ResNet, batch norm; EfficientNet and MobileNet, depthwise convolutions).
FAMILIES: dict[str, Callable[[Sizes], keras.Model]] = {
    "bert": lambda s: hub.BertBackbone(**_text(s, num_heads=s.heads, max_sequence_length=s.seq)),
    "gpt2": lambda s: hub.GPT2Backbone(**_text(s, num_heads=s.heads, max_sequence_length=s.seq)),
    "opt": lambda s: hub.OPTBackbone(**_text(s, num_heads=s.heads, max_sequence_length=s.seq)),
    "llama": lambda s: hub.LlamaBackbone(**_text(s, num_query_heads=s.heads, num_key_value_heads=s.heads // 2)),
    "mistral": lambda s: hub.MistralBackbone(**_text(s, num_query_heads=s.heads, num_key_value_heads=s.heads // 2)),
    "gemma": lambda s: hub.GemmaBackbone(
        **_text(s, num_query_heads=s.heads, num_key_value_heads=1, head_dim=s.hidden // s.heads)
    ),
    "qwen3": lambda s: hub.Qwen3Backbone(
        **_text(s, num_query_heads=s.heads, num_key_value_heads=s.heads // 2, head_dim=s.hidden // s.heads)
    ),
    "falcon": lambda s: hub.FalconBackbone(**_text(s, num_attention_heads=s.heads)),
    "gpt_neo_x": lambda s: hub.GPTNeoXBackbone(**_text(s, num_heads=s.heads, max_sequence_length=s.seq)),
    "phi3": lambda s: hub.Phi3Backbone(**_text(s, num_query_heads=s.heads, num_key_value_heads=s.heads // 2)),
    "t5": lambda s: hub.T5Backbone(**_text(s, num_heads=s.heads)),
    "deberta_v3": lambda s: hub.DebertaV3Backbone(
        **_text(s, num_heads=s.heads, max_sequence_length=s.seq, bucket_size=s.seq // 2)
    ),
    "bloom": lambda s: hub.BloomBackbone(**_text(s, num_heads=s.heads)),
    "xlnet": lambda s: hub.XLNetBackbone(**_text(s, num_heads=s.heads)),
    "bart": lambda s: hub.BartBackbone(**_text(s, num_heads=s.heads, max_sequence_length=s.seq)),
    "esm": lambda s: hub.ESMBackbone(**_text(s, num_heads=s.heads, max_sequence_length=s.seq)),
    "gemma3": lambda s: hub.Gemma3Backbone(
        **_text(s, num_query_heads=s.heads, num_key_value_heads=1, head_dim=s.hidden // s.heads), image_size=16,
        vision_encoder=None,
    ),
    "roformer_v2": lambda s: hub.RoformerV2Backbone(**_text(s, num_heads=s.heads, head_size=s.hidden // s.heads)),
    "albert": lambda s: hub.AlbertBackbone(
        **_text(s, num_heads=s.heads, embedding_dim=s.hidden // 2, max_sequence_length=s.seq)
    ),
    "vit": lambda s: hub.ViTBackbone(
        image_shape=(s.image, s.image, 3), patch_size=8, num_layers=2, num_heads=s.heads, hidden_dim=s.hidden,
        mlp_dim=4 * s.hidden,
    ),
    "dinov2": lambda s: hub.DINOV2Backbone(
        patch_size=8, num_layers=2, hidden_dim=s.hidden, num_heads=s.heads, intermediate_dim=4 * s.hidden,
        image_shape=(s.image, s.image, 3),
    ),
    "segformer": lambda s: hub.MiTBackbone(
        layerwise_depths=[2, 2], num_layers=2, layerwise_num_heads=[1, s.heads // 2], layerwise_sr_ratios=[4, 2],
        max_drop_path_rate=0.0, layerwise_patch_sizes=[7, 3], layerwise_strides=[4, 2],
        image_shape=(s.image, s.image, 3), hidden_dims=[s.hidden // 4, s.hidden // 2],
    ),
    "resnet": lambda s: hub.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 128, 256],
        stackwise_num_blocks=[1, 1, 1], stackwise_num_strides=[1, 2, 2], block_type="basic_block",
        image_shape=(s.image, s.image, 3),
    ),
    "efficientnet": lambda s: hub.EfficientNetBackbone(  # EfficientNet-B0's stacks (narrower in smoke sizes)
        stackwise_width_coefficients=[s.hidden / FULL.hidden] * 7, stackwise_depth_coefficients=[1.0] * 7,
        stackwise_kernel_sizes=[3, 3, 5, 3, 5, 5, 3], stackwise_num_repeats=[1, 2, 2, 3, 3, 4, 1],
        stackwise_input_filters=[32, 16, 24, 40, 80, 112, 192],
        stackwise_output_filters=[16, 24, 40, 80, 112, 192, 320],
        stackwise_expansion_ratios=[1, 6, 6, 6, 6, 6, 6], stackwise_squeeze_and_excite_ratios=[0.25] * 7,
        stackwise_strides=[1, 2, 2, 2, 1, 2, 1], stackwise_block_types=["v1"] * 7, input_shape=(s.image, s.image, 3),
    ),
    "mobilenet": lambda s: hub.MobileNetBackbone(  # keras-hub's docstring configuration (MobileNetV3)
        stackwise_expansion=[[40, 56], [64, 144, 144], [72, 72], [144, 288, 288]], stackwise_num_blocks=[2, 3, 2, 3],
        stackwise_num_filters=[[16, 16], [24, 24, 24], [24, 24], [48, 48, 48]],
        stackwise_kernel_size=[[3, 3], [5, 5, 5], [5, 5], [5, 5, 5]],
        stackwise_num_strides=[[2, 1], [2, 1, 1], [1, 1], [2, 1, 1]],
        stackwise_se_ratio=[[None, None], [0.25] * 3, [0.3, 0.3], [0.3, 0.25, 0.25]],
        stackwise_activation=[["relu"] * 2, ["hard_swish"] * 3, ["hard_swish"] * 2, ["hard_swish"] * 3],
        stackwise_padding=[[1, 1], [2, 2, 2], [2, 2], [2, 2, 2]], output_num_filters=288, input_activation="hard_swish",
        output_activation="hard_swish", input_num_filters=16, image_shape=(s.image, s.image, 3), depthwise_filters=8,
        depthwise_stride=2, depthwise_residual=False, last_layer_filter=288, squeeze_and_excite=0.5,
    ),
}
IMAGES = {"vit", "dinov2", "segformer", "resnet", "efficientnet", "mobilenet"}
# The output the head reads, of the encoder-decoders.
OUTPUT = {"t5": "decoder_sequence_output", "bart": "decoder_sequence_output"}


def build(family: str, s: Sizes) -> keras.Model:
    """The backbone on fresh inputs of fixed shape, and its head: per-token vocabulary logits (text) or
    class logits from the mean of the last feature map (images)."""
    backbone = FAMILIES[family](s)
    if family in IMAGES:
        inputs = keras.Input((s.image, s.image, 3), name="images")
        hidden = backbone(inputs)
        if isinstance(hidden, dict):
            hidden = list(hidden.values())[-1]
        hidden = keras.ops.mean(hidden, axis=tuple(range(1, len(hidden.shape) - 1)))
        return keras.Model(inputs, keras.layers.Dense(s.classes, name="head")(hidden), name=f"{family}_bench")
    inputs = {}
    for tensor in keras.tree.flatten(backbone.input):
        name = tensor.name.split(":")[0]
        inputs[name] = keras.Input((s.seq,), dtype=tensor.dtype, name=name)
    hidden = backbone(inputs)
    if isinstance(hidden, dict):
        hidden = hidden[OUTPUT.get(family, "sequence_output")]
    return keras.Model(inputs, keras.layers.Dense(s.vocab, name="head")(hidden), name=f"{family}_bench")


def dataset(family: str, model: keras.Model, s: Sizes) -> tf.data.Dataset:
    """Eight batches of random data (all-ones padding masks, zero segment ids), cached and repeated."""
    rng = np.random.default_rng(0)
    n = s.batch * 8
    if family in IMAGES:
        x = rng.uniform(0.0, 1.0, (n, s.image, s.image, 3)).astype("float32")
        y = rng.integers(0, s.classes, n).astype("int32")
    else:
        x = {}
        for tensor in model.inputs:
            name = tensor.name.split(":")[0]
            if "mask" in name:
                x[name] = np.ones((n, s.seq), "int32")
            elif "segment" in name:
                x[name] = np.zeros((n, s.seq), "int32")
            else:
                x[name] = rng.integers(1, s.vocab, (n, s.seq)).astype("int32")
        y = rng.integers(0, s.vocab, (n, s.seq)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(s.batch, drop_remainder=True)
    return data.cache().repeat().prefetch(2)


def make(family: str, config: str, policy: str, s: Sizes) -> keras.Model:
    """Builds and compiles one configuration; leaves keras_amp enabled for "keras_amp" (trace it next)."""
    keras_amp.disable()
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)  # the same initial weights in every configuration
    optimizer = keras.optimizers.Adam(1e-4)
    if config == "stock":
        keras.config.set_dtype_policy(policy)
        if policy == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    elif config == "keras_amp":
        keras_amp.enable(policy)
        optimizer = keras_amp.wrap(optimizer)
    model = build(family, s)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def run_family(family: str, policy: str, s: Sizes, blocks: int, steps: int, warmup: int) -> dict:
    models, data = {}, {}
    for config in CONFIGS:
        models[config] = make(family, config, policy, s)
        data[config] = dataset(family, models[config], s)
        models[config].fit(data[config], steps_per_epoch=warmup, epochs=1, verbose=0, shuffle=False)  # traced as built
    keras_amp.disable()
    keras.config.set_dtype_policy("float32")
    per_block = [fit_block(models, data, rotated(CONFIGS, block), steps)[0] for block in range(blocks)]
    traces = {c: _traces(models[c]) for c in CONFIGS}  # 1 each: nothing traced again inside the blocks
    keras.backend.clear_session()
    return {
        "family": family,
        "traces": traces,
        "ms": {c: statistics.median(b[c] for b in per_block) * 1e3 for c in CONFIGS},
        "keras_amp/stock": paired(per_block, "keras_amp", "stock"),
        "keras_amp/float32": paired(per_block, "keras_amp", "float32"),
        "stock/float32": paired(per_block, "stock", "float32"),
        "blocks": per_block,
    }


def table(results: list[dict]) -> list[str]:
    lines = [
        "| family | float32 ms | stock ms | keras_amp ms | keras_amp / stock (blocks' min-max) | keras_amp / float32 "
        "| stock / float32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['family']} | failed: {r['error'].replace('|', '/')} | | | | | |")
            continue
        ms, (vs_stock, lo, hi) = r["ms"], r["keras_amp/stock"]
        lines.append(
            f"| {r['family']} | {ms['float32']:.1f} | {ms['stock']:.1f} | {ms['keras_amp']:.1f} | {vs_stock:.3f} "
            f"({lo:.2f}-{hi:.2f}) | {r['keras_amp/float32'][0]:.3f} | {r['stock/float32'][0]:.3f} |"
        )
    return lines


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES),
                        metavar="FAMILY", help=f"keras-hub families to run (default: all of {', '.join(FAMILIES)})")
    parser.add_argument("--policy", choices=POLICIES, default="mixed_bfloat16",
                        help="the mixed policy of stock and keras_amp (default: mixed_bfloat16)")
    parser.add_argument("--blocks", type=_positive, default=6, help="interleaved measurement blocks (default: 6)")
    parser.add_argument("--steps", type=_positive, default=5, help="timed steps per configuration per block")
    parser.add_argument("--warmup", type=_positive, default=3, help="warm-up steps per configuration (discarded)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    parser.add_argument("--json", help="also write the results here, as JSON")
    parser.add_argument("--results", help="write the report here (default: benchmarks/HUB_RESULTS.md when every "
                                          "family runs at full size under mixed_bfloat16; else none)")
    args = parser.parse_args(argv)
    for option in ("json", "results"):  # checked before anything is timed, not after
        path = getattr(args, option)
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and (os.path.isdir(path) or not os.access(folder, os.W_OK)):
            parser.error(f"argument --{option}: cannot write {path!r} (a folder, or its folder is missing "
                         f"or not writable)")
    # Backbone weights the benchmark's head does not use (BERT's pooler, tied `reverse_embeddings`) get no
    # gradient; Keras warns about them at a configuration's first step.
    warnings.filterwarnings("ignore", message="Gradients do not exist for variables")
    from keras_amp import hardware  # noqa: PLC0415

    s = SMOKE if args.smoke else FULL
    machine = (f"{hardware.detect().summary()}; {os.cpu_count()} logical CPUs; TensorFlow {tf.__version__}, "
               f"Keras {keras.__version__}, keras-hub {keras_hub.__version__}, keras_amp {keras_amp.__version__}")
    print(f"keras-hub backbones, {args.policy}: {machine}; {args.blocks} blocks x {args.steps} steps", flush=True)
    results = []
    try:
        for family in args.families:
            try:
                results.append(run_family(family, args.policy, s, args.blocks, args.steps, args.warmup))
            except Exception as e:  # noqa: BLE001 (one family's failure is reported; the others still run)
                results.append({"family": family, "error": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
                print(f"  {family}: failed: {results[-1]['error']}", flush=True)
                keras_amp.disable()
                keras.backend.clear_session()
                continue
            r = results[-1]
            print(f"  {family}: keras_amp / stock {r['keras_amp/stock'][0]:.3f}, / float32 "
                  f"{r['keras_amp/float32'][0]:.3f}", flush=True)
    finally:
        keras_amp.disable()
        keras.config.set_dtype_policy("float32")
    lines = table(results)
    print("\n".join(lines))
    results_path = args.results
    if results_path is None and not args.smoke and args.families == list(FAMILIES) and args.policy == POLICIES[0]:
        results_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "HUB_RESULTS.md")
    if results_path:
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        with open(results_path, "w") as f:
            f.write(f"# keras-hub backbones, {args.policy} (`benchmarks/bench_hub.py`), {now}\n\n"
                    f"Machine: {machine}. {args.blocks} interleaved blocks x {args.steps} timed steps per "
                    f"configuration (warm-up {args.warmup}); ms: medians over blocks; ratios: medians of "
                    f"per-block ratios.\n\n" + "\n".join(lines) + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"policy": args.policy, "sizes": dataclasses.asdict(s), "results": results}, f, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
