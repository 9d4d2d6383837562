"""The compiled parts: capture._copier, the snapshot's COPY text to raw-topic messages
(and the Sender that hands them to librdkafka); tables._avro, flat Avro records read in C;
tables._partition, Kafka's Java default partitioner.

Everything else about the build is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "capture._copier",
            ["capture/_copier.c", "capture/_sender.c"],
            depends=["capture/_sender.h"],
            extra_compile_args=["-O2", "-Wall"],
        ),
        Extension("tables._avro", ["tables/_avro.c"], extra_compile_args=["-O2", "-Wall"]),
        Extension("tables._partition", ["tables/_partition.c"], extra_compile_args=["-O2", "-Wall"]),
    ]
)
