# max_tokens=None: up to the model's length
from pagedkv import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=48)
output = llm.generate(
    "Write a long story about a dragon.", SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
)[0]
print(len(output.prompt_token_ids), len(output.outputs[0].token_ids), output.outputs[0].finish_reason)
assert len(output.prompt_token_ids) + len(output.outputs[0].token_ids) == 48
