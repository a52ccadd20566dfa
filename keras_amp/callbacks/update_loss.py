"""`UpdateLossChecks`: `LossScaleMonitor(update_loss_every=N)` measures how much of each layer's
weight update is lost to rounding in one step of every N (`keras_amp.diagnostics.UpdateLossProbe`).

A mixin of the monitor. Off by default; when on, the probe is attached at `on_train_begin` (the
train function is traced again once), turned on at the start of every Nth batch and read at its
end: `monitor.update_loss` holds `{layer: {"lost": f, "stalled": f}}` of the latest measured step,
`update_loss_max` (the worst layer's larger fraction) goes into the batch's logs, and a layer whose
updates mostly vanish is diagnosed (symptom `updates_vanish`) through the decision tree.
"""

from __future__ import annotations

from keras_amp import validation
from keras_amp.diagnostics import vanishing_updates
from keras_amp.memory import storage


class UpdateLossChecks:
    def _init_update_loss(self, every, threshold=0.5):
        self.update_loss_every = None if every is None else validation.check_int(
            "update_loss_every", every, min_value=1)
        self.update_loss_threshold = threshold
        self.update_loss: dict[str, dict[str, float]] = {}
        self._update_probe = None
        self._measuring = False

    def _attach_update_probe(self) -> None:
        if self.update_loss_every is None or getattr(self.model, "optimizer", None) is None:
            return
        if self._update_probe is None or self._update_probe.variables != list(self.model.trainable_variables):
            self._update_probe = vanishing_updates.UpdateLossProbe(self.model)
            self.model.make_train_function(force=True)

    def on_train_batch_begin(self, batch, logs=None):
        if self._update_probe is not None and (self._batches + 1) % self.update_loss_every == 0:
            self._update_probe.start()
            self._measuring = True

    def _check_update_loss(self, logs) -> None:
        if not self._measuring:
            return
        self._measuring = False
        fractions = self._update_probe.stop()
        self.update_loss = vanishing_updates.by_layer(fractions)
        if logs is not None and self.update_loss:
            logs["update_loss_max"] = max(max(m.values()) for m in self.update_loss.values())
        found = vanishing_updates.vanishing_layers(fractions, self.update_loss_threshold)
        if found:
            bad = [f.layer for f in found]
            weights_16bit = any(storage.is_16bit_storage(v) for v in self._update_probe.variables
                                if v.path.rsplit("/", 1)[0] in bad)
            # The measurement only: what to do is the tree's, which asks how the weights are stored.
            detail = "; ".join(f"{f.layer}: {f.lost:.0%} of the requested change lost to rounding, "
                               f"{f.stalled:.0%} of its weights did not move" for f in found)
            self._report("updates_vanish", {"weights_16bit": weights_16bit}, detail, vanishing=", ".join(bad))
