"""keras_amp.memory.reads: a frozen weight is stored in 16 bits only where every read is a 16-bit cast."""

import numpy as np
import pytest

import keras
import keras_amp
from keras_amp import memory
from keras_amp.memory import reads

hub = pytest.importorskip("keras_hub")


def _llama_lm():
    keras.utils.set_random_seed(0)
    backbone = hub.models.LlamaBackbone(vocabulary_size=64, num_layers=1, hidden_dim=16, intermediate_dim=32,
                                        num_query_heads=2, num_key_value_heads=1)
    backbone.enable_lora(2)
    tokens = keras.Input((8,), dtype="int32")
    hidden = backbone({"token_ids": tokens, "padding_mask": keras.ops.ones_like(tokens)})
    return keras.Model(tokens, backbone.token_embedding(hidden, reverse=True)), backbone


def test_frozen_llama_weights_go_16bit_the_head_too_and_the_forward_pass_keeps_its_bits():
    keras_amp.enable("mixed_bfloat16")
    model, backbone = _llama_lm()
    x = np.random.RandomState(0).randint(0, 64, (2, 8)).astype("int32")
    before = np.asarray(model(x), np.float32)
    done = memory.prepare(model)
    embedding = backbone.token_embedding
    # The untied reverse embeddings: Keras reads them without autocasting (Embedding turns it off);
    # keras_amp's matmul rule reads them through a bfloat16 cast (op_rules.matmul): stored in bfloat16.
    assert memory.storage_dtype(embedding.reverse_embeddings) == "bfloat16"
    # The embedding table is gathered, then cast to bfloat16: stored in bfloat16.
    assert memory.storage_dtype(embedding.embeddings) == "bfloat16"
    assert embedding.embeddings.path in done.frozen_16bit and len(done.frozen_16bit) >= 11
    np.testing.assert_array_equal(np.asarray(model(x), np.float32), before)
    assert not memory.prepare(model).changed  # decided once; not traced again


def test_weights_read_in_float32_stay_float32_and_the_forward_pass_keeps_its_bits():
    keras_amp.enable("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    # reverse_dtype="float32": the layer casts its input and weight to float32 itself.
    embedding = keras.layers.ReversibleEmbedding(64, 16, tie_weights=False, reverse_dtype="float32")
    tokens = keras.Input((8,), dtype="int32")
    model = keras.Model(tokens, embedding(keras.layers.Dense(16)(embedding(tokens)), reverse=True))
    embedding.trainable = False
    x = np.random.RandomState(0).randint(0, 64, (2, 8)).astype("int32")
    before = np.asarray(model(x), np.float32)
    done = memory.prepare(model)
    assert memory.storage_dtype(embedding.reverse_embeddings) == "float32"
    assert memory.storage_dtype(embedding.embeddings) == "bfloat16"  # guard: the rest did change
    assert done.frozen_16bit == (embedding.embeddings.path,)
    np.testing.assert_array_equal(np.asarray(model(x), np.float32), before)


def test_reads_verdict_per_variable_and_none_without_an_input_signature():
    keras_amp.enable("mixed_bfloat16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    kernel = model.layers[0].kernel
    assert reads.reads_16bit(model, [kernel], ["bfloat16"]) == {id(kernel): True}
    assert reads.reads_16bit(model, [kernel], ["float16"]) == {id(kernel): False}  # cast to bf16, not f16

    class Sub(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    sub = Sub()
    sub(np.ones((1, 3), "float32"))
    assert reads.reads_16bit(sub, [sub.dense.kernel], ["bfloat16"]) is None
