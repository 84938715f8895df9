# the chat API's logprobs and top_logprobs, and vLLM's extra fields through extra_body
from openai import OpenAI

openai_api_key = "EMPTY"
openai_api_base = "http://localhost:8000/v1"

client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)
model = client.models.list().data[0].id
completion = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Name a fruit."}],
    max_tokens=6,
    temperature=0,
    logprobs=True,
    top_logprobs=2,
    extra_body={"top_k": 20, "min_p": 0.05, "skip_special_tokens": True},
)
for item in completion.choices[0].logprobs.content:
    print(repr(item.token), round(item.logprob, 3), [(t.token, round(t.logprob, 3)) for t in item.top_logprobs])
