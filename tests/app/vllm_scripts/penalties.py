# penalties, bias and allowed ids
from pagedkv import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
params = [
    SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=10, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=4, logit_bias={28: 100.0}),
    SamplingParams(temperature=0.7, max_tokens=4, allowed_token_ids=[28, 29, 30], seed=1),
]
for output in llm.generate(["Repeat after me: la la la la"] * 4, params):
    print(output.outputs[0].token_ids, repr(output.outputs[0].text))
