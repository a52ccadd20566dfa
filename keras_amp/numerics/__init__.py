"""Float32 numerics shared by the float32-island layers and the op rules.

A floor below `keras_amp.layers` and `keras_amp.op_rules` (both import it; it imports neither).

Modules:
    attention: float32 attention scores (`float32_attention`, `float32_scores`) and their
        XLA-compiled forms.
    islands: variables read as float32, weight casts hoisted out of an RNN's time loop, the
        calling-layer stack.
    bits: 16-bit storage arithmetic (the 16+16 split, stochastic rounding) as integer bit operations.
    adam16: the compiled Adam updates of 16-bit weights (`keras_amp.optimizers.LeanAdam`).
    gelu: gelu's float32 derivative; its forward and backward pass from a 16-bit input as XLA
        computations.
    silu: silu's derivative; its forward and backward pass from a 16-bit input as XLA computations.
"""
