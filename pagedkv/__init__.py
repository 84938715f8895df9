"""pagedkv: a scheduler-managed paged KV cache for serving engines.

``pagedkv.core`` is the pure state machine (admission, blocks, generations,
release, metadata snapshots); ``pagedkv.shell`` applies its decisions to device
page tensors; ``pagedkv.models`` holds reference models that run on the shell.
"""

__version__ = "0.1.0"
