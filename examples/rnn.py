"""Stacked LSTMs with the "rnn" recipe: byte-level language model on Python's documentation.

    python examples/rnn.py                                          # offline, keras_amp.enable("auto")
    python examples/rnn.py --compare_float32 --policy=mixed_bfloat16
    python examples/rnn.py --dataset=imdb_reviews                   # tensorflow-datasets (network)

The "rnn" recipe keeps the recurrence's gates, nonlinearities and cell state float32 with its
input and recurrent matmuls in 16 bits (`keras_amp.Matmul16DTypePolicy`), and the rest, the
output layer included, in the compute dtype; --show_plan prints what each layer gets and why.
On a 2-core CPU an LSTM of this size is largely bound by per-timestep overhead: expect a small
speed-up there at most (see BUILD_NOTES.md).
"""

from __future__ import annotations

from absl import app

from common import data, flags

flags.define(datasets=data.TEXT_DATASETS, epochs=3, batch_size=32, steps_per_epoch=30, seq_len=64,
             width=256, depth=2)


def main(argv):
    del argv
    return flags.main("rnn", "rnn", "rnn")


if __name__ == "__main__":
    app.run(main, flags_parser=flags.parse)
