# vLLM's logprobs: each generated token's logprob and those of the k likeliest ids
from pagedkv import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
outputs = llm.generate(["The capital of France is"], SamplingParams(logprobs=5, max_tokens=4, temperature=0))
for output in outputs:
    seq = output.outputs[0]
    print("cumulative logprob:", seq.cumulative_logprob)
    for token_id, top in zip(seq.token_ids, seq.logprobs):
        print(token_id, {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in top.items()})
