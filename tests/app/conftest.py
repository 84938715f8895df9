"""The scripts under vllm_scripts/ are run by test_vllm_scripts.py, each as a script: never imported by collection."""

collect_ignore = ["vllm_scripts"]
