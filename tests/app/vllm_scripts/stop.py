# stop strings and ids, kept or not
from pagedkv import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")
plain = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
print(repr(plain.text))
cut = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=12, stop=["6"]))[0].outputs[0]
kept = llm.generate(
    "Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=12, stop=["6"], include_stop_str_in_output=True)
)[0].outputs[0]
by_id = llm.generate(
    "Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[plain.token_ids[2]])
)[0].outputs[0]
print(cut.finish_reason, cut.stop_reason, repr(cut.text), repr(kept.text), by_id.finish_reason, by_id.stop_reason)
