"""The imperative shell, per rank: the rank's pages and worker (``rank``, ``pool``, ``worker``),
attention backends (``attention/``), CUDA-graph decode (``graphs``), the engine loop (``engine``,
``sampling``, ``recorder``), several ranks' metadata broadcast (``distributed``), the KV connector
and latent (MLA) pages. It applies what the core decides and never decides what a block holds.
"""
