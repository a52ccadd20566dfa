"""A Transformer with the "transformer" recipe: byte-level language model on Python's documentation.

    python examples/transformer.py                                  # offline, keras_amp.enable("auto")
    python examples/transformer.py --compare_float32                # and its float32 twin, side by side
    python examples/transformer.py --dataset=tiny_shakespeare       # tensorflow-datasets (network)
    python examples/transformer.py --dataset=imdb_reviews           # review classification

The "transformer" recipe runs the matmuls in the compute dtype and keeps softmax, the layer
norms and the loss float32; --show_plan prints what each layer gets and why.
"""

from __future__ import annotations

from absl import app

from common import data, flags

flags.define(datasets=data.TEXT_DATASETS, epochs=4, batch_size=32, steps_per_epoch=40, width=256, depth=2)


def main(argv):
    del argv
    return flags.main("transformer", "transformer", "transformer")


if __name__ == "__main__":
    app.run(main, flags_parser=flags.parse)
