# SamplingParams' defaults and fields, set when built and in place
from pagedkv import LLM, SamplingParams

params = SamplingParams()
print(params.temperature, params.max_tokens, params.top_p, params.top_k, params.n)
assert (params.temperature, params.max_tokens) == (1.0, 16)
params.max_tokens = 8
params.temperature = 0.0
llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
outputs = llm.generate("The sky is", params)
print(len(outputs[0].outputs[0].token_ids), outputs[0].outputs[0].finish_reason)
outputs = llm.generate(["The sky is"], SamplingParams(top_k=-1, min_p=0.1, max_tokens=8, seed=3))
print(outputs[0].outputs[0].text)
