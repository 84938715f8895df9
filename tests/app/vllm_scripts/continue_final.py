# continue_final_message: the model goes on with the assistant's last message
from pagedkv import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
conversation = [
    {"role": "user", "content": "Tell me about Paris."},
    {"role": "assistant", "content": "Paris is the capital of"},
]
outputs = llm.chat(
    conversation, SamplingParams(temperature=0, max_tokens=6), add_generation_prompt=False, continue_final_message=True
)
print(repr(outputs[0].outputs[0].text))
assert outputs[0].prompt.rstrip().endswith("Paris is the capital of")
