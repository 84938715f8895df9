"""The core's state and its containers: the snapshot (``state``), the GC-quiet persistent arrays (``vec``), the
prefix-cache index (``index``), the rows' packed ids (``tails``), the host tier's entries (``host``), and a
transition's working copy of it all (``txn``)."""
