# chat content given as OpenAI's parts, a template of the caller's and its keywords
from pagedkv import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", seed=0)
messages = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "color."}]}]
outputs = llm.chat(
    messages, SamplingParams(temperature=0, max_tokens=8), chat_template_kwargs={"enable_thinking": False}
)
print(outputs[0].outputs[0].text)
template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
outputs = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), chat_template=template)
print(outputs[0].prompt)
