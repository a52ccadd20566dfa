"""`LossScaleOptimizer`: bounded, tiered, logged, replica-consistent dynamic loss scaling.

The update rule is `scale_rule.adjust`; host-side logging of scale changes is `scale_log.py`.

Private Keras methods overridden here (no public hook exists), written against Keras 3.15.1: `build`,
`apply`, `_tf_apply`, `_common_apply`, `stateless_apply`, `load_own_variables`. Private members read:
`_overwrite_variable_with_gradient`, `_iterations`, `_variables`, `_trainable_variables`, Keras's
`no_automatic_dependency_tracking` and TensorFlow's `GraphOrParentsInXlaContext`. Each is a pin of
`keras_amp._compat` (feature `LSO`): on a Keras where one moved or changed, constructing this class
raises `_compat.FeatureOff` naming it (the overrides would otherwise stop being called in silence),
and `keras_amp.wrap()` warns and returns stock Keras's `LossScaleOptimizer` instead.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from absl import logging
from keras import ops

from keras_amp import _compat, validation
from keras_amp.optimizers import loaded_state, scale_rule, settings as lso_settings, tiers
from keras_amp.optimizers.scale_log import ScaleLog

# Where a pin is missing the feature is off (`__init__` refuses), but the class must still import.
_no_tracking = _compat.original("keras.src.utils.tracking.no_automatic_dependency_tracking") or (lambda f: f)
_in_xla_context = _compat.original("tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext")
_supports_no_merge_call = _compat.original(
    "tensorflow.python.distribute.merge_call_interim.strategy_supports_no_merge_call")


@keras.saving.register_keras_serializable(package="keras_amp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Dynamic (or static) loss scaling with a floor, a ceiling, counters and logging.

    A drop-in subclass of `keras.optimizers.LossScaleOptimizer`. The scale and all counters are
    optimizer variables: checkpointed, identical on every replica, readable without a sync in
    the step. Per call to `apply(grads)`:

    ```
    finite = all_reduce_sum(any_nonfinite(local grads)) == 0      # same on every replica
    if finite:
        inner_optimizer.apply(grads / scale)
    # else skipped: weights and inner optimizer state untouched
    state = scale_rule.adjust(rule, state, finite)   # growth (capped), back-off (floored,
                                                     # hysteresis), counters
    if scale_rule.min_scale_reached(rule, state):    # 10 overflows in a row at min_scale
        on_min_scale: "warn" -> one absl warning | "raise" -> MinScaleError | "ignore"
    ```

    `iterations` keeps the Keras meaning (steps applied by the inner optimizer, so learning-rate
    schedules see applied steps only and a skipped step leaves the inner state bit-identical);
    `total_steps` counts every call, so `total_steps == iterations + overflow_count`.

    Scale changes are logged through absl (step, old -> new, why), at most
    `log_lines_per_minute` lines a minute: from the step itself in `tf.function` (a host callback
    that runs only when the scale changed or `on_min_scale` must act), after each step in eager
    mode, and from the host (`host_check()`, called by `keras_amp.callbacks.LossScaleMonitor`)
    under XLA or in replica context, where no host callback runs inside the step.

    `on_min_scale="raise"` raises `MinScaleError` in eager mode and from `host_check()` /
    `LossScaleMonitor`; inside a compiled step (`fit`) the same message stops training as a
    `tf.errors.OpError` (TensorFlow wraps exceptions raised in host callbacks). An XLA-compiled step
    (`jit_compile=True`, Keras's "auto" on a GPU) cannot call the host: `fit` then applies `on_min_scale`
    when it ends (`finalize_variable_values`), `LossScaleMonitor` at each log point, and the first trace
    warns once (`AmpWarning`) under "raise".

    `load_weights` before build holds the state for the build (`loaded_state.hold`); meanwhile `scale`,
    `iterations`, `total_steps` and the counters read the loaded values.

    Args:
        inner_optimizer: The `keras.optimizers.Optimizer` instance to wrap.
        initial_scale: Float or None. Initial loss scale; must lie in [min_scale, max_scale].
            None takes the tier's value (stock Keras: 2**15).
        dynamic_growth_steps: Int >= 1 or None. Finite steps between scale increases. None takes
            the tier's value (stock Keras: 2000).
        name: String or None. Optimizer name.
        tier: None, "small", "medium", "large" or "auto". Defaults for the four values above;
            None keeps Keras's 2**15 / 2000 with bounds 1 and 2**24. "auto" picks by the
            trainable parameter count of the variables the optimizer is built with.
        min_scale: Float > 0 or None. Floor of the scale.
        max_scale: Float >= min_scale or None. Ceiling of the scale.
        growth_factor: Float > 1. Defaults to 2.0.
        backoff_factor: Float in (0, 1). Defaults to 0.5.
        hysteresis: Int >= 1. Consecutive overflows before the scale backs off. Defaults to 1.
        dynamic: Bool. False keeps the scale at `initial_scale` (static loss scaling) and still
            skips non-finite steps. Defaults to True.
        on_min_scale: "warn", "raise" or "ignore". What to do when steps keep overflowing at
            `min_scale`. Defaults to "warn".

    Example:

    ```python
    opt = keras_amp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), tier="auto")
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, callbacks=[keras_amp.callbacks.LossScaleMonitor()])
    opt.scale, int(opt.overflow_count.numpy())
    ```
    """

    min_scale_patience = 10
    log_lines_per_minute = 10

    def __init__(self, inner_optimizer, initial_scale=None, dynamic_growth_steps=None, name=None,
                 *, tier=None, min_scale=None, max_scale=None, growth_factor=2.0,
                 backoff_factor=0.5, hysteresis=1, dynamic=True, on_min_scale="warn", **kwargs):
        _compat.require(_compat.LSO)
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError("`inner_optimizer` must not itself be a LossScaleOptimizer (the loss would be scaled "
                             f"twice). Received: inner_optimizer={inner_optimizer!r}. Allowed: a plain "
                             "keras.optimizers.Optimizer")
        validation.check_type("inner_optimizer", inner_optimizer, keras.optimizers.Optimizer,
                              "a keras.optimizers.Optimizer")
        lso_settings.check_known_kwargs(kwargs)  # ValueError, as the stock constructor raises
        settings, explicit = lso_settings.check_arguments(
            initial_scale=initial_scale, dynamic_growth_steps=dynamic_growth_steps, name=name, tier=tier,
            min_scale=min_scale, max_scale=max_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, hysteresis=hysteresis, dynamic=dynamic,
            on_min_scale=on_min_scale, **kwargs)
        # The stock constructor validates the legacy base-optimizer kwargs and sets
        # `inner_optimizer.loss_scale_factor = None` (else gradients would be scaled twice).
        super().__init__(inner_optimizer, name=name, **kwargs)
        for key, value in settings.items():
            setattr(self, key, value)
        self._explicit = explicit
        self.tier = tier
        self.resolved_tier = None
        self._scale_log = ScaleLog()
        self._first_scale = None  # tier="auto": the scale an eager first step's loss took before build
        self._deferred_state = None  # a store loaded before build: assigned at build
        self._xla_warned = self._host_blind = False  # a step traced where it cannot call the host
        if tier == tiers.AUTO:  # the tier's values are known at build time
            for key, value in explicit.items():
                setattr(self, key, value)
        else:
            self._resolve(tiers.tier_values(tier))

    # ----------------------------------------------------------------- configuration
    def _resolve(self, values):
        resolved = lso_settings.resolve(self._explicit, values)
        lso_settings.check_bounds(self.dynamic, resolved, values.name)
        for key, value in resolved.items():
            setattr(self, key, value)
        self.resolved_tier = values.name
        self._scale_log.known_scale = self.initial_scale

    @property
    def rule(self) -> scale_rule.ScaleRule:
        """The constants of the update rule (`scale_rule.ScaleRule`); known once the tier is."""
        return scale_rule.ScaleRule(
            dynamic=self.dynamic, dynamic_growth_steps=self.dynamic_growth_steps,
            growth_factor=self.growth_factor, backoff_factor=self.backoff_factor,
            min_scale=self.min_scale, max_scale=self.max_scale, hysteresis=self.hysteresis,
            min_scale_patience=self.min_scale_patience)

    def get_config(self):
        # Exactly the constructor arguments. Once "auto" has been resolved, the chosen tier and
        # its values are recorded, so a loaded optimizer uses the values it was trained with.
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "initial_scale": self.initial_scale,
            "dynamic_growth_steps": self.dynamic_growth_steps,
            "tier": self.resolved_tier if self.tier == tiers.AUTO and self.resolved_tier else self.tier,
            "min_scale": self.min_scale, "max_scale": self.max_scale,
            "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
            "hysteresis": self.hysteresis, "dynamic": self.dynamic, "on_min_scale": self.on_min_scale,
        }

    # ----------------------------------------------------------------- state
    @_no_tracking
    def build(self, var_list):
        # A second build is a no-op, as Keras's Adam's (Keras's LossScaleOptimizer makes a second scale and
        # counter, and training then reads those, not the state a checkpoint restored into the first).
        if self.built:
            return
        if self.tier == tiers.AUTO and self.resolved_tier is None:
            self._resolve(tiers.tier_values(tiers.AUTO, var_list))
        # The first two keep the stock names and order, so stock-saved state maps onto ours.
        self.step_counter = self._counter("step_counter")
        self.dynamic_scale = self.add_variable(
            shape=(), dtype="float32", initializer=keras.initializers.Constant(self.initial_scale),
            aggregation="none", name="dynamic_scale")
        self._overflow_count = self._counter("overflow_count")
        self._consecutive_overflows = self._counter("consecutive_overflows")
        self._overflows_at_min_scale = self._counter("overflows_at_min_scale")
        self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)
        deferred, self._deferred_state = self._deferred_state, None
        loaded_state.release_inner_load(self)
        # Eagerly: `fit` may build inside its first traced step, where the assignments would be ops of
        # that graph, not the loaded state.
        if deferred:
            with tf.init_scope():
                self.load_own_variables(deferred)

    def _counter(self, name):
        return self.add_variable(shape=(), dtype="int", initializer=keras.initializers.Zeros(),
                                 aggregation="none", name=name)

    @property
    def scale(self) -> float:
        """The current loss scale as a Python float (a host read); before build, the scale the first
        step uses: a loaded one, else `initial_scale` (ValueError under tier="auto" without it: the
        variables decide it)."""
        if self.built:
            return float(ops.convert_to_numpy(self.dynamic_scale))
        return loaded_state.scale_before_build(self)

    def initial_scale_for(self, var_list) -> float:
        """The first step's scale once built with `var_list` (tier="auto": by their parameter count)."""
        if self.initial_scale is not None:
            return float(self.initial_scale)
        return float(tiers.tier_values(tiers.AUTO, var_list).initial_scale)

    overflow_count = loaded_state.built_variable(
        "overflow_count", "_overflow_count", "Variable: total skipped (non-finite) steps.")
    consecutive_overflows = loaded_state.built_variable(
        "consecutive_overflows", "_consecutive_overflows", "Variable: overflows since the last finite step.")
    overflows_at_min_scale = loaded_state.built_variable(
        "overflows_at_min_scale", "_overflows_at_min_scale", "Variable: consecutive overflows at `min_scale`.")
    total_steps = loaded_state.built_variable(
        "total_steps", "_iterations",
        "Variable: every `apply` call, applied or skipped (`iterations + overflow_count`).")

    @tf.autograph.experimental.do_not_convert  # as Keras's code (BUILD_NOTES, Structure: AutoGraph)
    def scale_loss(self, loss):
        if not self.built and self._deferred_state is not None:
            # `load_weights` before build: the loaded scale (an eager step unscales by the same value).
            scale = self.scale
            if tf.executing_eagerly():
                self._first_scale = scale
            return ops.multiply(loss, scale)
        if self.built or self.initial_scale is not None:
            return super().scale_loss(loss)
        # tier="auto", unbuilt: the scale depends on the variables `apply` builds with, so the loss takes
        # Keras's default scale. Eagerly (`fit(run_eagerly=True)`, a custom loop) `apply` unscales that step
        # by it. Traced (`fit` without a strategy), `apply` builds the optimizer in the same trace, creating
        # variables, so TensorFlow retraces with the built optimizer and this placeholder never runs.
        if tf.executing_eagerly():
            self._first_scale = tiers.KERAS_DEFAULT.initial_scale
        return ops.multiply(loss, tiers.KERAS_DEFAULT.initial_scale)

    def load_own_variables(self, store):
        if not self.built:
            # `load_weights` into a model whose optimizer is not built yet (a fresh model, the usual
            # resume): the values wait and load right after `build` (Keras's skips them with a warning,
            # and the scale and counters would restart).
            loaded_state.hold(self, store)
            return
        if not loaded_state.assign(self, store):
            super().load_own_variables(store)
        loaded_state.clamp_scale(self)
        self._scale_log.known_scale = self.scale

    def save_own_variables(self, store):
        if not loaded_state.save_held(self, store):  # loaded, not yet built: that state again
            super().save_own_variables(store)

    def finalize_variable_values(self, var_list):
        super().finalize_variable_values(var_list)
        # `fit` calls this on the host when training ends: where the step could not call the host (XLA,
        # replica context), the scale log and `on_min_scale` catch up here, one read per `fit`.
        if self.built and self._host_blind:
            self.host_check()

    # ----------------------------------------------------------------- the step
    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError("keras_amp.LossScaleOptimizer implements the TensorFlow backend's stateful "
                                  "`apply()`; `stateless_apply` (JAX) is not supported. Received: "
                                  f"backend={keras.backend.backend()!r}. Allowed: 'tensorflow'")

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        if self.built or not tf.executing_eagerly():
            self._first_scale = None  # only for the eager step that builds (see `scale_loss`)
        super().apply(grads, trainable_variables)
        self._first_scale = None
        if tf.executing_eagerly() and not tf.distribute.has_strategy():
            self.host_check()

    def _all_replicas_finite(self, grads):
        """The finite flag, all-reduced so every replica and worker takes the same branch."""
        finite = self.check_finite(grads)
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            # Gradients reach `apply` un-aggregated: replica 1 may overflow while replica 0 does
            # not. A SUM of 0/1 flags is exact in float32 for any realistic replica count.
            non_finite = tf.cast(tf.logical_not(finite), tf.float32)
            total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, non_finite)
            finite = tf.equal(total, 0.0)
        return finite

    def _tf_apply(self, grads, trainable_variables=None):
        if tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        finite = self._all_replicas_finite(grads)
        if _supports_no_merge_call():
            self._common_apply(grads, trainable_variables, finite=finite)
            return

        def _handle_cross_replica(distribution, finite, grads, trainable_variables):
            # Identical on every replica after the all-reduce above.
            finite = distribution.experimental_local_results(finite)[0]
            floor = loaded_state.steps_floor(self)

            def apply_fn():
                distribution.extended.call_for_each_replica(
                    self._apply_unscaled, args=(grads, trainable_variables))
                self._update(True, floor)

            # A cond in cross-replica context: the inner apply calls merge_call itself.
            ops.cond(finite, apply_fn, lambda: self._update(False, floor))

        tf.distribute.get_replica_context().merge_call(
            _handle_cross_replica, args=(finite, grads, trainable_variables))

    def _common_apply(self, grads, trainable_variables=None, finite=None):
        if finite is None:
            finite = self.check_finite(grads)
        floor = loaded_state.steps_floor(self)

        def apply_fn():
            self._apply_unscaled(grads, trainable_variables)
            self._update(True, floor)

        ops.cond(finite, apply_fn, lambda: self._update(False, floor))

    def _apply_unscaled(self, grads, trainable_variables):
        scale = self._first_scale or self.dynamic_scale
        tvs = trainable_variables or self._trainable_variables
        unscaled = [g if g is None or self._overwrite_variable_with_gradient(v)
                    else ops.divide(g, scale) for g, v in zip(grads, tvs)]
        self.inner_optimizer.apply(unscaled, trainable_variables=trainable_variables)

    def _state_variables(self):
        return scale_rule.ScaleState(self.dynamic_scale, self.step_counter, self._iterations,
                                     self._overflow_count, self._consecutive_overflows,
                                     self._overflows_at_min_scale)

    def _update(self, finite: bool, floor):
        """Assigns `scale_rule.adjust`'s new state (inside the branch that `finite` names); `total_steps`
        counts from at least `floor` (`loaded_state.repair_total_steps`)."""
        variables = self._state_variables()
        # Read tensors, not the variables: `old` must not see the assignments that follow.
        old = scale_rule.ScaleState(*(tf.identity(v.value) for v in variables))
        old = old._replace(total_steps=ops.maximum(old.total_steps, ops.cast(floor, old.total_steps.dtype)))
        new = scale_rule.adjust(self.rule, old, finite)
        for variable, before, after in zip(variables, old, new):
            if after is not before:  # the rule passes unchanged values through
                variable.assign(after)
        self._log_in_graph(int(finite), old.scale, new)

    # ----------------------------------------------------------------- logging (host side)
    def _log_in_graph(self, kind, old_scale, new):
        """Calls `_host_event` from the step's rare branches, where a host callback may run."""
        if tf.executing_eagerly():
            return  # `apply` runs `host_check()` after the step.
        if kind and not self.dynamic:
            return  # a finite step at a static scale changes nothing worth a line
        if _in_xla_context(tf.compat.v1.get_default_graph()):
            self._host_blind = True  # XLA cannot call the host; `fit`'s end, LossScaleMonitor, host_check() do
            if self.on_min_scale == "raise" and not self._xla_warned:
                self._xla_warned = lso_settings.warn_raise_under_xla(self.name)
            return
        if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context():
            self._host_blind = True  # once per replica would repeat lines; the host checks log instead
            return
        # Only a real change, or a streak at min_scale that `on_min_scale` must act on, calls the
        # host: a scale pinned at max_scale would otherwise cost a round trip per growth interval.
        needed = ops.not_equal(old_scale, new.scale)
        if self.on_min_scale != "ignore" and not kind:
            needed = ops.logical_or(needed, scale_rule.min_scale_reached(self.rule, new))

        def call_host():
            tf.py_function(self._host_event, [kind, new.total_steps, old_scale, new.scale,
                                              new.consecutive_overflows,
                                              new.overflows_at_min_scale], [])

        tf.cond(needed, call_host, lambda: None)

    def _host_event(self, kind, step, old, new, consecutive, at_min):
        self._scale_log.event(self, int(kind), int(step), float(old.numpy()),
                              float(new.numpy()), int(consecutive), int(at_min))

    def host_check(self):
        """Reads the state (a host sync: call it at cheap points), logs unlogged scale changes,
        applies `on_min_scale`, and returns the values as Python numbers."""
        if not self.built:
            return {}
        loaded_state.repair_total_steps(self)
        state = {
            "loss_scale": float(ops.convert_to_numpy(self.dynamic_scale)),
            "overflow_count": int(ops.convert_to_numpy(self._overflow_count)),
            "consecutive_overflows": int(ops.convert_to_numpy(self._consecutive_overflows)),
            "overflows_at_min_scale": int(ops.convert_to_numpy(self._overflows_at_min_scale)),
            "total_steps": int(ops.convert_to_numpy(self._iterations)),
        }
        self._scale_log.check(self, state)
        return state
