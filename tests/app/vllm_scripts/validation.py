# bad sampling values are refused when SamplingParams is built
from pagedkv import SamplingParams, VLLMValidationError

for bad in ({"temperature": -1.0}, {"top_p": 0.0}, {"max_tokens": 0}, {"n": 0}, {"prompt_logprobs": 50}):
    try:
        SamplingParams(**bad)
    except VLLMValidationError as e:
        print(type(e).__name__, e.parameter, "|", e)
    else:
        raise AssertionError(bad)
try:
    SamplingParams(min_p=2.0)
except ValueError as e:  # (a ValueError too, as vLLM's)
    print("ValueError:", e)
