"""Tables: the catalog of captured tables and the declarative view specs (no I/O).

Not built yet: see issues "Capture agent" and "Denormalized views".
"""
