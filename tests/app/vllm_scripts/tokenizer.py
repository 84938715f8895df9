# the Hugging Face tokenizer, its chat template rendered to text, then generate
from pagedkv import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
tokenizer = llm.get_tokenizer()
text = tokenizer.apply_chat_template(
    [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
)
print(repr(text))
outputs = llm.generate([text], SamplingParams(temperature=0, max_tokens=10))
chat = llm.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0, max_tokens=10))
print(repr(outputs[0].outputs[0].text))
assert outputs[0].outputs[0].text == chat[0].outputs[0].text
