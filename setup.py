"""The one compiled part: capture._copier, the snapshot's COPY text to raw-topic messages
(and the Sender that hands them to librdkafka).

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
    ]
)
