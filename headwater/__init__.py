"""Headwater: PostgreSQL change data capture into structured Kafka event streams.

This package holds what every stage shares: the command line, configuration,
the error hierarchy, the embedded local stack and the sample shop.
"""

__version__ = "0.1.0"
