"""The Redis mirror of the views: each view row as JSON with the commit LSN it reflects.

Promise: a view row lives at ``<prefix>:<view>:<key>`` (key columns as text, comma
separated, as in URLs): a hash with ``doc`` (the row as JSON, ``streams.rows.to_json``),
and ``lsn`` (the commit LSN it reflects, an integer). A view's own hash
``<prefix>:<view>`` holds ``cut_lsn``/``cut`` (the published cut Redis shows) and
``offsets`` (how far the view topic is applied). The mirror follows the cuts topic and,
for each new cut, applies the view topic's records up to the cut's ends in one Lua
script: the rows, the offsets and the cut change together, so Redis always shows the
view exactly at ``cut``. A write never replaces a row's newer LSN with an older one,
offsets only move forward (no record is applied twice), a tombstone deletes the row.
Redis away: the view topics keep flowing; the mirror retries every second and
catches up from its offsets when Redis is back (a Redis that lost its data is filled
again from the view topics).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import redis
from confluent_kafka import Consumer, KafkaError, TopicPartition

from headwater.topics import AvroDecoder, read_to_end, reader, record
from streams import profile
from streams.config import StreamsConfig
from streams.fanout import header_lsn
from streams.materializer import ViewTopic, decode_cut
from streams.rows import lsn_text, to_json
from tables.views import LSN_FIELD

log = logging.getLogger("headwater.streams")

APPLY = """
local meta = KEYS[1]
if (redis.call('HGET', meta, 'offsets') or '{}') ~= ARGV[1] then return 0 end
for i = 5, #ARGV, 3 do
  local key, lsn, doc = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local held = tonumber(redis.call('HGET', key, 'lsn') or '-1')
  if lsn >= held then
    if doc == '' then
      redis.call('DEL', key)
    else
      redis.call('HSET', key, 'doc', doc, 'lsn', ARGV[i + 1])
    end
  end
end
redis.call('HSET', meta, 'offsets', ARGV[2], 'cut_lsn', ARGV[3], 'cut', ARGV[4])
return 1
"""


def row_key(prefix: str, view: str, key: dict[str, Any], columns: list[str]) -> str:
    return f"{prefix}:{view}:" + ",".join(str(to_json(key[c])) for c in columns)


def meta_key(prefix: str, view: str) -> str:
    return f"{prefix}:{view}"


class RedisMirror(threading.Thread):
    """Follows the cuts topic and applies each view up to its newest cut."""

    def __init__(self, cfg: StreamsConfig, views: dict[str, ViewTopic], decoder: AvroDecoder) -> None:
        super().__init__(name="headwater-redis-mirror", daemon=True)
        self.cfg = cfg
        self.views = views
        self.decoder = decoder
        self.prefix = cfg.topic_prefix or "headwater"
        self.cuts: dict[str, dict[str, Any]] = {}
        self.stopping = threading.Event()
        self.client = redis.Redis.from_url(cfg.redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.apply = self.client.register_script(APPLY)
        self.warned = 0.0

    def stop(self) -> None:
        self.stopping.set()

    def run(self) -> None:
        consumer = self._follow()
        try:
            while not self.stopping.is_set():
                self._poll_cuts(consumer)
                try:
                    if not any([self.sync(name) for name in self.views]):
                        self.stopping.wait(0.05)
                except redis.RedisError as exc:
                    self._warn(f"Redis at {self.cfg.redis_url} is unavailable ({exc}); the views keep flowing "
                               "to their topics and Redis catches up when it is back")  # fmt: skip
                    self.stopping.wait(1.0)
                except Exception:
                    log.exception("the Redis mirror failed; retrying in 1 s")
                    self.stopping.wait(1.0)
        finally:
            consumer.close()

    def _warn(self, message: str) -> None:
        if time.monotonic() - self.warned > 30:
            log.warning(message)
            self.warned = time.monotonic()

    def _follow(self) -> Consumer:
        """A consumer on the cuts topic from its last few records (older cuts are superseded)."""
        consumer = reader(profile.reader_settings(self.cfg))
        low, high = consumer.get_watermark_offsets(TopicPartition(self.cfg.cuts_topic, 0), timeout=10)
        start = max(low, high - 1 - 4 * len(self.views))  # Tansu may report a batch's base + 1 as the end
        consumer.assign([TopicPartition(self.cfg.cuts_topic, 0, start)])
        return consumer

    def _poll_cuts(self, consumer: Consumer) -> None:
        for msg in consumer.consume(500, timeout=0.05):
            error = msg.error()
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("reading %s: %s", self.cfg.cuts_topic, error)
                continue
            value = msg.value()
            if value is None:
                continue
            cut = decode_cut(value)
            held = self.cuts.get(cut["view"])
            if held is None or cut["commit_lsn"] >= held["commit_lsn"]:
                self.cuts[cut["view"]] = cut

    def sync(self, name: str) -> bool:
        """Apply ``name`` up to its newest cut; False if Redis shows it already."""
        cut = self.cuts.get(name)
        if cut is None:
            return False
        meta = meta_key(self.prefix, name)
        held_text: Any = self.client.hget(meta, "offsets")
        held = {int(p): int(o) for p, o in json.loads(held_text or "{}").items()}
        ends = {e["partition"]: e["offset"] for e in cut["ends"]}
        cut_lsn = self.client.hget(meta, "cut_lsn")
        if all(held.get(p, 0) >= o for p, o in ends.items()) and cut_lsn is not None and \
                int(cut_lsn) >= cut["commit_lsn"]:  # fmt: skip
            return False
        args = self._rows(self.views[name], held, ends)
        offsets = {str(p): max(held.get(p, 0), o) for p, o in sorted(ends.items())}
        self.apply(keys=[meta], args=[held_text.decode() if held_text else "{}", json.dumps(offsets),
                                      cut["commit_lsn"], lsn_text(cut["commit_lsn"]), *args])  # fmt: skip
        return True

    def _rows(self, view: ViewTopic, held: dict[int, int], ends: dict[int, int]) -> list[Any]:
        """(redis key, lsn, JSON or '') for the newest record per key between the held offsets and the ends."""
        todo = [TopicPartition(view.topic, p, held.get(p, 0)) for p, end in ends.items() if held.get(p, 0) < end]
        latest: dict[bytes, tuple[int, bytes | None]] = {}  # key -> (commit LSN, value)
        consumer = reader(profile.reader_settings(self.cfg))
        try:
            for msg in read_to_end(consumer, todo, timeout=60):
                partition, offset, key = int(msg.partition() or 0), int(msg.offset() or 0), msg.key()
                if key is not None and offset < ends[partition]:
                    latest[key] = (header_lsn(record(msg).headers)[0], msg.value())
        finally:
            consumer.close()
        out: list[Any] = []
        for key, (lsn, value) in latest.items():
            name = row_key(self.prefix, view.spec.name, self.decoder.decode(key), view.key_columns)
            if value is None:
                out += [name, lsn, ""]
                continue
            doc = self.decoder.decode(value)
            doc.pop(LSN_FIELD, None)
            out += [name, lsn, json.dumps(to_json(doc), separators=(",", ":"))]
        return out
