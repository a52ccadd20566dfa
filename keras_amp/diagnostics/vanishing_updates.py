"""How much of each applied update is lost to rounding, per layer, whatever the storage tier.

An optimizer step asks for `w -> w - delta`. What the stored weight becomes is `w - delta` rounded
to the weight's storage: nothing is lost with a float32 master (to float32's 2^-24) or with
`LeanAdam`'s exact split; with a 16-bit weight and no compensation every `delta` below half a
16-bit ulp of `w` is lost outright (pure bfloat16 fine-tuning that never moves,
keras-team/keras-hub#2629). `UpdateLossProbe` measures, per weight and step,

    lost fraction = sum |intended change - stored change| / sum |intended change|

in float32, at the optimizer's own assignment, and the stalled fraction, the share of a weight's
elements that did not change at all. Both matter: pure bfloat16 Adam computes `1 - beta_2 ** t`
in bfloat16, where 0.999 ** t rounds to 1, so it asks for no update at all (nothing is lost at
the assignment, and every element stalls). Measured `LeanAdam` reports its master before and after;
any other Keras optimizer has its `assign_add` / `assign_sub` / `assign` of model weights
watched (on this optimizer object only). The measurement runs inside the train step only while
`active` is True (a variable, so turning it on and off needs no retrace); while off each step
pays one skipped `tf.cond` per weight. `LossScaleMonitor(update_loss_every=N)` turns it on for
one step in every N and logs the fractions.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from keras_amp import validation


def _f32(x):
    return tf.cast(tf.convert_to_tensor(x), tf.float32)


class UpdateLossProbe:
    """Watches `optimizer`'s updates of `model`'s trainable weights (see module doc).

    Args:
        model: A built `keras.Model`.
        optimizer: Its optimizer (a LossScaleOptimizer's inner optimizer is watched), or None for
            `model.optimizer`. Attach before the train function is traced (before `fit`).
    """

    def __init__(self, model, optimizer=None):
        validation.check_type("model", model, keras.layers.Layer, "a keras.Model")
        optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        validation.check_type("optimizer", optimizer, keras.optimizers.Optimizer,
                              "a keras.optimizers.Optimizer (or a compiled model)")
        self.optimizer = getattr(optimizer, "inner_optimizer", optimizer)
        self.variables = list(model.trainable_variables)
        with tf.init_scope():
            self.active = tf.Variable(False, trainable=False, name="update_loss_active")
            self._lost = [tf.Variable(0.0, trainable=False) for _ in self.variables]
            self._asked = [tf.Variable(0.0, trainable=False) for _ in self.variables]
            self._stalled = [tf.Variable(0.0, trainable=False) for _ in self.variables]
            self._count = [tf.Variable(0.0, trainable=False) for _ in self.variables]
        self._attach()

    def _keys(self):
        return {self.optimizer._var_key(v): i for i, v in enumerate(self.variables)}

    def _attach(self):
        if hasattr(self.optimizer, "adopt_lean"):
            self.optimizer._keras_amp_update_probe = self
        else:
            for name in ("assign", "assign_add", "assign_sub"):
                setattr(self.optimizer, name, self._watched(name, getattr(self.optimizer, name)))

    def _watched(self, name, original):
        def assign(variable, value):
            if self.optimizer._var_key(variable) not in self._keys():
                return original(variable, value)
            before = _f32(variable)
            # The change asked for, not `before + value` in float32: for a float32 master that sum is
            # where a step below 2**-24 of the weight is lost, and it would hide the loss.
            change = {"assign": lambda: _f32(value) - before, "assign_add": lambda: _f32(value),
                      "assign_sub": lambda: -_f32(value)}[name]()
            result = original(variable, value)
            self.record(variable, before=before, change=change, realized=_f32(variable))
            return result

        return assign

    def record(self, variable, *, before, realized, intended=None, change=None) -> None:
        """Adds one update of `variable` (float32 tensors) while `active`: the value `before`, the
        value `realized`, and either the exact value `intended` or the `change` asked for."""
        if (intended is None) == (change is None):
            raise ValueError("record() takes one of `intended` and `change`")
        index = self._keys().get(self.optimizer._var_key(variable))
        if index is None:
            return

        def add():
            asked = intended - before if change is None else change
            self._lost[index].assign_add(tf.reduce_sum(tf.abs(asked - (realized - before))))
            self._asked[index].assign_add(tf.reduce_sum(tf.abs(asked)))
            self._stalled[index].assign_add(tf.reduce_sum(tf.cast(tf.equal(realized, before), tf.float32)))
            self._count[index].assign_add(tf.cast(tf.size(before), tf.float32))
            return tf.constant(True)

        tf.cond(self.active, add, lambda: tf.constant(False))

    def start(self) -> None:
        """Measures from the next step on (no retrace)."""
        for v in self._lost + self._asked + self._stalled + self._count:
            v.assign(0.0)
        self.active.assign(True)

    def stop(self) -> dict[str, dict[str, float]]:
        """Stops measuring; returns `{weight path: {"lost": f, "stalled": f}}` for the steps measured."""
        self.active.assign(False)
        out = {}
        for v, lost, asked, stalled, count in zip(self.variables, self._lost, self._asked, self._stalled,
                                                  self._count):
            asked, count = float(asked.numpy()), float(count.numpy())
            out[v.path] = {"lost": float(lost.numpy()) / asked if asked > 0 else 0.0,
                           "stalled": float(stalled.numpy()) / count if count > 0 else 0.0}
        return out


def by_layer(fractions: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Per weight -> per layer, each measure the worst of the layer's weights."""
    out: dict[str, dict[str, float]] = {}
    for path, measures in fractions.items():
        layer = out.setdefault(path.rsplit("/", 1)[0], {"lost": 0.0, "stalled": 0.0})
        for key in layer:
            layer[key] = max(layer[key], measures[key])
    return out


@dataclasses.dataclass(frozen=True)
class VanishingLayer:
    """A layer whose updates mostly vanish: `lost` of the requested change was lost to rounding,
    `stalled` of its weights did not move (the worst of its weights, each in [0, 1])."""

    layer: str
    lost: float
    stalled: float

    @property
    def advice(self) -> str:
        return (f"{self.layer}: updates vanish ({self.lost:.0%} of the requested change lost to rounding, "
                f"{self.stalled:.0%} of its weights did not move). Weights stored in 16 bits round small "
                "updates away: train it with compensation (keras_amp.optimizers.LeanAdam) or keep a float32 "
                "master for this layer (a mixed policy, keras_amp.enable('mixed_bfloat16'), or "
                "dtype='mixed_bfloat16' on the layer). A float32 master loses only steps below 2**-24 "
                "of the weight: raise the learning rate or rescale the weights.")


def vanishing_layers(fractions: dict[str, dict[str, float]], threshold: float = 0.5) -> list[VanishingLayer]:
    """The layers whose updates mostly vanish (lost or stalled >= threshold), worst first."""
    layers = by_layer(fractions)
    return [VanishingLayer(layer, m["lost"], m["stalled"])
            for layer, m in sorted(layers.items(), key=lambda kv: -max(kv[1].values()))
            if max(m.values()) >= threshold]


def advice(fractions: dict[str, dict[str, float]], threshold: float = 0.5) -> list[str]:
    """One line per layer whose updates mostly vanish (`vanishing_layers`), with what to do."""
    return [found.advice for found in vanishing_layers(fractions, threshold)]
