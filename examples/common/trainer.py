"""One training configuration: policy -> data -> model -> recipe -> compile -> epochs -> a result.

`Trainer` is driven one epoch at a time, so `common.compare` can interleave a float32 twin with
the mixed-precision run (neighbours' load then hits both alike). A result holds the held-out
loss and accuracy, the median step time after warm-up, peak memory, the loss-scale counters
and the `check_model` verdict.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import statistics
import time
from typing import Any, Callable

from common import resume

LOSS = "sparse_categorical_crossentropy"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one run trains (the examples' flags)."""

    family: str
    recipe: str
    dataset: str
    epochs: int
    batch_size: int
    steps_per_epoch: int
    seq_len: int
    width: int
    depth: int
    learning_rate: float
    tier: str | None
    seed: int
    model_dir: str
    eval_steps: int | None = None
    max_examples: int | None = None
    data_dir: str | None = None
    verbose: int = 1
    show_plan: bool = False
    custom_epoch: Callable | None = None  # a custom training loop (custom_loop.py); None: fit
    optimizer: str = "adam"  # or the lean tier: "lean", "lean_stochastic", "lean_none" (16-bit policies)
    resume: bool = False  # continue from the last epoch saved in model_dir (common.resume)


def _rss_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Memory:
    """Process peak RSS above a baseline, and TensorFlow's CPU/GPU allocator peak.

    Linux resets the peak-RSS mark (VmHWM) by writing "5" to /proc/self/clear_refs, so the
    peak counts from `start()`; elsewhere the lifetime peak (ru_maxrss) is used.
    """

    def __init__(self):
        self.device = None

    def start(self):
        import tensorflow as tf

        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.baseline_kib = _rss_kib("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        gpus = tf.config.list_logical_devices("GPU")
        self.device = "GPU:0" if gpus else "CPU:0"
        try:
            tf.config.experimental.reset_memory_stats(self.device)
        except (ValueError, RuntimeError):
            self.device = None

    def peaks_mib(self) -> dict[str, float | None]:
        import tensorflow as tf

        peak = _rss_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        allocator = None
        if self.device is not None:
            try:
                allocator = tf.config.experimental.get_memory_info(self.device)["peak"] / 2**20
            except (ValueError, RuntimeError):
                allocator = None
        return {"rss_above_baseline_mib": (peak - self.baseline_kib) / 1024, "allocator_peak_mib": allocator}


class StepTimes:
    """Wall time of each training batch (on_train_batch_begin -> end)."""

    def __init__(self):
        import keras

        outer = self
        self.times: list[float] = []

        class _Callback(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                outer._start = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                outer.times.append(time.perf_counter() - outer._start)

        self.callback = _Callback()


def _StopAfterEpoch():
    import keras

    class StopAfterEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    return StopAfterEpoch()


def progress_bar(label: str | None = None):
    """Keras's progress bar with one epoch header, "[label] epoch i/n", or none (`common.compare` prints it)."""
    import keras

    class Progress(keras.callbacks.ProgbarLogger):
        def set_params(self, params):
            super().set_params(params)
            self.total_epochs = params["epochs"]
            self.epochs = 1  # ProgbarLogger uses `epochs` only for its "Epoch i/n" line, not printed for one

        def on_epoch_begin(self, epoch, logs=None):
            if label is not None:
                print(f"[{label}] epoch {epoch + 1}/{self.total_epochs}", flush=True)
            super().on_epoch_begin(epoch, logs)

    return Progress()


def evaluate(model, dataset, loss_fn, eval_steps: int | None = None) -> dict[str, float]:
    """Held-out loss and accuracy of `model` on `dataset` (float32 loss on float32 logits)."""
    import keras
    import numpy as np

    losses, correct, count = [], 0, 0
    for step, (x, y) in enumerate(dataset):
        if eval_steps is not None and step >= eval_steps:
            break
        logits = keras.ops.cast(model(x, training=False), "float32")
        losses.append(float(keras.ops.mean(loss_fn(y, logits))) * int(np.prod(y.shape)))
        hits = keras.ops.equal(keras.ops.cast(keras.ops.argmax(logits, -1), "int32"), keras.ops.cast(y, "int32"))
        correct += int(keras.ops.sum(keras.ops.cast(hits, "int32")))
        count += int(np.prod(y.shape))
    return {"eval_loss": sum(losses) / max(count, 1), "eval_accuracy": correct / max(count, 1),
            "eval_batches": len(losses)}


class Trainer:
    """Sets up one configuration under `policy`; `run_epoch()` trains one epoch; `finish()` reports."""

    def __init__(self, settings: Settings, policy: str, *, label: str):
        import keras

        import keras_amp
        from common import data as data_lib
        from common import models
        from common import scalar_logs

        self.settings, self.label = settings, label
        self.memory = Memory()
        self.memory.start()
        self.config = keras_amp.enable(policy)
        print(f"[{label}] policy {self.config.policy}: {self.config.reason}", flush=True)
        self.data = data_lib.load(settings.dataset, seq_len=settings.seq_len, batch_size=settings.batch_size,
                                  seed=settings.seed, data_dir=settings.data_dir,
                                  max_examples=settings.max_examples)
        keras.utils.set_random_seed(settings.seed)  # same initial weights in every configuration
        model = models.build(settings.family, self.data, width=settings.width, depth=settings.depth)
        if self.config.compute_dtype != "float32":
            if settings.show_plan:  # apply_recipe logs the same plan at INFO (absl's --verbosity=0)
                print(keras_amp.plan_recipe(model, settings.recipe), flush=True)
            # Per-layer policies: float32 islands where 16 bits is unsafe.
            model = keras_amp.apply_recipe(model, settings.recipe)
        self.model = model
        # keras_amp's bounded loss scaler under mixed_float16; the Adam itself otherwise.
        self.optimizer = keras_amp.wrap(self._adam(settings), tier=settings.tier)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.log_dir = os.path.join(settings.model_dir, label)
        self.checkpoint_dir = os.path.join(self.log_dir, "checkpoint")
        self.timer = StepTimes()
        self.history: list[dict[str, float]] = []
        self.epoch_steps: list[int] = []
        # Compiled in the custom loop too: `save_weights` then holds the optimizer's state (common.resume).
        model.compile(optimizer=self.optimizer, loss=self.loss_fn, metrics=["accuracy"])
        if settings.custom_epoch is None:
            self.callbacks = [self.timer.callback, *scalar_logs.callbacks(os.path.join(self.log_dir, "logs"))]
            if isinstance(self.optimizer, keras_amp.LossScaleOptimizer):
                # The counters and the batch_* scalars: a TensorBoard run of their own, logs/amp. The loss scale
                # is in fit's logs, so TensorBoard already writes epoch_loss_scale to logs/train: writing the
                # monitor's there too would show each epoch's value twice.
                self.callbacks.insert(1, keras_amp.callbacks.LossScaleMonitor(
                    log_dir=os.path.join(self.log_dir, "logs", "amp") if scalar_logs.available() else None))
            self.callbacks.append(progress_bar())  # last, like Keras's own: it shows what the others logged
        self.report = keras_amp.check_model(model, loss=self.loss_fn)  # float32 CE from 16-bit logits: safe
        self.run = resume.run_identity(settings, self.config.policy)
        self.start_epoch = 0  # epochs already trained (a resumed run)
        if settings.resume:
            self.start_epoch, self.history = resume.restore(self.checkpoint_dir, model, self.optimizer, self.run,
                                                            label, settings.epochs)
        elif (saved := resume.load_state(self.checkpoint_dir)) is not None:
            logs = os.path.join(self.log_dir, "logs")
            # TensorBoard events are appended, never replaced: the old run's stay beside the new run's.
            old_logs = (f"; the old run's TensorBoard events stay in {logs}, and TensorBoard shows both runs there "
                        "unless you remove that folder") if os.path.isdir(logs) else ""
            print(f"[{label}] {self.checkpoint_dir} holds a checkpoint after epoch {saved['epochs_done']}: this run "
                  f"starts over and replaces it after its first epoch (--resume continues it){old_logs}", flush=True)

    def _adam(self, settings):
        """Keras's Adam, or under a 16-bit policy the lean tier `settings.optimizer` names."""
        import keras

        import keras_amp

        if settings.optimizer == "adam" or self.config.compute_dtype == "float32":
            return keras.optimizers.Adam(settings.learning_rate)
        compensation = {"lean": None, "lean_stochastic": "stochastic", "lean_none": "none"}[settings.optimizer]
        return keras_amp.optimizers.LeanAdam(settings.learning_rate, compensation=compensation)

    def run_epoch(self, epoch: int) -> dict[str, float]:
        """Trains epoch `epoch` (0-based) and returns its logs."""
        settings = self.settings
        before = len(self.timer.times)
        if settings.custom_epoch is not None:
            logs = settings.custom_epoch(self, epoch)
        else:
            # epochs=settings.epochs so Keras numbers the epoch "3/4"; _StopAfterEpoch ends the call.
            history = self.model.fit(self.data.train_epoch(epoch), initial_epoch=epoch, epochs=settings.epochs,
                                     steps_per_epoch=settings.steps_per_epoch,
                                     callbacks=self.callbacks + [_StopAfterEpoch()], verbose=settings.verbose,
                                     shuffle=False)
            logs = {k: float(v[-1]) for k, v in history.history.items()}
        self.epoch_steps.append(len(self.timer.times) - before)
        self.history.append(logs)
        resume.save(self.checkpoint_dir, self.model, epoch + 1, self.history, self.run)
        return logs

    def evaluate(self) -> dict[str, float]:
        """Held-out loss and accuracy (float32 loss on float32 logits)."""
        return evaluate(self.model, self.data.eval, self.loss_fn, self.settings.eval_steps)

    def finish(self) -> dict[str, Any]:
        """The run's figures; disables keras_amp."""
        import keras_amp

        # Warm-up: the first epoch (tracing, first pass over the uncached data) is not timed.
        warm = self.timer.times[self.epoch_steps[0]:] if len(self.epoch_steps) > 1 else self.timer.times[1:]
        result = {
            "label": self.label,
            "policy": self.config.policy,
            "reason": self.config.reason,
            "data": self.data.source,
            "params": int(self.model.count_params()),
            "trainable_params": int(sum(math.prod(v.shape) for v in self.model.trainable_variables)),
            "optimizer": type(getattr(self.optimizer, "inner_optimizer", self.optimizer)).__name__,
            "state_bytes": keras_amp.memory.state_bytes(self.model, self.optimizer)["total"],
            "train_loss": self.history[-1].get("loss"),
            "train_accuracy": self.history[-1].get("accuracy"),
            **self.evaluate(),
            "median_step_s": statistics.median(warm) if warm else None,
            "timed_steps": len(warm),
            **self.memory.peaks_mib(),
            "check_model": str(self.report),
            "check_ok": self.report.ok,
            "log_dir": self.log_dir,
        }
        if isinstance(self.optimizer, keras_amp.LossScaleOptimizer):
            result.update(loss_scale=float(self.optimizer.scale),
                          overflow_count=int(self.optimizer.overflow_count.numpy()),
                          total_steps=int(self.optimizer.total_steps.numpy()))
        keras_amp.disable()
        return result
