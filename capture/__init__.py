"""Capture: where data comes from (replication slot, snapshot, pgoutput decoder, producer).

Not built yet: see issue "Capture agent". Nothing here runs today.
"""
