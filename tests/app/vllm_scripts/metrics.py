# a request's times and its prefix-cache hits
from pagedkv import LLM, SamplingParams

llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", enable_prefix_caching=True)
system = "You are a helpful assistant who answers in one short sentence about geography. " * 3
first = llm.generate(system + "Where is Paris?", SamplingParams(temperature=0, max_tokens=4))[0]
second = llm.generate(system + "Where is Rome?", SamplingParams(temperature=0, max_tokens=4))[0]
m = second.metrics
print(first.num_cached_tokens, second.num_cached_tokens, m.num_generation_tokens)
print(m.arrival_time > 0, m.first_token_ts <= m.last_token_ts, m.first_token_latency >= 0)
assert second.num_cached_tokens > 0
