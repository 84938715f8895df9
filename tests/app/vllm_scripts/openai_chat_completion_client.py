# vLLM's examples/online_serving/openai_chat_completion_client.py, against pagedkv serve
from openai import OpenAI

openai_api_key = "EMPTY"
openai_api_base = "http://localhost:8000/v1"

messages = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Who won the world series in 2020?"},
    {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
    {"role": "user", "content": "Where was it played?"},
]


def main():
    client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)
    models = client.models.list()
    model = models.data[0].id
    chat_completion = client.chat.completions.create(messages=messages, model=model, max_tokens=12)
    print("-" * 50)
    print("Chat completion results:")
    print(chat_completion)
    print("-" * 50)
    return chat_completion


if __name__ == "__main__":
    chat_completion = main()
