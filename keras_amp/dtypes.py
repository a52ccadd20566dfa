"""The 16-bit dtype vocabulary: which compute dtypes are low precision, and where each hazard lies."""

LOW_PRECISION = ("float16", "bfloat16")
BOTH = LOW_PRECISION
FLOAT16 = ("float16",)
# Hazard kind -> the 16-bit dtypes in which an op of that kind is a hazard (the dynamic audit flags
# it there). Exp-type results and sums overflow float16's range, which bfloat16 shares with float32;
# attention scores, softmax, normalisation statistics and losses lose precision in both.
HAZARD_DTYPES = {
    "attention": BOTH,
    "softmax": BOTH,
    "normalization": BOTH,
    "loss": BOTH,
    "exp": FLOAT16,
    "reduction": FLOAT16,
}
