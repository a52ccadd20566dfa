"""What a killed run resumes from (`--resume`): the training state after every epoch.

<log_dir>/checkpoint/ holds

    epoch-NNNN.weights.h5   Keras's `save_weights` of the compiled model after NNNN epochs: the
                            weights and the optimizer's state (keras_amp's LossScaleOptimizer: its
                            loss scale and counters; LeanAdam: its compensation);
    state.json              the epochs done, that file's name, each epoch's logs, and the settings
                            that define the run (data, model, optimizer, seed, resolved policy).

Each is written under a temporary name and renamed, the state last, and the older weights file
is deleted after that, so a run killed at any moment resumes from its last finished epoch. The
data order resumes too: epoch e's batches depend only on (seed, e) (`common.data`).
"""

from __future__ import annotations

import json
import os
from typing import Any

STATE = "state.json"
# The settings that make two runs the same run; --epochs may grow, logging and paths may change.
RUN_FIELDS = ("family", "recipe", "dataset", "batch_size", "steps_per_epoch", "seq_len", "width", "depth",
              "learning_rate", "optimizer", "tier", "seed", "max_examples")


class ResumeError(RuntimeError):
    """The checkpoint cannot be resumed with these settings."""


def run_identity(settings, policy: str) -> dict[str, Any]:
    """The settings that define a run, with the policy `enable()` resolved ("auto" -> what it chose)."""
    return {**{name: getattr(settings, name) for name in RUN_FIELDS}, "policy": policy}


def save(directory: str, model, epochs_done: int, history: list[dict[str, float]], run: dict[str, Any]) -> None:
    """Writes the state after `epochs_done` epochs (see the module docstring)."""
    os.makedirs(directory, exist_ok=True)
    weights = f"epoch-{epochs_done:04d}.weights.h5"
    temporary = os.path.join(directory, f"writing-{weights}")
    model.save_weights(temporary)
    os.replace(temporary, os.path.join(directory, weights))
    state = {"epochs_done": epochs_done, "weights": weights, "history": history, "run": run}
    with open(os.path.join(directory, STATE + ".tmp"), "w") as f:
        json.dump(state, f, indent=1)
    os.replace(os.path.join(directory, STATE + ".tmp"), os.path.join(directory, STATE))
    for name in os.listdir(directory):
        if name != weights and name.endswith(".weights.h5"):
            os.remove(os.path.join(directory, name))


def load_state(directory: str) -> dict[str, Any] | None:
    """The saved state, or None where nothing was saved yet."""
    try:
        with open(os.path.join(directory, STATE)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def check_same_run(saved: dict[str, Any], run: dict[str, Any], directory: str) -> None:
    """Raises ResumeError naming each setting that differs from the saved run's."""
    differ = [f"{name}: saved {saved.get(name)!r}, now {run[name]!r}" for name in run if saved.get(name) != run[name]]
    if differ:
        raise ResumeError(f"--resume: the run in {directory} was trained with other settings ({'; '.join(differ)}). "
                          "Resume with the flags it started with (only --epochs may change), or give another "
                          "--model_dir.")


def _others(directory: str) -> str:
    """A note naming the runs whose checkpoints sit beside `directory` (<model_dir>/<label>/checkpoint), or "":
    a run started under another --policy keeps its checkpoint in another label's folder."""
    model_dir = os.path.dirname(os.path.dirname(os.path.abspath(directory)))
    found = []
    for label in sorted(os.listdir(model_dir)) if os.path.isdir(model_dir) else []:
        other = os.path.join(model_dir, label, os.path.basename(directory))
        if os.path.abspath(other) != os.path.abspath(directory) and (state := load_state(other)) is not None:
            found.append(f"--policy={state['run'].get('policy', label)} after epoch {state['epochs_done']} in {other}")
        if len(found) == 3:
            break
    return f" (not the checkpoint of: {'; '.join(found)}: pass the flags that run started with)" if found else ""


def restore(directory: str, model, optimizer, run: dict[str, Any], label: str, epochs: int) -> tuple[int, list]:
    """Loads the last saved epoch's state into `model` and `optimizer`; returns (epochs done, their logs).

    (0, []) with a message where `directory` holds no state yet: the run starts at epoch 1.
    """
    import keras_amp

    state = load_state(directory)
    if state is None:
        print(f"[{label}] --resume: no checkpoint in {directory} yet; training from epoch 1{_others(directory)}",
              flush=True)
        return 0, []
    check_same_run(state["run"], run, directory)
    # As the first step would: 16-bit storage for LeanAdam's weights, then the optimizer's variables,
    # so that every saved variable has its place.
    keras_amp.memory.prepare(model, optimizer)
    optimizer.build(model.trainable_variables)
    path = os.path.join(directory, state["weights"])
    model.load_weights(path)
    done = state["epochs_done"]
    left = f"{epochs - done} of {epochs} epochs to go" if done < epochs else f"--epochs={epochs}: nothing left to train"
    print(f"[{label}] resumed after epoch {done} from {path} ({left})", flush=True)
    return done, state["history"]
