# prompt logprobs: each prompt token's logprob given those before it (the first None), and a prompt's perplexity
import math

from pagedkv import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
prompts = ["The capital of France is Paris.", "Paris France capital the is."]
outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1))
for output in outputs:
    scored = [lp[t].logprob for t, lp in zip(output.prompt_token_ids, output.prompt_logprobs) if lp is not None]
    print(repr(output.prompt), "perplexity", round(math.exp(-sum(scored) / len(scored)), 2))
    print(output.prompt_logprobs[:3])
assert outputs[0].prompt_logprobs[0] is None
