"""pagedkv: a scheduler-managed paged KV cache for serving engines.

Layers, every import pointing down (docs/architecture.md): ``pagedkv.core`` is the
pure state machine (admission, blocks, generations, release, metadata snapshots,
the scheduler, verification); ``pagedkv.shell`` applies its decisions to device
page tensors; ``pagedkv.models`` holds reference models that run on the shell;
``pagedkv.app`` is the command line, ``LLM`` and the launcher of ranks.
"""

__version__ = "0.1.0"
