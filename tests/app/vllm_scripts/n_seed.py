# n sequences a prompt, seeded
from pagedkv import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=8)
outputs = llm.generate(["Once upon a time"], params)
for completion in outputs[0].outputs:
    print(completion.index, repr(completion.text))
again = llm.generate(["Once upon a time"], params)
assert [c.text for c in again[0].outputs] == [c.text for c in outputs[0].outputs]
