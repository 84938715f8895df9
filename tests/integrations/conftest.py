collect_ignore = ["data/make_vllm_events_golden.py"]  # a script that writes the golden file where vLLM is
