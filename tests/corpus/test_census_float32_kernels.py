"""The census's checks on a sample of families (every attention shape keras-hub writes) with
`hardware.emulated` set: where a CPU's 16-bit matmul kernels are Eigen's, Dense's and EinsumDense's
products run on float32 kernels (`keras_amp.op_rules.matmul`), and the scores, norm and loss rules
must still find what they find on every other device. On a CPU without float16 instructions the
whole census's float16 half runs this way already; here it runs for bfloat16 on machines that run
bfloat16 natively (where bfloat16 is emulated, so is the whole census's bfloat16 half: skipped)."""

import census_models
import pytest

from keras_amp import hardware

pytestmark = census_models.MARKS

# MultiHeadAttention subclasses (bert, whisper's encoder-decoder, vit), literal einsums (falcon,
# gpt_neo_x, phi3; deberta_v3 with relative-position score terms; t5 with its rsqrt norm and mask
# bias), norms that cast to float32 themselves (qwen3, gpt_oss), ops.matmul (bloom), q @ k on
# tensors (mit, segformer), convolution nets with a Dense head (resnet, app_efficientnet).
SAMPLE = ("bert", "whisper", "vit", "falcon", "gpt_neo_x", "phi3", "deberta_v3", "t5", "qwen3", "gpt_oss",
          "bloom", "mit", "segformer", "resnet", "app_efficientnet")
CASES = [case for case in census_models.CASES if case.name in SAMPLE]
assert len(CASES) == len(SAMPLE), "a sampled family left the census"


@pytest.mark.skipif(hardware.emulated("bfloat16"),
                    reason="this CPU emulates bfloat16: the whole census's bfloat16 half runs on float32 kernels")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_census_with_float32_kernels(case, monkeypatch):
    monkeypatch.setattr(hardware, "emulated", lambda dtype: True)
    census_models.check(case, "mixed_bfloat16")
