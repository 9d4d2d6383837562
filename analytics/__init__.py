"""Analytics: the PySpark Python Data Source over Headwater topics, and the jobs on top.

Batch reads and Structured Streaming (``analytics.source``, ``analytics.stream``), the batch
jobs (``analytics.jobs``) and the streaming jobs (``analytics.streamjobs``). Needs the
``analytics`` extra (``pip install 'headwater[analytics]'``); ``analytics.config`` does not.
"""
