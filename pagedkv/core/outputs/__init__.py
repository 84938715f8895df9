"""What the core hands out: the metadata snapshot and its types (``metadata``, ``snapshot``), each transition's
effect (``effects``) and KV events (``events``)."""
