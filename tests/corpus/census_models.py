"""The keras-hub census: one tiny model per `keras_hub.models` backbone family and per
`keras.applications` family, random weights, no downloads.

Each `Case` builds a backbone at the smallest size its config allows (hidden dims 8-32, one or
two layers, vocabulary `VOCAB`, sequences of `SEQ`, images of 32x32 or the family's minimum) and
puts a small head on it, so there is a scalar loss: a Dense over each token of a sequence
output, over a pooled output, or over the spatial mean of a feature map; `keras.applications`
keep their own softmax classifier. `batch(case, model)` gives a deterministic `(x, y)` from a
fixed NumPy seed, shaped after the model's inputs and outputs.

Builders take no arguments and build under whatever dtype policy is in force, so a test calls
them after `keras_amp.enable(...)` (or before, for the float32 reference). Families that do not
build this way are listed in `SKIPPED`, with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import keras_amp
from keras_hub.src.models.vae import vae_backbone  # not exported by keras_hub.models

BATCH = 2
SEQ = 8
VOCAB = 64
CLASSES = 4
IMAGE = (32, 32, 3)
POLICIES = ("mixed_float16", "mixed_bfloat16")
hub = keras_hub.models


@dataclasses.dataclass(frozen=True)
class Case:
    """One census model.

    Args:
        name: String. Test id (the family).
        recipe: String. The `keras_amp.apply_recipe` recipe: "transformer" or "cnn".
        build: Callable. Returns the built model; its output feeds `loss()`.
        attention: Bool. Whether the model has softmax attention (the audit must then find
            at least one QK^T matmul, a guard that the graph walk reaches it).
        probabilities: Bool. Whether the output is probabilities (keras.applications' softmax
            classifier) rather than logits.
        policies: Tuple of strings. The mixed policies the census runs it under (see `SKIPPED`).
    """

    name: str
    recipe: str
    build: Callable[[], keras.Model]
    attention: bool = True
    probabilities: bool = False
    policies: tuple = POLICIES

    def loss(self) -> keras.losses.Loss:
        return keras.losses.SparseCategoricalCrossentropy(from_logits=not self.probabilities)


def _concrete(shape, fill):
    return tuple(fill if d is None else d for d in shape)


def batch(case: Case, model: keras.Model) -> tuple[Any, np.ndarray]:
    """A fixed `(x, y)` for `model`: token ids, all-ones masks, zero segment ids, images in [0, 1)
    ([0, 255) for keras.applications), integer labels of the output's shape less its last axis."""
    rng = np.random.default_rng(0)
    inputs = model.inputs
    x = {}
    for tensor in inputs:
        name = tensor.name.split(":")[0]
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        shape = (BATCH,) + _concrete(tuple(tensor.shape[1:]), SEQ)
        if "mask" in name:
            x[name] = np.ones(shape, dtype)
        elif "segment" in name:
            x[name] = np.zeros(shape, dtype)
        elif "label" in name and "int" in dtype:  # prompt labels (SAM3's box labels): 0 or 1
            x[name] = rng.integers(0, 2, shape).astype(dtype)
        elif "int" in dtype:
            x[name] = rng.integers(1, VOCAB, shape).astype(dtype)
        else:
            high = 255.0 if case.probabilities else 1.0
            x[name] = rng.uniform(0.0, high, shape).astype(dtype)
    x = x[inputs[0].name.split(":")[0]] if len(inputs) == 1 else x
    out_shape = (BATCH,) + _concrete(tuple(model.output.shape[1:-1]), SEQ)
    return x, rng.integers(0, CLASSES, out_shape).astype("int32")


def _inputs_like(backbone, image_shape=IMAGE):
    """Fresh `keras.Input`s with the backbone's input names and dtypes, unknown axes made concrete."""

    def like(tensor):
        shape = tuple(tensor.shape[1:])
        if len(shape) == 3 and shape[-1] == 3 or len(shape) == 3 and shape[:2] == (None, None):
            shape = tuple(s if s is not None else image_shape[i] for i, s in enumerate(shape))
        else:
            shape = _concrete(shape, SEQ)
        return keras.Input(shape, dtype=tensor.dtype, name=tensor.name.split(":")[0])

    return keras.tree.map_structure(like, backbone.input)


def _head(hidden):
    """Dense logits per token (rank 3), over a pooled vector (rank 2) or a feature map's mean."""
    if len(hidden.shape) > 3:
        hidden = keras.ops.mean(hidden, axis=tuple(range(1, len(hidden.shape) - 1)))
    return keras.layers.Dense(CLASSES, name="census_head")(hidden)


def _with_head(make_backbone, output=None, image_shape=IMAGE, shapes=None):
    """Backbone called on fresh inputs, `output` (a key or index of its outputs) fed to `_head`.

    `shapes` overrides the shape (less the batch axis) of named inputs."""

    def build():
        backbone = make_backbone()
        inputs = _inputs_like(backbone, image_shape)
        for name, shape in (shapes or {}).items():
            inputs[name] = keras.Input(shape, dtype=inputs[name].dtype, name=name)
        hidden = backbone(inputs)
        if output is not None:
            hidden = hidden[output]
        elif isinstance(hidden, dict):  # the sequence output, else the last (deepest) feature map
            hidden = hidden["sequence_output"] if "sequence_output" in hidden else list(hidden.values())[-1]
        elif isinstance(hidden, (list, tuple)):
            hidden = hidden[-1]
        return keras.Model(inputs, _head(hidden), name=f"{backbone.name}_census")

    return build


def _application(cls, shape=IMAGE, **kwargs):
    def build():
        return cls(weights=None, input_shape=shape, classes=CLASSES, **kwargs)

    return build


def _tiny_resnet(stages=3, image_shape=IMAGE):
    """A ResNet of `stages` one-block stages (keras-hub requires 64 filters in the first)."""
    return hub.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64] + [8] * (stages - 1),
        stackwise_num_blocks=[1] * stages, stackwise_num_strides=[1] + [2] * (stages - 1),
        block_type="basic_block", image_shape=image_shape,
    )


# Text backbones: two layers, two heads, hidden 16, vocabulary 64.
T = dict(vocabulary_size=VOCAB, num_layers=2, hidden_dim=16, intermediate_dim=32)


def _kw(**extra):
    return {**T, **extra}


TEXT = {
    # Text-only Gemma3n (AltUp, Laurel, per-layer inputs); its vision and audio encoders are
    # MobileNetV5 (in the census) and a conformer built into the same backbone.
    "gemma3n": lambda: hub.Gemma3nBackbone(
        text_vocab_size=VOCAB, text_hidden_size=8, num_hidden_layers=1, pad_token_id=0, num_attention_heads=1,
        num_key_value_heads=1, head_dim=8, intermediate_size=[16], hidden_activation="gelu_approximate",
        layer_types=["full_attention"], sliding_window=4, rope_theta=10000.0, max_position_embeddings=16,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=2, altup_num_inputs=2, laurel_rank=1),
    "albert": lambda: hub.AlbertBackbone(**_kw(num_heads=2, embedding_dim=8, max_sequence_length=SEQ)),
    "bart": lambda: hub.BartBackbone(**_kw(num_heads=2, max_sequence_length=SEQ)),
    "bert": lambda: hub.BertBackbone(**_kw(num_heads=2, max_sequence_length=SEQ)),
    "bloom": lambda: hub.BloomBackbone(**_kw(num_heads=2)),
    "deberta_v3": lambda: hub.DebertaV3Backbone(**_kw(num_heads=2, max_sequence_length=SEQ, bucket_size=4)),
    "distil_bert": lambda: hub.DistilBertBackbone(**_kw(num_heads=2, max_sequence_length=SEQ)),
    "electra": lambda: hub.ElectraBackbone(
        vocab_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=16, embedding_dim=8, intermediate_dim=32,
        max_sequence_length=SEQ,
    ),
    "esm": lambda: hub.ESMBackbone(**_kw(num_heads=2, max_sequence_length=SEQ)),
    "f_net": lambda: hub.FNetBackbone(**_kw(max_sequence_length=SEQ)),
    "falcon": lambda: hub.FalconBackbone(**_kw(num_attention_heads=2)),
    "gemma": lambda: hub.GemmaBackbone(**_kw(num_query_heads=2, num_key_value_heads=1, head_dim=8)),
    "gemma3": lambda: hub.Gemma3Backbone(
        **_kw(num_query_heads=2, num_key_value_heads=1, head_dim=8), image_size=16, vision_encoder=None
    ),
    "gpt2": lambda: hub.GPT2Backbone(**_kw(num_heads=2, max_sequence_length=SEQ)),
    "gpt_neo_x": lambda: hub.GPTNeoXBackbone(**_kw(num_heads=2, max_sequence_length=SEQ)),
    "gpt_oss": lambda: hub.GptOssBackbone(**_kw(num_query_heads=2, num_key_value_heads=1, num_experts=2, top_k=1)),
    "llama": lambda: hub.LlamaBackbone(**_kw(num_query_heads=2, num_key_value_heads=1)),
    "llama3": lambda: hub.Llama3Backbone(**_kw(num_query_heads=2, num_key_value_heads=1)),
    "mistral": lambda: hub.MistralBackbone(**_kw(num_query_heads=2, num_key_value_heads=1)),
    "mixtral": lambda: hub.MixtralBackbone(**_kw(num_query_heads=2, num_key_value_heads=1, num_experts=2, top_k=1)),
    "opt": lambda: hub.OPTBackbone(**_kw(num_heads=2, max_sequence_length=SEQ)),
    "phi3": lambda: hub.Phi3Backbone(**_kw(num_query_heads=2, num_key_value_heads=1)),
    "qwen": lambda: hub.QwenBackbone(**_kw(num_query_heads=2, num_key_value_heads=1)),
    "qwen3": lambda: hub.Qwen3Backbone(**_kw(num_query_heads=2, num_key_value_heads=1, head_dim=8)),
    "qwen3_moe": lambda: hub.Qwen3MoeBackbone(
        **_kw(num_query_heads=2, num_key_value_heads=1, moe_intermediate_dim=8, num_experts=2, top_k=1, head_dim=8)
    ),
    "qwen_moe": lambda: hub.QwenMoeBackbone(
        **_kw(num_query_heads=2, num_key_value_heads=1, moe_intermediate_dim=8, shared_expert_intermediate_dim=8,
              num_experts=2, top_k=1)
    ),
    "roberta": lambda: hub.RobertaBackbone(**_kw(num_heads=2, max_sequence_length=SEQ)),
    "roformer_v2": lambda: hub.RoformerV2Backbone(**_kw(num_heads=2, head_size=8)),
    "smollm3": lambda: hub.SmolLM3Backbone(
        **_kw(num_attention_heads=2, num_key_value_heads=1), attention_bias=False, attention_dropout=0.0,
        rope_layer_enabled_list=[True, True], layer_types=["attention", "attention"], mlp_bias=False,
        layer_norm_epsilon=1e-6, max_position_embeddings=SEQ, rope_theta=10000.0, partial_rotary_factor=1.0,
    ),
    "t5": lambda: hub.T5Backbone(**_kw(num_heads=2)),
    "t5gemma": lambda: hub.T5GemmaBackbone(
        vocabulary_size=VOCAB, encoder_hidden_dim=16, encoder_intermediate_dim=32, encoder_num_layers=1,
        encoder_num_attention_heads=2, encoder_num_key_value_heads=1, encoder_head_dim=8,
        encoder_layer_types=["full_attention"], decoder_hidden_dim=16, decoder_intermediate_dim=32,
        decoder_num_layers=1, decoder_num_attention_heads=2, decoder_num_key_value_heads=1, decoder_head_dim=8,
        decoder_layer_types=["full_attention"],
    ),
    "whisper": lambda: hub.WhisperBackbone(
        **_kw(num_heads=2), num_mels=8, max_encoder_sequence_length=2 * SEQ, max_decoder_sequence_length=SEQ
    ),
    "xlm_roberta": lambda: hub.XLMRobertaBackbone(**_kw(num_heads=2, max_sequence_length=SEQ)),
    "xlnet": lambda: hub.XLNetBackbone(**_kw(num_heads=2)),
    "qwen3_5": lambda: hub.Qwen3_5Backbone(
        **_kw(num_query_heads=2, num_key_value_heads=1, head_dim=8), layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    ),
    "qwen3_5_moe": lambda: hub.Qwen3_5MoeBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=2, num_key_value_heads=1, head_dim=8, hidden_dim=16,
        moe_intermediate_dim=8, shared_expert_intermediate_size=8, num_experts=2, top_k=1,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8,
    ),
    "t5gemma2": lambda: hub.T5Gemma2Backbone(
        vocabulary_size=VOCAB, encoder_hidden_dim=16, encoder_intermediate_dim=32, encoder_num_layers=1,
        encoder_num_attention_heads=2, encoder_num_key_value_heads=1, encoder_head_dim=8,
        encoder_layer_types=["full_attention"], decoder_hidden_dim=16, decoder_intermediate_dim=32,
        decoder_num_layers=1, decoder_num_attention_heads=2, decoder_num_key_value_heads=1, decoder_head_dim=8,
        decoder_layer_types=["full_attention"],
    ),
    "clip_text": lambda: hub.CLIPTextEncoder(
        vocabulary_size=VOCAB, embedding_dim=16, hidden_dim=16, num_layers=2, num_heads=2, intermediate_dim=32,
        max_sequence_length=SEQ,
    ),
    "siglip_text": lambda: hub.SigLIPTextEncoder(
        vocabulary_size=VOCAB, embedding_dim=16, hidden_dim=16, num_layers=2, num_heads=2, intermediate_dim=32,
        max_sequence_length=SEQ,
    ),
    "rwkv7": lambda: hub.RWKV7Backbone(
        hidden_size=16, head_size=8, num_layers=2, vocabulary_size=VOCAB, intermediate_dim=32, gate_lora=8,
        mv_lora=8, aaa_lora=8, decay_lora=8,
    ),
    "edrec": lambda: hub.EdRecBackbone(
        vocab_size=VOCAB, num_layers_enc=1, num_layers_dec=1, hidden_dim=16, intermediate_dim=32, num_heads=2
    ),
    "gemma4": lambda: hub.Gemma4Backbone(
        **_kw(num_query_heads=2, num_key_value_heads=1, head_dim=8), image_size=16, sliding_window_size=4,
        sliding_window_pattern=2,
    ),
    "moonshine": lambda: hub.MoonshineBackbone(
        vocabulary_size=VOCAB, filter_dim=16, encoder_num_layers=1, decoder_num_layers=1, hidden_dim=16,
        intermediate_dim=32, encoder_num_heads=2, decoder_num_heads=2, max_position_embeddings=64,
    ),
    "pali_gemma": lambda: hub.PaliGemmaBackbone(
        **_kw(num_query_heads=2, num_key_value_heads=1, head_dim=8), image_size=16, vit_patch_size=4,
        vit_num_heads=2, vit_hidden_dim=16, vit_num_layers=1, vit_intermediate_dim=32,
    ),
}
# Which output of an encoder-decoder or multi-output backbone the head reads.
TEXT_OUTPUT = {"bart": "decoder_sequence_output", "t5": "decoder_sequence_output",
               "t5gemma": "decoder_sequence_output", "t5gemma2": "decoder_sequence_output",
               "whisper": "decoder_sequence_output", "edrec": "decoder_sequence_output",
               "moonshine": "decoder_sequence_output"}
# Raw audio: Moonshine's strided convolutions need 2048 samples for 4 encoder frames.
TEXT_SHAPES = {"moonshine": {"encoder_input_values": (2048, 1), "encoder_padding_mask": (2048,)}}
NO_ATTENTION = {"f_net", "rwkv7"}

# Image backbones (keras-hub): one or two stages of 8-16 filters, 32x32 inputs.
def _sd3_diffuser():
    """Stable Diffusion 3's MMDiT: the backbone's own functional graph is the sampling loop (its
    scheduler branches in Python on `num_steps`), so the census trains the part SD3 trains. The
    VAE and CLIP encoders it is built with are census families of their own."""
    from keras_hub.src.models.clip.clip_text_encoder import CLIPTextEncoder

    vae = vae_backbone.VAEBackbone([32] * 4, [1] * 4, [32] * 4, [1] * 4, sampler_method="mode")
    clip_l = CLIPTextEncoder(VOCAB, 16, 16, 1, 2, 32, "quick_gelu", -1, name="clip_l")
    clip_g = CLIPTextEncoder(VOCAB, 16, 16, 1, 2, 32, "gelu", -1, name="clip_g")
    return hub.StableDiffusion3Backbone(
        mmdit_patch_size=2, mmdit_hidden_dim=16, mmdit_num_layers=1, mmdit_num_heads=2, mmdit_position_size=32,
        mmdit_qk_norm=None, mmdit_dual_attention_indices=None, vae=vae, clip_l=clip_l, clip_g=clip_g,
        image_shape=(64, 64, 3)).diffuser


def _blip2():
    """BLIP-2: a ViT vision encoder, a Q-Former (cross-attention to the image) and an OPT decoder."""
    vision = hub.BLIP2VisionEncoder(
        image_size=16, patch_size=4, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
        use_patch_bias=True, use_class_token=True, use_mha_bias=True, use_mlp_bias=True, dropout_rate=0.0,
        layer_norm_epsilon=1e-6, initializer_range=0.02)
    qformer = hub.BLIP2QFormer(
        num_query_tokens=4, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, vision_dim=16,
        cross_attention_frequency=1, dropout=0.0, layer_norm_epsilon=1e-12)
    language_model = hub.BLIP2CustomOPT(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32, num_query_tokens=4,
        dropout=0.0, max_sequence_length=32, qformer_hidden_dim=16)
    return hub.BLIP2Backbone(vision, qformer, language_model)


def _d_fine():
    """D-FINE: a four-stage HGNetV2, a hybrid encoder over its last two stages, one decoder layer."""
    hgnetv2 = hub.HGNetV2Backbone(
        depths=[1] * 4, embedding_size=8, hidden_sizes=[16, 16, 32, 32], stem_channels=[3, 8, 8], hidden_act="relu",
        use_learnable_affine_block=False,
        stackwise_stage_filters=[[8, 8, 16, 1, 1, 3], [16, 8, 16, 1, 1, 3], [16, 8, 32, 1, 1, 3], [32, 8, 32, 1, 1, 3]],
        apply_downsample=[False, True, True, True], use_lightweight_conv_block=[False] * 4, image_shape=(64, 64, 3),
        out_features=["stage3", "stage4"])
    return hub.DFineBackbone(
        backbone=hgnetv2, decoder_in_channels=[16, 16], encoder_hidden_dim=16, num_labels=CLASSES, num_denoising=0,
        learn_initial_query=False, num_queries=8, anchor_image_size=(64, 64), feat_strides=[16, 32],
        num_feature_levels=2, hidden_dim=16, encoder_in_channels=[32, 32], encode_proj_layers=[1],
        num_attention_heads=2, encoder_ffn_dim=32, num_encoder_layers=1, hidden_expansion=0.34, depth_multiplier=0.5,
        eval_idx=-1, num_decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=32, decoder_n_points=[2, 2],
        lqe_hidden_dim=8, num_lqe_layers=2, out_features=["stage3", "stage4"], image_shape=(64, 64, 3), seed=0)


def _sam3():
    """SAM3: ViT vision encoder with FPN, text encoder, geometry (box prompt) encoder, DETR encoder and
    decoder, mask decoder; one box prompt (`shapes` in CASES)."""
    from keras_hub.src.models.sam3 import (sam3_detr_decoder, sam3_detr_encoder, sam3_geometry_encoder,
                                           sam3_mask_decoder, sam3_text_encoder, sam3_vision_encoder)

    size = (56, 56, 3)  # patch 14: a 4x4 grid
    return hub.SAM3PromptableConceptBackbone(
        vision_encoder=sam3_vision_encoder.SAM3VisionEncoder(
            image_shape=size, patch_size=14, num_layers=1, hidden_dim=16, intermediate_dim=32, num_heads=2,
            fpn_hidden_dim=16, fpn_scale_factors=[4.0, 2.0, 1.0, 0.5], pretrain_image_shape=(28, 28, 3),
            window_size=2, global_attn_indexes=[0]),
        text_encoder=sam3_text_encoder.SAM3TextEncoder(
            vocabulary_size=VOCAB, embedding_dim=16, hidden_dim=16, num_layers=1, num_heads=2, intermediate_dim=32),
        geometry_encoder=sam3_geometry_encoder.SAM3GeometryEncoder(
            num_layers=1, hidden_dim=16, intermediate_dim=32, num_heads=2, roi_size=7),
        detr_encoder=sam3_detr_encoder.SAM3DetrEncoder(num_layers=1, hidden_dim=16, intermediate_dim=32, num_heads=2),
        detr_decoder=sam3_detr_decoder.SAM3DetrDecoder(
            image_shape=size, patch_size=14, num_layers=1, hidden_dim=16, intermediate_dim=32, num_heads=2,
            num_queries=8),
        mask_decoder=sam3_mask_decoder.SAM3MaskDecoder(num_upsampling_stages=3, hidden_dim=16, num_heads=2))


IMAGE_BACKBONES = {
    "sam3": _sam3,
    "stable_diffusion_3": _sd3_diffuser,
    "d_fine": _d_fine,
    "blip2": _blip2,
    # Text-to-image transformer: image and text token streams with their position ids, a pooled
    # text vector `y` and the timesteps; head_dim 8 = sum(axes_dim).
    "flux": lambda: hub.FluxBackbone(
        input_channels=8, hidden_size=16, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1,
        axes_dim=[2, 2, 4], theta=10_000, use_bias=True, guidance_embed=False, image_shape=(8, 8),
        text_shape=(8, 8), image_ids_shape=(8, 3), text_ids_shape=(8, 3), y_shape=(8,)
    ),
    "vit": lambda: hub.ViTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32
    ),
    "deit": lambda: hub.DeiTBackbone(
        image_shape=(16, 16, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, intermediate_dim=32
    ),
    "dinov2": lambda: hub.DINOV2Backbone(
        patch_size=4, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32, image_shape=(16, 16, 3),
        position_embedding_shape=(16, 16, 3),
    ),
    "dinov3": lambda: hub.DINOV3Backbone(
        patch_size=4, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32, image_shape=(16, 16, 3),
    ),
    "clip": lambda: hub.CLIPVisionEncoder(
        patch_size=4, hidden_dim=16, num_layers=2, num_heads=2, intermediate_dim=32, image_shape=(16, 16, 3)
    ),
    "siglip": lambda: hub.SigLIPVisionEncoder(
        patch_size=4, hidden_dim=16, num_layers=2, num_heads=2, intermediate_dim=32, image_shape=(16, 16, 3)
    ),
    "metaclip_2": lambda: hub.MetaCLIP2VisionEncoder(
        patch_size=4, hidden_dim=16, num_layers=2, num_heads=2, intermediate_dim=32, image_shape=(16, 16, 3)
    ),
    "swin_transformer": lambda: hub.SwinTransformerBackbone(
        image_shape=(32, 32, 3), embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, patch_size=4,
    ),
    "vit_det": lambda: hub.ViTDetBackbone(
        hidden_size=16, num_layers=2, intermediate_dim=32, num_heads=2, global_attention_layer_indices=[1],
        image_shape=(32, 32, 3), patch_size=8, num_output_channels=8, window_size=2,
    ),
    "mit": lambda: hub.MiTBackbone(
        layerwise_depths=[1, 1], num_layers=2, layerwise_num_heads=[1, 2], layerwise_sr_ratios=[2, 1],
        max_drop_path_rate=0.0, layerwise_patch_sizes=[7, 3], layerwise_strides=[4, 2], image_shape=(32, 32, 3),
        hidden_dims=[8, 16],
    ),
    "segformer": lambda: hub.SegFormerBackbone(image_encoder=IMAGE_BACKBONES["mit"](), projection_filters=8),
    "resnet": lambda: hub.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 16],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block", image_shape=IMAGE,
    ),
    "vgg": lambda: hub.VGGBackbone(stackwise_num_repeats=[1, 1], stackwise_num_filters=[8, 16], image_shape=IMAGE),
    "densenet": lambda: hub.DenseNetBackbone(stackwise_num_repeats=[1, 1], image_shape=IMAGE, growth_rate=8),
    "xception": lambda: hub.XceptionBackbone(
        stackwise_conv_filters=[[8, 16], [16, 16]], stackwise_pooling=[False, True], image_shape=IMAGE
    ),
    "cspnet": lambda: hub.CSPNetBackbone(
        stem_filters=8, stem_kernel_size=3, stem_strides=1, stackwise_strides=2, stackwise_depth=[1, 1],
        stackwise_num_filters=[8, 16], down_growth=True, bottle_ratio=(0.5, 1.0), block_ratio=(1.0, 0.5),
        expand_ratio=(2.0, 1.0), block_type="dark_block", stage_type="csp", stem_padding="same", image_shape=IMAGE,
    ),
    "mobilenet": lambda: hub.MobileNetBackbone(
        stackwise_expansion=[[1], [2]], stackwise_num_blocks=[1, 1], stackwise_num_filters=[[8], [16]],
        stackwise_kernel_size=[[3], [3]], stackwise_num_strides=[[2], [2]], stackwise_se_ratio=[[None], [0.25]],
        stackwise_activation=[["relu"], ["hard_swish"]], stackwise_padding=[[1], [1]], output_num_filters=16,
        depthwise_filters=8, depthwise_stride=2, depthwise_residual=False, last_layer_filter=16,
        image_shape=IMAGE, input_num_filters=8,
    ),
    "efficientnet": lambda: hub.EfficientNetBackbone(
        stackwise_width_coefficients=[0.1, 0.1], stackwise_depth_coefficients=[1.0, 1.0],
        stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1], stackwise_input_filters=[32, 16],
        stackwise_output_filters=[16, 24], stackwise_expansion_ratios=[1, 4],
        stackwise_squeeze_and_excite_ratios=[0.25, 0.25], stackwise_strides=[1, 2],
        stackwise_block_types=["v1", "v1"], stackwise_force_input_filters=[0, 0], stackwise_nores_option=[False, False],
        input_shape=IMAGE, num_features=16,
    ),
    "deeplab_v3": lambda: hub.DeepLabV3Backbone(
        image_encoder=_tiny_resnet(), spatial_pyramid_pooling_key="P4", upsampling_size=4, dilation_rates=[2],
        low_level_feature_key="P2", projection_filters=8, image_shape=IMAGE,
    ),
    "retinanet": lambda: hub.RetinaNetBackbone(
        image_encoder=_tiny_resnet(), min_level=3, max_level=4, use_p5=False, image_shape=IMAGE,
    ),
    "basnet": lambda: hub.BASNetBackbone(
        image_encoder=_tiny_resnet(stages=4, image_shape=(None, None, 3)), num_classes=1, image_shape=IMAGE,
        projection_filters=64,
    ),
    "depth_anything": lambda: hub.DepthAnythingBackbone(
        image_encoder=hub.DINOV2Backbone(
            patch_size=4, num_layers=2, hidden_dim=16, num_heads=2, intermediate_dim=32, image_shape=(16, 16, 3),
            position_embedding_shape=(16, 16, 3),
        ),
        reassemble_factors=[2, 1], neck_hidden_dims=[8, 8], fusion_hidden_dim=8, head_hidden_dim=8,
        head_in_index=-1, feature_keys=["stage1", "stage2"],
    ),
    "vae": lambda: vae_backbone.VAEBackbone(
        encoder_num_filters=[32, 32], encoder_num_blocks=[1, 1], decoder_num_filters=[32, 32],
        decoder_num_blocks=[1, 1], image_shape=(16, 16, 3),
    ),
    "parseq": lambda: hub.PARSeqBackbone(
        image_encoder=hub.ViTBackbone(
            image_shape=(16, 16, 3), patch_size=4, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
            use_class_token=False,
        ),
        vocabulary_size=VOCAB, max_label_length=SEQ, decoder_hidden_dim=16, num_decoder_layers=1,
        num_decoder_heads=2, decoder_mlp_dim=32,
    ),
    "video_prism": lambda: hub.VideoPrismBackbone(
        num_frames=2, patch_size=4, hidden_dim=16, intermediate_dim=32, num_heads=2, num_spatial_layers=1,
        num_temporal_layers=1, num_auxiliary_layers=0, image_shape=(16, 16, 3),
    ),
    "mobilenetv5": lambda: hub.MobileNetV5Backbone(
        stackwise_block_types=[["er"], ["uir", "mqa"]], stackwise_num_blocks=[1, 2],
        stackwise_num_filters=[[8], [16, 16]], stackwise_strides=[[2], [2, 1]],
        stackwise_act_layers=[["relu"], ["relu", "relu"]], stackwise_exp_ratios=[[2.0], [2.0, 2.0]],
        stackwise_se_ratios=[[0.0], [0.0, 0.0]], stackwise_dw_kernel_sizes=[[0], [3, 0]],
        stackwise_dw_start_kernel_sizes=[[0], [0, 0]], stackwise_dw_end_kernel_sizes=[[0], [0, 0]],
        stackwise_exp_kernel_sizes=[[3], [0, 0]], stackwise_pw_kernel_sizes=[[1], [0, 0]],
        stackwise_num_heads=[[0], [0, 2]], stackwise_key_dims=[[0], [0, 8]], stackwise_value_dims=[[0], [0, 8]],
        stackwise_kv_strides=[[0], [0, 1]], stackwise_use_cpe=[[False], [False, False]], image_shape=IMAGE,
        stem_size=8, num_features=16, use_msfa=False,
    ),
    "hgnetv2": lambda: hub.HGNetV2Backbone(
        depths=[1, 1], embedding_size=8, hidden_sizes=[16, 16], stem_channels=[3, 8, 8], hidden_act="relu",
        use_learnable_affine_block=False,
        stackwise_stage_filters=[[8, 8, 16, 1, 1, 3], [16, 8, 16, 1, 1, 3]], apply_downsample=[False, True],
        use_lightweight_conv_block=[False, False], image_shape=IMAGE,
    ),
}
IMAGE_SIZE = {name: (16, 16, 3) for name in ("blip2", "depth_anything", "parseq", "vae", "video_prism", "vit", "deit", "dinov2", "dinov3", "clip", "siglip", "metaclip_2")}
IMAGE_SIZE["d_fine"] = (64, 64, 3)  # two stride-16/32 feature levels
IMAGE_SIZE["sam3"] = (56, 56, 3)
IMAGE_OUTPUT = {"d_fine": "last_hidden_state", "sam3": "pred_boxes"}  # query states; predicted boxes
IMAGE_SHAPES = {"sam3": {"boxes": (1, 5), "box_labels": (1,)}}  # one box prompt
CONVNETS = {
    "basnet", "cspnet", "deeplab_v3", "densenet", "efficientnet", "hgnetv2", "mobilenet", "mobilenetv5", "resnet",
    "retinanet", "vae", "vgg", "xception",
}
CONV_ATTENTION = {"mobilenetv5"}  # convnets with attention blocks (MobileNetV5's multi-query attention)

APPLICATIONS = {
    "app_resnet": _application(keras.applications.ResNet50),
    "app_resnet_v2": _application(keras.applications.ResNet50V2),
    "app_mobilenet": _application(keras.applications.MobileNet, alpha=0.25),
    "app_mobilenet_v2": _application(keras.applications.MobileNetV2, alpha=0.35),
    "app_mobilenet_v3": _application(keras.applications.MobileNetV3Small, alpha=0.75, minimalistic=True),
    "app_efficientnet": _application(keras.applications.EfficientNetB0),
    "app_efficientnet_v2": _application(keras.applications.EfficientNetV2B0),
    "app_densenet": _application(keras.applications.DenseNet121),
    "app_convnext": _application(keras.applications.ConvNeXtTiny),
    "app_xception": _application(keras.applications.Xception, shape=(71, 71, 3)),
    "app_inception_v3": _application(keras.applications.InceptionV3, shape=(75, 75, 3)),
    "app_inception_resnet_v2": _application(keras.applications.InceptionResNetV2, shape=(75, 75, 3)),
    "app_nasnet": _application(keras.applications.NASNetMobile),
    "app_vgg": _application(keras.applications.VGG16),
}

_STOCK = "fails without keras_amp too, under stock Keras's dtype policy"
# (ESM, RoFormerV2, Flux, D-FINE and SAM3 call ops.arange(dtype=float16), which stock Keras cannot trace:
# keras_amp's arange rule computes it as a float32 range, so they run under mixed_float16 too.)
_MOE = (f"{_STOCK} (both mixed policies): its sparse-MoE block multiplies float32 router weights by 16-bit "
        "hidden states (TypeError: Input 'y' of 'Mul' Op has type float32 that does not match type float16)")
# Family (or "family/policy") -> why the census does not run it.
SKIPPED: dict[str, str] = {
    "mixtral": _MOE,
    "qwen_moe": _MOE,
    "qwen3_moe": _MOE,
    "qwen3_5_moe": _MOE,
    "moonshine": (f"{_STOCK} (both mixed policies): MoonshineEncoderBlock adds a float32 tensor to its 16-bit "
                  "rotary embedding (InvalidArgumentError: cannot compute AddV2 as input #1 was expected to be "
                  "a float tensor but is a half tensor)"),
    "app_regnet": "keras.applications in Keras 3.15 has no RegNet",
    "sam": (f"{_STOCK} (both mixed policies): traced, SAMPromptEncoder multiplies its 16-bit point coordinates by "
            "a float32 positional matrix (TypeError: Input 'y' of 'BatchMatMulV2' Op has type float32 that does not "
            "match type float16). Its image encoder, ViTDet, is in the census (vit_det)"),
    "rqvae": "not exported by keras_hub.models (no public backbone class in 0.32)",
}


def _case(name, recipe, build, **kwargs):
    policies = tuple(p for p in POLICIES if f"{name}/{p}" not in SKIPPED)
    return Case(name, recipe, build, policies=policies, **kwargs)


CASES: tuple[Case, ...] = tuple(
    case for case in
    [_case(n, "transformer", _with_head(f, TEXT_OUTPUT.get(n), shapes=TEXT_SHAPES.get(n)),
           attention=n not in NO_ATTENTION)
     for n, f in sorted(TEXT.items())]
    + [_case(n, "cnn" if n in CONVNETS else "transformer", _with_head(f, IMAGE_OUTPUT.get(n), IMAGE_SIZE.get(n, IMAGE), IMAGE_SHAPES.get(n)),
             attention=n not in CONVNETS or n in CONV_ATTENTION)
       for n, f in sorted(IMAGE_BACKBONES.items())]
    + [_case(n, "cnn", f, attention=False, probabilities=True) for n, f in sorted(APPLICATIONS.items())]
    if case.name not in SKIPPED
)


# The independent audit: a static walk over the graph of one traced training step.
#
# It shares no code with keras_amp's op rules or diagnostics. Only ops with a path to the step's
# outputs (the loss and the gradients) count: keras_amp's rules rebuild a softmax's input chain in
# float32 and leave the original 16-bit ops dead in the graph. The walk follows nested function
# calls (both ways: call outputs into the body, body placeholders back to the callers), sees
# through IdentityN (`tf.custom_gradient`: output i is input i) and treats a control-flow op's
# branches and loop bodies as live whole.

SIXTEEN_BIT = (tf.float16, tf.bfloat16)
CALLS = ("PartitionedCall", "StatefulPartitionedCall")
CONTROL_FLOW = {"If": ("then_branch", "else_branch"), "StatelessIf": ("then_branch", "else_branch"),
                "While": ("cond", "body"), "StatelessWhile": ("cond", "body")}
SOFTMAX = ("Softmax", "LogSoftmax")
MATMULS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum")
# What may sit between QK^T and the softmax: scaling, masking, biases, soft caps, reshapes.
# ConcatV2: GPT-OSS appends its attention-sink logits to the scores before the softmax. BiasAdd: a per-key
# bias vector added with `ops.add` under keras_amp (its bias rule).
SCORE_PATH = {"Cast", "Mul", "AddV2", "Add", "Sub", "RealDiv", "SelectV2", "Select", "Reshape", "Transpose",
              "ExpandDims", "Squeeze", "Identity", "Neg", "Tanh", "GatherV2", "StridedSlice", "Maximum",
              "Minimum", "ConcatV2", "BiasAdd", "BiasAddV1"}
# What may sit between a weight and a matmul operand (a read, a cast, a reshape).
WEIGHT_PATH = {"Cast", "Identity", "Reshape", "Transpose", "ExpandDims", "Squeeze", "StridedSlice", "GatherV2"}
WEIGHT_READS = ("ReadVariableOp", "ResourceGather", "VarHandleOp")
# A root fed by a reduction is a norm's statistic: sqrt(mean(x^2) + eps), possibly clamped or cast.
ROOT_PATH = {"AddV2", "Add", "Maximum", "Identity", "Cast", "Mul", "RealDiv"}
REDUCTIONS = ("Mean", "Sum")


@dataclasses.dataclass(frozen=True)
class Finding:
    """One sensitive op of the traced step: `kind` is "softmax", "norm" or "qk"."""

    kind: str
    op_type: str
    dtype: str
    path: str

    def __str__(self):
        return f"{self.kind}: {self.op_type} in {self.dtype} at {self.path}"


def _key(tensor):
    return (id(tensor.graph), tensor.op.name, tensor.value_index)


class _Graphs:
    """Function bodies by name, and for each body the call ops that call it."""

    def __init__(self, graph):
        self.root = graph
        self.bodies = {}
        self.callers = {}  # id(body) -> [(caller graph's call op)]
        self.names = {}  # id(body) -> name of its first caller, for paths
        self.indices = {}  # id(body) -> {placeholder name: input position}

    def body(self, op, attr="f"):
        name = op.get_attr(attr).name
        graph = op.graph
        while True:
            try:
                fn = graph._get_function(name)
            except Exception:  # noqa: BLE001 - not registered in this graph: look in the outer one
                fn = None
            if fn is not None:
                break
            graph = getattr(graph, "outer_graph", None)
            if graph is None:
                raise ValueError(f"function {name!r} of {op.name!r} is not registered in any enclosing graph")
        body = self.bodies.setdefault(name, fn.graph)
        if op not in self.callers.setdefault(id(body), []):
            self.callers[id(body)].append(op)
            self.names.setdefault(id(body), self.path(op))
        return body

    def input_index(self, placeholder):
        """The position of a body's placeholder among the body's inputs (and its callers'), or None."""
        graph = placeholder.graph
        if id(graph) not in self.indices:
            self.indices[id(graph)] = {p.op.name: i for i, p in enumerate(graph.inputs)}
        return self.indices[id(graph)].get(placeholder.name)

    def path(self, op):
        prefix = self.names.get(id(op.graph))
        return f"{prefix}/{op.name}" if prefix else op.name


def _live(graphs: _Graphs):
    """Ops with a path to the root graph's outputs, as {(id(graph), op name): op}."""
    seen, live, stack = set(), {}, list(graphs.root.outputs)
    while stack:
        tensor = stack.pop()
        if tensor is None or _key(tensor) in seen:
            continue
        seen.add(_key(tensor))
        op = tensor.op
        live[(id(op.graph), op.name)] = op
        if op.type in CALLS:
            body = graphs.body(op)
            stack.append(body.outputs[tensor.value_index])
            # A body placeholder already reached from another caller maps to this caller too.
            for i, placeholder in enumerate(body.inputs):
                if _key(placeholder) in seen:
                    stack.append(op.inputs[i])
        elif op.type in CONTROL_FLOW:
            stack.extend(op.inputs)
            for attr in CONTROL_FLOW[op.type]:
                body = graphs.body(op, attr)
                stack.extend(body.outputs)
                live.update({(id(body), o.name): o for o in body.get_operations()})
        elif op.type == "IdentityN":
            stack.append(op.inputs[tensor.value_index])
        elif op.type == "Placeholder" and op.graph is not graphs.root:
            index = graphs.input_index(op)
            if index is not None:
                stack.extend(caller.inputs[index] for caller in graphs.callers.get(id(op.graph), []))
        else:
            stack.extend(op.inputs)
    return live


def _producers(graphs: _Graphs, tensor):
    """The op producing `tensor`, seen through calls (into the body) and IdentityN."""
    op = tensor.op
    if op.type in CALLS:
        return _producers(graphs, graphs.body(op).outputs[tensor.value_index])
    if op.type == "IdentityN":
        return _producers(graphs, op.inputs[tensor.value_index])
    if op.type == "Placeholder" and op.graph is not graphs.root:
        index = graphs.input_index(op)
        if index is None:
            return [op]
        return [p for caller in graphs.callers.get(id(op.graph), []) for p in _producers(graphs, caller.inputs[index])]
    return [op]


def _reaches(graphs, tensor, through, targets):
    """Ops of type `targets` reached backwards from `tensor` through ops of type `through`."""
    found, seen, stack = [], set(), [tensor]
    while stack:
        for op in _producers(graphs, stack.pop()):
            if (id(op.graph), op.name) in seen:
                continue
            seen.add((id(op.graph), op.name))
            if op.type in targets:
                found.append(op)
            elif op.type in through:
                stack.extend(op.inputs)
    return found


def _dtype(op):
    return op.outputs[0].dtype if op.outputs else None


def _is_norm_statistic(graphs, op):
    """A variance term, or a root (or its gradient) of a mean or sum: not 1/sqrt(head_dim)."""
    if op.type == "SquaredDifference":
        return True
    if op.type in ("Sqrt", "Rsqrt"):
        return bool(_reaches(graphs, op.inputs[0], ROOT_PATH, REDUCTIONS))
    if op.type == "RsqrtGrad":  # inputs: the forward Rsqrt's output and the incoming gradient
        return any(_is_norm_statistic(graphs, p) for p in _producers(graphs, op.inputs[0]) if p.type == "Rsqrt")
    return False


def audit_graph(graph) -> list[Finding]:
    """Every live softmax and QK^T matmul of `graph` (any dtype), and its 16-bit norm statistics."""
    graphs = _Graphs(graph)
    live = _live(graphs)
    findings = []
    for op in list(live.values()):
        dtype = _dtype(op)
        if dtype is None:
            continue
        if op.type in SOFTMAX:
            findings.append(Finding("softmax", op.type, dtype.name, graphs.path(op)))
            for matmul in _reaches(graphs, op.inputs[0], SCORE_PATH, MATMULS):
                operands = matmul.inputs[:2]
                if not any(_reaches(graphs, x, WEIGHT_PATH, WEIGHT_READS) for x in operands):
                    # Named after the softmax it feeds: a shared function body serves several layers.
                    where = f"{graphs.path(op)} <- {graphs.path(matmul)}"
                    findings.append(Finding("qk", matmul.type, _dtype(matmul).name, where))
        elif dtype in SIXTEEN_BIT and _is_norm_statistic(graphs, op):
            findings.append(Finding("norm", op.type, dtype.name, graphs.path(op)))
    return sorted(set(findings), key=str)


def step_function(model, loss, optimizer):
    """One training step as a `tf.function`: the inference-mode loss, the training loss, and the
    gradients of the optimizer's scaled loss (built optimizer: a loss-scale optimizer's
    `scale_loss` needs its scale variable)."""

    @tf.function
    def step(x, y):
        inference = loss(y, model(x, training=False))
        with tf.GradientTape() as tape:
            value = loss(y, model(x, training=True))
            scaled = optimizer.scale_loss(value)
        return inference, value, tape.gradient(scaled, model.trainable_variables)

    return step


# The census check of one family under one policy.

# |loss_mixed - loss_float32| <= LOSS_RTOL * max(1, |loss_float32|), inference mode, same weights:
# float16 keeps 11 significant bits (relative step 9.8e-4), bfloat16 8 (7.8e-3).
LOSS_RTOL = {"mixed_float16": 5e-3, "mixed_bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Reference:
    weights: list
    loss: float
    seconds: float


_REFERENCES: dict[str, Reference] = {}


def _loss(case, model, x, y) -> float:
    return float(case.loss()(y, model(x, training=False)))


def _tensors(x):
    return keras.tree.map_structure(tf.convert_to_tensor, x)


def reference(case: Case) -> Reference:
    """The float32 model's weights and inference loss, built once per process for both policies."""
    if case.name not in _REFERENCES:
        if keras_amp.config().enabled or keras.config.dtype_policy().name != "float32":
            raise ValueError(f"The float32 reference needs the float32 policy. Received: "
                             f"policy={keras.config.dtype_policy().name}, keras_amp={keras_amp.config()}")
        start = time.perf_counter()
        keras.utils.set_random_seed(0)
        model = case.build()
        x, y = batch(case, model)
        _REFERENCES[case.name] = Reference(model.get_weights(), _loss(case, model, x, y), 0.0)
        _REFERENCES[case.name] = dataclasses.replace(_REFERENCES[case.name], seconds=time.perf_counter() - start)
        keras.backend.clear_session()
    return _REFERENCES[case.name]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What the census measured for one family under one policy.

    Args:
        findings: The audit's findings (every live softmax, norm statistic in 16 bits, QK^T).
        loss32: Float. The float32 model's inference loss.
        loss: Float. The mixed model's inference loss (traced), same weights and batch.
        step_loss: Float. The training-mode loss of the step.
        weights_finite: Bool. Whether every weight is finite after the step's update (with
            `keras_amp.wrap(SGD(1e-2))`: loss scaling under mixed_float16).
        seconds: Float. Wall time of this check (with the float32 reference when it built it).
        stock_loss: Float or None. Stock Keras's inference loss under the same policy, for the
            families in `LOSS_NOT_COMPARED` (None for the others).
    """

    findings: tuple
    loss32: float
    loss: float
    step_loss: float
    weights_finite: bool
    seconds: float
    stock_loss: float | None = None

    def low_precision(self):
        """The 16-bit findings: softmax and QK^T in 16 bits, and every norm finding."""
        return [f for f in self.findings if f.kind == "norm" or f.dtype in ("float16", "bfloat16")]

    def delta(self):
        return abs(self.loss - self.loss32)


def measure(case: Case, policy: str) -> Outcome:
    """Builds `case` under `policy` with the float32 weights and the recipe; traces one training
    step, audits its graph, runs it and applies its gradients.

    The step is traced once and is the graph audited, run and compared: Keras's own train function
    traces its loss-scale and optimizer updates per variable, several times the cost of this step, and an
    eager `train_on_batch` runs outside keras_amp's graph rules (README: eager execution has no
    graph to walk; T5's float16 mask is -inf there). The float32 reference is built by the first
    policy and dropped after the last one."""
    start = time.perf_counter()
    ref = reference(case)
    stock = stock_loss(case, policy, ref.weights) if case.name in LOSS_NOT_COMPARED else None
    if policy == case.policies[-1]:
        del _REFERENCES[case.name]  # the applications' weights run to hundreds of MB
    keras_amp.enable(policy)
    keras.utils.set_random_seed(0)
    model = case.build()
    model.set_weights(ref.weights)
    keras_amp.apply_recipe(model, case.recipe)
    x, y = _tensors(batch(case, model))
    optimizer = keras_amp.wrap(keras.optimizers.SGD(1e-2))  # no slot variables to create
    optimizer.build(model.trainable_variables)
    step = step_function(model, case.loss(), optimizer)
    findings = tuple(audit_graph(step.get_concrete_function(x, y).graph))
    with graph_optimizer_off():
        inference, step_loss, grads = step(x, y)
    optimizer.apply(grads, model.trainable_variables)
    finite = all(bool(np.all(np.isfinite(w))) for w in model.get_weights())
    return Outcome(findings, ref.loss, float(inference), float(step_loss), finite, time.perf_counter() - start,
                   stock)


@contextlib.contextmanager
def graph_optimizer_off():
    """Runs the step without Grappler: its passes over a training step of a few thousand ops take
    longer than running the step, which the census does once (BUILD_NOTES: the census's cost).
    What the census checks is in the traced graph, which Grappler never rewrites; its fusions
    would round a few intermediates less often, which the loss tolerance covers either way."""
    saved = tf.config.optimizer.get_experimental_options().get("disable_meta_optimizer", False)
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": saved})


def shard(group: str) -> list:
    """The `(case, policy)` pairs of one test module, each family's two policies in a row."""
    return [pytest.param(case, policy, id=f"{case.name}-{policy}")
            for case in CASES if GROUP[case.name] == group for policy in case.policies]


# Marks of every census test module.
MARKS = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:mixed_.* requested:keras_amp.AmpWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # applications: input shape; keras-hub: unused weights
]


def census_test(group: str) -> Callable:
    """The census test of one module (`test_census = census_test("vision")`): `check` for each
    of the group's (family, policy) pairs."""

    @pytest.mark.parametrize(("case", "policy"), shard(group))
    def test_census(case, policy):
        check(case, policy)

    return test_census


# Families whose mixed-precision loss is not compared with float32's, and why; the audit and the
# step are checked, and ours must lie by stock Keras's loss (`stock_loss`; `check`).
LOSS_NOT_COMPARED = {
    "d_fine": ("its decoder keeps the top-k encoder queries by score: with random weights the scores nearly "
               "tie, bfloat16 rounding picks other queries, and stock Keras's loss is as far from float32's"),
}


def stock_loss(case: Case, policy: str, weights: list) -> float:
    """The inference loss of `case` built under stock Keras's `policy` (keras_amp off), with `weights`."""
    saved = keras.config.dtype_policy()
    try:
        keras.config.set_dtype_policy(policy)
        keras.utils.set_random_seed(0)
        model = case.build()
        model.set_weights(weights)
        x, y = batch(case, model)
        return _loss(case, model, x, y)
    finally:
        keras.config.set_dtype_policy(saved)
        keras.backend.clear_session()


def check(case: Case, policy: str) -> Outcome:
    """`measure`, then every census requirement; one AssertionError lists all that fail."""
    outcome = measure(case, policy)
    failures = [f"16-bit {f}" for f in outcome.low_precision()]
    if case.attention and not any(f.kind == "qk" for f in outcome.findings):
        failures.append("guard: the audit found no QK^T matmul feeding a softmax")
    if not (math.isfinite(outcome.step_loss) and outcome.weights_finite):
        failures.append(f"train step: loss={outcome.step_loss}, weights finite={outcome.weights_finite}")
    bound = LOSS_RTOL[policy] * max(1.0, abs(outcome.loss32))
    if case.name in LOSS_NOT_COMPARED:
        # Guard that the reason still holds: stock Keras's loss under this policy is as far from float32's
        # (past the bound), and ours lies by stock's, within a tenth of that distance (keras_amp's own
        # roundings, such as a silu rounded once, can tip other near-tied choices too).
        stock, stock_off = outcome.stock_loss, abs(outcome.stock_loss - outcome.loss32)
        if not (stock_off > bound and abs(stock - outcome.loss) <= 0.1 * stock_off):
            failures.append(f"loss not compared ({LOSS_NOT_COMPARED[case.name]}), but stock's {stock} is not "
                            f"as far from float32's {outcome.loss32}, or ours {outcome.loss} is not by it")
    elif not outcome.delta() <= bound:
        failures.append(f"inference loss {outcome.loss} vs float32 {outcome.loss32}: |d|={outcome.delta():.3g} > {bound:.3g}")
    if failures:
        raise AssertionError(f"{case.name} under {policy}:\n  " + "\n  ".join(failures))
    return outcome


# Test modules (pytest-xdist `--dist loadscope` gives each module to one worker): split so that
# two workers share the census evenly; each family's two policies share its float32 reference.
GROUP = {
    **{name: "text_a" if i < len(TEXT) // 2 else "text_b" for i, name in enumerate(sorted(TEXT))},
    **{name: "vision" for name in IMAGE_BACKBONES},
    **{name: "applications" for name in APPLICATIONS},
}


def census_markdown() -> str:
    """README's census table: every family, its recipe, and per policy "pass" (the census test
    requires it: `make test` fails otherwise) or why it is skipped; then the families not run."""
    source = {**{n: "keras-hub" for n in TEXT}, **{n: "keras-hub" for n in IMAGE_BACKBONES},
              **{n: "keras.applications" for n in APPLICATIONS}}
    lines = ["| family | from | recipe | attention | mixed_float16 | mixed_bfloat16 |", "|---|---|---|---|---|---|"]
    for case in sorted(CASES, key=lambda c: (source[c.name], c.name)):
        passed = "pass (loss: as stock, below)" if case.name in LOSS_NOT_COMPARED else "pass"
        cells = [passed if p in case.policies else "skipped (below)" for p in POLICIES]
        lines.append(f"| {case.name} | {source[case.name]} | {case.recipe} | {'yes' if case.attention else 'no'} | "
                     + " | ".join(cells) + " |")
    lines.append("")
    for name, why in sorted(LOSS_NOT_COMPARED.items()):
        lines.append(f"`{name}`'s loss is checked against stock Keras's under the same policy, not float32's: {why} "
                     "(ours within a tenth of stock's distance from float32's).")
        lines.append("")
    lines.append(f"{len(CASES)} families. Not run, each with its reason:")
    lines.append("")
    for name, why in sorted(SKIPPED.items()):
        lines.append(f"- `{name}`: {why}")
    return "\n".join(lines) + "\n"
