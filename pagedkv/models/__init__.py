"""Reference models that run on the shell (a Llama-family decoder, a DiT-style model)."""
