# ids alone, and special tokens kept in the text
from pagedkv import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
ids_only = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=4, detokenize=False))[0].outputs[0]
print(repr(ids_only.text), ids_only.token_ids)
chat = llm.chat(
    [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=False)
)[0].outputs[0]
print(repr(chat.text), chat.finish_reason)
