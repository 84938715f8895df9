"""The imperative shell: device page pools, metadata install, KV writes and
attention backends, per rank. It applies what the core decides and never
decides what a block holds itself. (Its modules arrive with the shell issue.)
"""
