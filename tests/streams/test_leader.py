"""The raw partition owner's cut-maker on the local broker: its reader of the fragments topic, which only grows
there, grows its fetch wait like the feeds' and makes the cut a fragment at the end of a long partition completes."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from headwater.stack import StackConfig
from streams.clients import producer_settings
from streams.config import StreamsConfig
from streams.frontier import Pace, fragment_value
from streams.leader import WINDOW, Assembler, Subjects, coordination_producer
from tables.errors import FatalError
from tables.kafka import create_topics
from tests.plugins.streams import run_until

pytestmark = pytest.mark.slow
BATCHES = 20_000  # one fragment each: at a 10 ms fetch wait the local broker's listing stops short of the end


def fragments(cfg: StreamsConfig, count: int) -> None:
    """``count`` fragments, each in a batch of its own: ones naming no partition, then one at LSN ``count`` naming
    partition 0 of view ``v`` (ending at offset 7)."""
    create_topics(AdminClient({"bootstrap.servers": cfg.bootstrap}),
                  [NewTopic(cfg.fragments_topic, 1, 1), NewTopic(cfg.cuts_topic, 1, 1)])  # fmt: skip
    producer = Producer({"bootstrap.servers": cfg.bootstrap, "linger.ms": 0, "batch.num.messages": 1})
    frame = Subjects(cfg).fragment()
    for n in range(1, count + 1):
        ends = [("v", 0, 7)] if n == count else []
        producer.produce(cfg.fragments_topic, fragment_value(frame, "w", n, n, 0.01, ends), partition=0)
        producer.poll(0)
    assert producer.flush(60) == 0


def test_the_cut_a_fragment_completes_at_the_end_of_a_partition_of_many_batches_is_made(
    local_stack: StackConfig, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = StreamsConfig(bootstrap=local_stack.bootstrap, registry_url=local_stack.registry_url,
                        topic_prefix=unique_name, broker_profile="tansu", partitions=1)  # fmt: skip
    assert BATCHES > 2 * WINDOW  # it starts reading WINDOW fragments before the end, far into the partition
    fragments(cfg, BATCHES)
    fatal: list[FatalError] = []
    cuts: list[dict[str, Any]] = []
    made = threading.Event()
    assembler = Assembler(cfg, coordination_producer(producer_settings(cfg)), Subjects(cfg), Pace(0.1),
                          {"v": f"{unique_name}.views.v"}, fatal.append)  # fmt: skip
    assembler.on_cut = lambda cut: (cuts.append(cut), made.set())
    said = run_until(assembler, made, caplog, lambda: f"no cut; at {assembler.position}, {assembler.fetch_wait.ms} ms")
    assert not fatal and [(c["commit_lsn"], c["ends"]) for c in cuts] == [(BATCHES, [{"partition": 0, "offset": 7}])]
    assert assembler.fetch_wait.ms is not None and assembler.fetch_wait.ms > 10 and assembler.position == BATCHES
    assert any("came back empty below the known end" in line for line in said)
