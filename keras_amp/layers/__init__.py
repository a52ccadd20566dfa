"""Float32-island layers: numerically sensitive parts in float32 under any dtype policy."""

from keras_amp.layers.attention import MultiHeadAttention
from keras_amp.layers.float32 import Float32
from keras_amp.layers.logits import Logits
from keras_amp.layers.normalization import (
    BatchNormalization,
    GroupNormalization,
    LayerNormalization,
    RMSNormalization,
)
from keras_amp.layers.output_head import OutputHead
from keras_amp.layers.recurrent import GRU, LSTM, GRUCell, LSTMCell
from keras_amp.layers.softmax import Softmax

__all__ = [
    "BatchNormalization",
    "Float32",
    "GRU",
    "GRUCell",
    "GroupNormalization",
    "LSTM",
    "LSTMCell",
    "LayerNormalization",
    "Logits",
    "MultiHeadAttention",
    "OutputHead",
    "RMSNormalization",
    "Softmax",
]
