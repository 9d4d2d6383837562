"""The views benchmark on a Kafka of your own (``--bootstrap``) leaves nothing of its run there: the topics under
its prefix and its workers' app, and no others, and its consumer group; when that Kafka does not answer it says
what is left to delete, and the run's own error stays the one raised."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from bench import views
from tests.plugins.stack import BrokerProcess, free_port

pytestmark = pytest.mark.slow


def test_a_runs_topics_go_and_no_other(broker_factory: Callable[[], BrokerProcess],
                                       capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    broker = broker_factory()
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    ours = ["hwbench-1-2.changes", "hwbench-1-2._schemas", "bench-hwbench-1-2-__assignor-__leader"]
    others = ["hwbench-1-22.changes", "bench-hwbench-1-22-x", "hwbench-1-2", "other"]
    for future in admin.create_topics([NewTopic(name, 1, 1) for name in ours + others]).values():
        future.result(timeout=30)
    with views.run_topics(broker.bootstrap, "hwbench-1-2"):
        pass
    left = {name for name in admin.list_topics(timeout=10).topics if not name.startswith("__")}
    assert left == set(others)
    said = capsys.readouterr().out
    assert "deleted this run's 3 topics (hwbench-1-2.*, bench-hwbench-1-2-*)" in said
    assert "group bench-hwbench-1-2" in said


def test_a_kafka_that_does_not_answer_is_told_and_the_runs_error_stays(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match="the run's own"), views.run_topics(f"127.0.0.1:{free_port()}", "p"):
        raise RuntimeError("the run's own")
    said = capsys.readouterr().out
    assert "could not delete this run's topics (p.*, bench-p-*)" in said and "delete them by hand" in said
    assert "its group bench-p is left too" in said


def test_on_the_bench_stacks_broker_nothing_is_deleted(capsys: pytest.CaptureFixture[str]) -> None:
    with views.run_topics("", views.PREFIX):
        pass
    assert capsys.readouterr().out == ""
