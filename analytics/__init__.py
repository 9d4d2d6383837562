"""Analytics: the PySpark Python Data Source over Headwater topics and batch jobs.

Not built yet: see issue "Analytics".
"""
