# the completions API's echo with logprobs and vLLM's prompt_logprobs, through the openai client
from openai import OpenAI

openai_api_key = "EMPTY"
openai_api_base = "http://localhost:8000/v1"

client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)
model = client.models.list().data[0].id
completion = client.completions.create(
    model=model,
    prompt="Once upon a time",
    max_tokens=4,
    temperature=0,
    echo=True,
    logprobs=1,
    extra_body={"prompt_logprobs": 1},
)
choice = completion.choices[0]
print(repr(choice.text))
print(choice.logprobs.tokens, choice.logprobs.token_logprobs)
print(choice.model_extra["prompt_logprobs"])
