"""The transitions and their rules: admission (``admission``, the hit it takes: ``prefix``), growth, commit and
caching, decode, release, destination blocks, placeholders, the pool's mechanics (``pool``), each group kind's
rules (``kinds``) and how blocks are named (``hashing``)."""
