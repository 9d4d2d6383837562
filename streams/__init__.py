"""Streams: the Faust app (``faust -A streams worker``), fan-out, tables, joins, Redis sink.

Not built yet: see issue "Streams". Nothing here runs today.
"""
