"""The four prompts the GPU checks and benches run on the real SmolLM2 weights (chat, a system prompt, a raw
continuation), as text for the model's chat template."""

from __future__ import annotations

from pagedkv.models.tokenizer import Tokenizer

SYSTEM = "You are a concise assistant. Answer in one or two sentences."
PROMPTS = [
    ("What is the capital of France?", None),
    ("Name three primary colors.", SYSTEM),
    ("Write a haiku about the sea.", None),
    ("The history of paged memory begins", "raw"),
]


def prompt_text(tok: Tokenizer, prompt: str, system: str | None) -> str:
    if system == "raw":
        return prompt
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tok.apply_chat_template(messages)
