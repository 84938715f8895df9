"""The applications over the library: the command line, `pagedkv generate` / `denoise`, the `LLM`
facade, page maps, the launcher of several ranks."""
