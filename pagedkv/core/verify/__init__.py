"""How the core is known to be right: the trace contract and replay (``trace``), the model
checker (``check``, over ``alphabet``), the invariants every state keeps, and digests."""
