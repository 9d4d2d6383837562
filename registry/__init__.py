"""An embedded schema registry speaking the Confluent Schema Registry REST API (Avro).

For the local stack and tests; in production point Headwater at Confluent Schema
Registry, Karapace, Redpanda or Apicurio instead. State lives in a compacted Kafka
topic (``_schemas``) so restarted or additional instances serve the same ids.
"""
