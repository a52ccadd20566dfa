"""`LeanAdam` / `LeanAdamW`: Adam whose weights and moments live in 16 bits, updates compensated.

Stock mixed precision keeps every trainable weight as a float32 master (4 bytes) with two float32
Adam moments (8 bytes): 12 bytes per parameter. Storing the weight in 16 bits alone loses every
update smaller than half a 16-bit ulp of the weight (pure bfloat16 training stalls). The lean tier
stores, per parameter of a 16-bit layer:

- the weight in 16 bits (the dtype the layer computes in, so no cast is needed to read it);
- its compensation (`compensation=`):
  - "split" (default under bfloat16): the 16 low mantissa bits of the float32 master as uint16.
    Weight + compensation *are* the float32 master, bit for bit (`numerics.bits.split`).
  - "kahan" (default under float16, where no exact split exists): the remainder of the master in
    16 bits: about twice the 16-bit precision.
  - "stochastic": no compensation; the new weight is rounded up or down at random (unbiased, so
    small updates survive in expectation). bfloat16 only.
  - "none": plain rounding: pure 16-bit storage, which loses small updates (for comparison).
- Adam's moments in bfloat16 (`moments="bfloat16"`, default; float32's exponent range, so the
  second moment cannot underflow as in float16). The first moment is rounded to nearest, the
  second stochastically: its per-step change (`1 - beta_2` of it) is below bfloat16's precision,
  and rounding to nearest would freeze it. `moments="float32"` keeps Keras's float32 moments.

State per parameter: 2 (weight) + 2 (compensation) + 4 (moments) = 8 bytes by default, 6 with
"stochastic". The update itself is computed in float32 from the reconstructed master, in Keras
Adam's order of operations: with "split" and `moments="float32"` it is bit for bit the update of
`keras.optimizers.Adam` on a float32 master (run as TensorFlow ops, `jit_update=False`; the default
one XLA loop may fuse a multiply-add into an FMA). Stochastic rounding is seeded by the step and the
variable's index, so every replica rounds the same way.

Weights of layers that compute in float32 (islands) stay float32 with Keras's float32 moments.
`keras_amp.memory.prepare(model, optimizer)` hands the optimizer its weights (fit does it when
keras_amp is enabled); it must run before the optimizer is built. A `build` on weights none of which
`prepare` stored waits for it (Keras builds optimizers when it loads a model, and fit before its first
step); without it, the first `apply` builds the optimizer as Keras's Adam and warns (`AmpWarning`).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import tensorflow as tf

from keras_amp import _compat, validation
from keras_amp.memory import storage
from keras_amp.numerics import adam16, bits
from keras_amp.optimizers import loaded_state
from keras_amp.policy import AmpWarning

COMPENSATIONS = ("split", "kahan", "stochastic", "none")
# Weights larger than this are "large": under XLA their update writes into the variables' own
# buffers (`_update_in_place`); as TensorFlow ops (`jit_update=False`) it runs a slice of rows at a
# time (`adam16.update_in_chunks`). Either way no copy of the weight's whole state is held beside it.
CHUNK_ELEMENTS = 1 << 20
MOMENTS = ("bfloat16", "float32")


def _f32(x):
    return tf.cast(x, tf.float32)


@keras.saving.register_keras_serializable(package="keras_amp")
class LeanAdam(keras.optimizers.Adam):
    """`keras.optimizers.Adam` with 16-bit weights, compensated updates and 16-bit moments.

    Args:
        compensation: String or None. "split", "kahan", "stochastic" or "none" (module doc);
            None (default) picks "split" for bfloat16 weights and "kahan" for float16 ones.
        moments: String, "bfloat16" (default) or "float32".
        jit_update: Bool, default True. Compile each weight's update into XLA element-wise loops
            (`keras_amp.numerics.adam16`): one loop returning the new state, or for weights over
            `CHUNK_ELEMENTS` calls that write it into the variables' own buffers (only the new
            compensation half is held beside the state); faster than Keras's own Adam on a float32
            weight (BUILD_NOTES). Its float32 arithmetic may contract a multiply-add into one FMA
            (within a float32 rounding). False runs the arithmetic as TensorFlow ops, bit for bit
            Keras Adam's, a slice of rows at a time for weights over `CHUNK_ELEMENTS`.
        **kwargs: `keras.optimizers.Adam`'s arguments (`amsgrad`, `use_ema` and gradient
            accumulation are not supported).
    """

    def __init__(self, *args, compensation: str | None = None, moments: str = "bfloat16",
                 jit_update: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.jit_update = validation.check_bool("jit_update", jit_update)
        if compensation is not None:
            validation.check_choice("compensation", compensation, COMPENSATIONS)
        self.compensation = compensation
        self.moments = validation.check_choice("moments", moments, MOMENTS)
        for name, bad in (("amsgrad", self.amsgrad), ("use_ema", self.use_ema),
                          ("gradient_accumulation_steps", self.gradient_accumulation_steps)):
            if bad:
                raise ValueError(f"LeanAdam does not support `{name}`. Received: {name}={bad!r}")
        _compat.require(_compat.MEMORY)
        # id(Keras variable) -> (kind, dtype, initial compensation or None, the 16-bit value it goes with)
        self._pending = {}
        self._kinds = []  # by variable index: (kind, dtype) for a lean weight, else None
        self._low = []  # by variable index: the compensation variable, or None
        self._as_adam = False  # set while `_build_as_adam` builds on weights none of which is lean
        self._deferred_state = None  # a store loaded before build: assigned at build

    def get_config(self):
        return {**super().get_config(), "compensation": self.compensation, "moments": self.moments,
                "jit_update": self.jit_update}

    def _kind(self, dtype: str, path: str) -> str:
        kind = self.compensation or ("split" if dtype == "bfloat16" else "kahan")
        if kind in ("split", "stochastic") and dtype != "bfloat16":
            raise ValueError(f"LeanAdam: compensation={kind!r} needs bfloat16 weights; weight {path!r} is read "
                             f"in {dtype} (its layer's compute dtype). Use compensation='kahan' (or None).")
        return kind

    def adopt_lean(self, targets) -> list[str]:
        """Stores each `(variable, dtype)` of `targets` in `dtype` with this optimizer's compensation.

        Called by `keras_amp.memory.prepare` before the optimizer is built; returns the paths.
        """
        if self.built:
            raise ValueError(
                "LeanAdam was already built on float32 weights. Call keras_amp.memory.prepare(model, "
                "optimizer) (fit does it while keras_amp is enabled) before its first step.")
        paths = []
        for variable, dtype in targets:
            master = _f32(variable.value)
            kind = self._kind(dtype, variable.path)
            low = None
            if kind == "split":
                hi, low = bits.split(master)
            elif kind == "kahan":
                hi, low = bits.kahan_split(master, tf.as_dtype(dtype))
            else:
                hi = tf.cast(master, dtype)
            storage.set_storage(variable, dtype, hi)
            storage.mark_lean(variable, kind, low)
            self._pending[id(variable)] = (kind, dtype, low, hi)
            paths.append(variable.path)
        return paths

    def _lean_kind(self, variable):
        """(kind, dtype) for a lean weight (a Keras variable or Keras's tf.Variable of one), else None."""
        if not self.built:
            entry = self._pending.get(id(variable))
            return None if entry is None else entry[:2]
        return self._kinds[self._get_variable_index(variable)]

    def _is_lean(self, variable) -> bool:
        return self._lean_kind(variable) is not None

    def keeps_16bit(self, variable) -> bool:
        """Whether this optimizer keeps `variable` in 16 bits, its float32 master beside it."""
        try:
            return self._is_lean(variable)
        except KeyError:  # not one of its variables
            return False

    def load_own_variables(self, store):
        """Keras's loading; before the optimizer is built (a `.keras` file loads its state before
        `prepare` has run), the values wait and are assigned right after `build`."""
        if self.built:
            return super().load_own_variables(store)
        self._deferred_state = {key: store[key] for key in store.keys()}
        if "0" in self._deferred_state:  # Keras's first optimizer variable: `iterations`, read meanwhile
            with tf.init_scope():
                self._iterations.assign(self._deferred_state["0"])

    def save_own_variables(self, store):
        """Keras's saving; state loaded and not yet assigned (the optimizer not built since) is
        saved as it was loaded, not dropped."""
        if not loaded_state.save_held(self, store):
            super().save_own_variables(store)

    def build(self, var_list):
        if self.built:
            return
        var_list = list(var_list)
        if not any(id(v) in self._pending for v in var_list) and not self._as_adam:
            # Keras's model loading and fit's symbolic build build optimizers early; `prepare` (or the
            # first `apply`, `_build_as_adam`) builds this one later.
            return
        keras.optimizers.Optimizer.build(self, var_list)
        self._momentums, self._velocities, self._kinds, self._low = [], [], [], []
        for v in var_list:
            if id(v) not in self._pending:
                self._momentums.append(self.add_variable_from_reference(v, "momentum"))
                self._velocities.append(self.add_variable_from_reference(v, "velocity"))
                self._kinds.append(None)
                self._low.append(None)
                continue
            kind, dtype, low, hi = self._pending.pop(id(v))
            self._kinds.append((kind, dtype))
            base = v.path.replace("/", "_")
            moment_dtype = self.moments
            self._momentums.append(self.add_variable(v.shape, dtype=moment_dtype, name=f"{base}_momentum"))
            self._velocities.append(self.add_variable(v.shape, dtype=moment_dtype, name=f"{base}_velocity"))
            if low is None:
                self._low.append(None)
                continue
            compensation = self.add_variable(v.shape, dtype="uint16" if kind == "split" else dtype,
                                             name=f"{base}_compensation", initializer="zeros")
            # Assigned eagerly: Keras builds the optimizer inside the first traced step, where an
            # initializer reading `low` would capture it into that graph for the graph's life. Not where
            # the weight was assigned since `prepare` (a `tf.train.Checkpoint` restored it, and restores
            # the compensation as the variable is made): `low` belongs to the value it replaced.
            with tf.init_scope():
                if bits.same_bits(tf.convert_to_tensor(v._value), hi):
                    compensation.assign(tf.cast(low, compensation.dtype))
            storage.mark_lean(v, kind, compensation, owner=self)
            self._low.append(compensation)
        deferred = self._deferred_state
        if deferred is not None:
            self._deferred_state = None
            self.built = True
            # Eagerly: fit builds the optimizer inside the first traced step, where these assignments
            # would be ops of that graph instead of the loaded state (training resumed from zero).
            with tf.init_scope():
                super().load_own_variables(deferred)

    def apply(self, grads, trainable_variables=None):
        if not self.built and trainable_variables is not None:
            trainable_variables = list(trainable_variables)
            if not any(id(v) in self._pending for v in trainable_variables):
                self._build_as_adam(trainable_variables)
        return super().apply(grads, trainable_variables)

    def _build_as_adam(self, var_list) -> None:
        """Builds on weights none of which `prepare` stored in 16 bits: they train as Keras's Adam trains
        them (float32 moments), as a float32 layer's weights do beside lean ones. Warns: nothing is lean.
        Refuses where state loaded from a file waits for 16-bit weights (2-byte arrays: 16-bit moments or
        compensations), which a float32 build would drop."""
        deferred = self._deferred_state or {}
        if any(getattr(value, "dtype", None) is not None and value.dtype.itemsize == 2 for value in deferred.values()):
            raise ValueError(
                f"LeanAdam {self.name!r} holds state loaded from a file for weights stored in 16 bits: call "
                "keras_amp.memory.prepare(model, optimizer) before training (fit does it while keras_amp is "
                "enabled), or that state is lost.")
        warnings.warn(
            f"LeanAdam {self.name!r} trains {len(var_list)} weight(s), none stored in 16 bits, as "
            "keras.optimizers.Adam does (float32 moments): no memory is saved. Call "
            "keras_amp.memory.prepare(model, optimizer) on the built model before the first step (fit does it "
            "while keras_amp is enabled); layers that compute in float32 keep float32 weights.",
            AmpWarning, stacklevel=3)
        self._as_adam = True
        try:
            with keras.name_scope(self.name, caller=self):
                self.build(var_list)
        finally:
            self._as_adam = False

    def _store(self, variable, new, seed):
        index = self._get_variable_index(variable)
        (kind, dtype), low = self._kinds[index], self._low[index]
        if kind == "split":
            hi, rest = bits.split(new)
            low.assign(rest)
        elif kind == "kahan":
            hi, rest = bits.kahan_split(new, tf.as_dtype(dtype))
            low.assign(rest)
        elif kind == "stochastic":
            hi = bits.stochastic_round(new, seed)
        else:
            hi = tf.cast(new, dtype)
        variable.assign(hi)
        return hi

    def master_weights(self) -> dict[int, tf.Tensor]:
        """id(variable) -> its float32 master, for every weight this optimizer keeps in 16 bits."""
        if not self.built:
            return {}
        return {id(v): storage.lean_master(v) for v in self._trainable_variables if self._is_lean(v)}

    def variable_index(self, variable) -> int:
        return self._get_variable_index(variable)

    def store_master(self, variable, master) -> None:
        """Stores float32 `master` as lean weight `variable`'s new value, as a step stores one (a value
        assigned inside `keras_amp.memory.float32_weights`)."""
        self._store(variable, _f32(master), tf.constant([0, 0], tf.int32))

    def _apply_weight_decay(self, variables):
        # Lean weights decay inside update_step, on the float32 master.
        super()._apply_weight_decay([v for v in variables if not self._is_lean(v)])

    def update_step(self, gradient, variable, learning_rate):
        if not self._is_lean(variable):
            return super().update_step(gradient, variable, learning_rate)
        index = self._get_variable_index(variable)
        kind, dtype = self._kinds[index]
        lr = _f32(learning_rate)
        local_step = _f32(self.iterations + 1)
        beta_1_power = tf.pow(_f32(self.beta_1), local_step)
        beta_2_power = tf.pow(_f32(self.beta_2), local_step)
        alpha = lr * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        decay = self.weight_decay is not None and self._use_weight_decay(variable)
        # Keras's constants: 1 - beta in Python, then float32.
        scalars = tf.stack([lr, alpha, tf.constant(1 - self.beta_1, tf.float32),
                            tf.constant(1 - self.beta_2, tf.float32), _f32(self.epsilon),
                            _f32(self.weight_decay if decay else 0.0)])
        seed = tf.stack([tf.cast(self.iterations, tf.int32), tf.constant(2 * index, tf.int32)])
        probe = getattr(self, "_keras_amp_update_probe", None)
        low_var = self._low[index]
        m_var, v_var = self._momentums[index], self._velocities[index]
        rows = variable.shape[0] if variable.shape.rank else 1
        large = int(np.prod(variable.shape)) > CHUNK_ELEMENTS
        if large and probe is None:  # the vanishing-update probe reads the single kernel's masters
            if self.jit_update:
                return self._update_in_place(kind, dtype, decay, variable, low_var, m_var, v_var, gradient,
                                             scalars, seed)
            if rows > 1:
                return adam16.update_in_chunks(adam16.kernel(kind, self.moments, decay, False, False), variable,
                                               low_var, m_var, v_var, gradient, scalars, self.iterations, index,
                                               CHUNK_ELEMENTS)
        fn = adam16.kernel(kind, self.moments, decay, probe is not None, self.jit_update)
        with tf.control_dependencies(self._after_large_updates() if large else []):  # on the state's reads
            low = tf.convert_to_tensor(low_var) if low_var is not None else tf.zeros((), tf.uint16)
            out = fn(tf.convert_to_tensor(variable), low, tf.convert_to_tensor(m_var),
                     tf.convert_to_tensor(v_var), tf.convert_to_tensor(gradient), scalars, seed)
        targets = [(variable, out[0]), (low_var, out[1]), (m_var, out[2]), (v_var, out[3])]
        for target, value in targets:
            if target is not None:
                target.assign(value)
        if large:  # later reads of the assigned variables run after their assignments
            self._record_large_update([tf.convert_to_tensor(t) for t, _ in targets if t is not None])
        if probe is not None:
            probe.record(variable, before=out[4], intended=out[5], realized=out[6])

    def _update_in_place(self, kind, dtype, decay, variable, low_var, m_var, v_var, gradient, scalars, seed):
        """A large weight's update as `adam16.in_place` calls, each writing into its variables' own
        buffers: the only state held twice is the new compensation half (2 bytes a parameter), not
        the whole new state (8 bytes a parameter) and its temporaries, which `kernel` returns to be assigned.
        The handles are the variables' own, or a replica's under `tf.distribute`'s update."""
        calls = adam16.in_place(kind, self.moments, decay, dtype)
        hi, m, v = variable.handle, m_var.handle, v_var.handle
        gradient = tf.convert_to_tensor(gradient)
        with tf.control_dependencies(self._after_large_updates()):
            if low_var is None:
                done = calls.single(hi, m, v, gradient, scalars, seed)
            else:
                low = low_var.handle
                first = calls.first(hi, low, m, v, gradient, scalars)
                done = calls.second(hi, low, first, m, v, gradient, scalars)
                with tf.control_dependencies([done]):
                    done = calls.put(low if kind == "split" else hi, first)
            with tf.control_dependencies([done]):
                done = calls.moments(m, v, gradient, scalars, seed)
        self._record_large_update([done])
        return done

    def _after_large_updates(self) -> list:
        """The previous large weight's update in this trace, which the next one waits for: each
        holds new state beside the old until it is written, and TF would run them all at once.
        Eagerly, ops run one after another: nothing to wait for, nothing kept."""
        if tf.executing_eagerly():
            return []
        graph = tf.compat.v1.get_default_graph()
        if getattr(self, "_large_updates", (None,))[0] is not graph:
            self._large_updates = (graph, [])
        return list(self._large_updates[1])

    def _record_large_update(self, tensors) -> None:
        if not tf.executing_eagerly():
            self._large_updates[1].extend(tensors)

@keras.saving.register_keras_serializable(package="keras_amp")
class LeanAdamW(LeanAdam):
    """`LeanAdam` with `keras.optimizers.AdamW`'s default decoupled weight decay (0.004)."""

    def __init__(self, *args, weight_decay: float = 0.004, **kwargs):
        if weight_decay is None:  # ValueError, as keras.optimizers.AdamW raises
            raise ValueError("Argument `weight_decay` must be a float. Received: weight_decay=None")
        weight_decay = validation.check_float("weight_decay", weight_decay, min_value=0.0)
        super().__init__(*args, weight_decay=weight_decay, **kwargs)
