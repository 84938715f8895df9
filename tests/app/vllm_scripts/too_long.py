# a prompt past the model's length is refused when added, before anything runs
from pagedkv import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=64)
try:
    llm.generate(["word " * 200, "short"], SamplingParams(max_tokens=4))
except ValueError as e:
    print("refused:", e)
else:
    raise AssertionError("a too-long prompt was taken")
outputs = llm.generate(["word " * 200], SamplingParams(max_tokens=4, truncate_prompt_tokens=32, temperature=0))
print(len(outputs[0].prompt_token_ids), outputs[0].outputs[0].finish_reason)
