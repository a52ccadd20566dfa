"""A ResNet-style CNN with the "cnn" recipe.

    python examples/cnn.py                                  # offline: causal 1-D ResNet, next byte of pydoc text
    python examples/cnn.py --compare_float32                # and its float32 twin, side by side
    python examples/cnn.py --dataset=cifar10 --width=32     # 2-D ResNet on images (tensorflow-datasets)

Offline there is no image set on a fresh machine, so the default data is Python's documentation
text, read by a causal dilated Conv1D ResNet; with an image data set (mnist, fashion_mnist,
cifar10) the model is a Conv2D ResNet with BatchNormalization. The recipe keeps the first layer
(stem / embedding) and the logits head float32, the normalisations float32 (deny list), and runs
the convolutions in the compute dtype.
"""

from __future__ import annotations

from absl import app

from common import flags

flags.define(epochs=4, batch_size=32, steps_per_epoch=40, width=256, depth=4)


def main(argv):
    del argv
    return flags.main("cnn", "cnn", "cnn")


if __name__ == "__main__":
    app.run(main, flags_parser=flags.parse)
