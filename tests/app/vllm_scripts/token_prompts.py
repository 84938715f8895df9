# prompts given as token ids: TokensPrompt and plain lists
from pagedkv import LLM, SamplingParams, TokensPrompt

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
tokenizer = llm.get_tokenizer()
ids = tokenizer.encode("The capital of France is")
outputs = llm.generate([TokensPrompt(prompt_token_ids=ids), ids], SamplingParams(temperature=0, max_tokens=6))
for output in outputs:
    print(output.prompt, output.prompt_token_ids, output.outputs[0].text)
assert outputs[0].prompt is None and outputs[0].outputs[0].text == outputs[1].outputs[0].text
