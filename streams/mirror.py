"""The Redis mirror of the views: each view row as JSON with the commit LSN it reflects.

Promise: a view row lives at ``<prefix>:<view>:<key>`` (key columns as text, comma separated, as
in URLs): a hash with ``doc`` (the row as JSON, ``streams.rows.to_json``), and ``lsn`` (the
commit LSN it reflects, an integer). A view's own hash ``<prefix>:<view>`` holds
``cut_lsn``/``cut`` (the published cut Redis shows) and ``offsets`` (how far the view topic is
applied). The mirror follows the cuts topic and the view topics — and takes the cuts its worker's
assembler makes as they are made (``take``: it runs on the raw partition's owner, beside the
assembler), which spares each cut a trip through the broker, and the rows this worker's views
publish as Kafka acknowledges them (``hand``: a point's rows, when it has no more than
``streams.cuts.HAND_ROWS``), each taken only as the next record of its partition, its copy read
back passed over; each read of view records is
appended at once to a staging list of its own in Redis (``tables.topics.view_staging_key``), so
the worker holds no more than one read (1,000 records) however many rows a cut changes. For each
new cut one Lua script applies the staged records below the cut's ends and keeps the rest for
the next: the rows, the offsets and the cut change together, so Redis always shows the view
exactly at ``cut``, which never moves back (a cut older than the one Redis shows, as a restarted
mirror may read on the cuts topic after a cut handed over was shown, changes nothing). A view
Redis shows no cut of yet (its first fill) gets its rows in scripts of ``redis_fill_rows`` first,
so that Redis answers other clients meanwhile. A write never
replaces a row's newer LSN with an older one, offsets only move forward (no record is applied
twice), a tombstone deletes the row.
Redis away: the view topics keep flowing; the mirror retries every second and catches up from
its offsets when Redis is back (a Redis that lost its data is filled again from the view
topics). The view's hash also holds ``topic_id``, the Kafka id of the view topic its offsets are
in: a view topic deleted and made again (or by a broker that lost its data) has another, and the
mirror then removes the view's rows and offsets from Redis and fills them again from the new topic.
Its reader's fetches coming back empty below the known end (the local broker, on a long view topic)
get a new consumer with a longer wait (``tables.kafka.FetchWait``), reading on from Redis's offsets.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import deque
from typing import Any

import redis
from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient

from streams import clients
from streams.config import StreamsConfig
from streams.cuts import Delivery
from streams.fanout import header_lsn
from streams.metrics import StreamsMetrics, clock
from streams.rows import dumps, to_json
from streams.viewtopic import ViewTopic
from tables.kafka import FetchWait, Stalled, StallWatch, reader, record, topic_ids
from tables.registry import Registry, shown
from tables.topics import CUTS_PARTITION, view_key, view_staging_key
from tables.views import LSN_FIELD, decode_cut, last_cuts_start
from tables.wire import lsn_text

log = logging.getLogger("headwater.streams")

STAGED_TTL = 3600  # seconds a mirror's staging list outlives its last write (a crashed mirror's goes away)
ROW = """
local function row(entry, ends)
  local p, o, lsn, n, at = string.match(entry, '^(%d+) (%d+) (%d+) (%d+) ()')
  if tonumber(o) >= (ends[tonumber(p)] or 0) then return false end
  local key, doc = string.sub(entry, at, at + tonumber(n) - 1), string.sub(entry, at + tonumber(n))
  if tonumber(lsn) >= tonumber(redis.call('HGET', key, 'lsn') or '-1') then
    if doc == '' then
      redis.call('DEL', key)
    else
      redis.call('HSET', key, 'doc', doc, 'lsn', lsn)
    end
  end
  return true
end
local function ends_from(first)
  local ends = {}
  for i = first, #ARGV, 2 do ends[tonumber(ARGV[i])] = tonumber(ARGV[i + 1]) end
  return ends
end
local function push(list, entries)
  for i = 1, #entries, 1000 do
    redis.call('RPUSH', list, unpack(entries, i, math.min(i + 999, #entries)))
  end
end
local meta, staged, carried = KEYS[1], KEYS[2], KEYS[3]
if (redis.call('HGET', meta, 'offsets') or '{}') ~= ARGV[1] then
  redis.call('DEL', staged, carried)
  return -1
end
"""
APPLY = ROW + """
if tonumber(ARGV[3]) < tonumber(redis.call('HGET', meta, 'cut_lsn') or '-1') then return 2 end
local ends, later = ends_from(5), {}
for _, entry in ipairs(redis.call('LRANGE', staged, 0, -1)) do
  if not row(entry, ends) then later[#later + 1] = entry end
end
redis.call('DEL', staged)
if redis.call('EXISTS', carried) == 1 then redis.call('RENAME', carried, staged) end
push(staged, later)
redis.call('HSET', meta, 'offsets', ARGV[2], 'cut_lsn', ARGV[3], 'cut', ARGV[4])
return 1
"""
FILL = ROW + """
local ends, later, n = ends_from(3), {}, tonumber(ARGV[2])
for _, entry in ipairs(redis.call('LRANGE', staged, 0, n - 1)) do
  if not row(entry, ends) then later[#later + 1] = entry end
end
redis.call('LTRIM', staged, n, -1)
push(carried, later)
redis.call('EXPIRE', carried, STAGED_TTL)
return redis.call('LLEN', staged)
""".replace("STAGED_TTL", str(STAGED_TTL))
SLOW_APPLY = 1.0  # seconds of one cut's application that a warning tells
# How long one read waits (``consume(n, t)`` waits it out unless n records come). A cut handed over by the
# assembler (``take``) waits for the read in hand to end: with 20 ms reads the hand-over gained nothing over the
# cuts topic's trip; with 5 ms reads commit -> Redis p50 was 131-149 ms against 158-192 ms, the mirror's CPU
# 0-10% more (bench/RESULTS.md, "The views benchmark measured itself"). Reading one record as soon as it came
# (``consume(1, t)``) made the mirror stage a record at a time: busier (34-45%), no faster.
READ_WAIT = 0.005
# The rows of a point this worker's views published come handed over (``hand``) as soon as Kafka acknowledged them:
# read back through the broker they came 30-37 ms after their cut on average (bench/RESULTS.md, 2026-12-07).
HANDED = 1000  # points handed over and not yet taken at most (the oldest dropped: read from the topic instead)
Record = tuple[int, int, bytes, int, bytes | None]  # partition, offset, key, commit LSN, value


def row_key(prefix: str, view: str, key: dict[str, Any], columns: list[str]) -> str:
    return f"{view_key(prefix, view)}:" + ",".join(str(to_json(key[c])) for c in columns)


class RedisMirror(threading.Thread):
    """Follows the cuts topic and the view topics with one consumer; applies each view up to its newest cut."""

    def __init__(self, cfg: StreamsConfig, views: dict[str, ViewTopic], decoder: Registry,
                 metrics: StreamsMetrics | None = None) -> None:  # fmt: skip
        super().__init__(name="headwater-redis-mirror", daemon=True)
        self.metrics = metrics or StreamsMetrics()
        self.applied: dict[str, int] = {}  # view -> commit LSN of the cut Redis shows (applied by this mirror)
        self.cfg = cfg
        self.views = views
        self.topics = {v.topic: name for name, v in views.items()}
        self.decoder = decoder
        self.prefix = cfg.topic_prefix
        self.cuts: dict[str, dict[str, Any]] = {}  # view -> its newest cut known (``take``)
        self.cuts_lock = threading.Lock()  # ``take`` is called by the assembler's threads too
        self.held: dict[str, str] = {}  # view -> the offsets JSON Redis holds (compared in the script)
        self.read: dict[str, dict[int, int]] = {}  # view -> partition -> next offset the consumer gives
        self.staged = 0  # view records staged in Redis since start
        self.handed: deque[tuple[int, list[Delivery]]] = deque(maxlen=HANDED)  # (commit LSN, rows) from ``hand``
        self.assigned = False
        self.mirror = uuid.uuid4().hex[:12]  # names this mirror's staging lists
        self.stopping = threading.Event()
        self.fetch_wait = FetchWait(clients.reader_settings(cfg, follows=True))
        self.client = redis.Redis.from_url(cfg.redis_url, socket_timeout=5, socket_connect_timeout=2)
        self.apply = self.client.register_script(APPLY)
        self.fill = self.client.register_script(FILL)
        self.warned = 0.0

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                consumer = reader(self.fetch_wait.applied(clients.reader_settings(self.cfg, follows=True)))
                try:
                    self._mirror(consumer)
                finally:
                    consumer.close()
                    self.assigned = False
        finally:
            self._drop_staged()

    def _mirror(self, consumer: Consumer) -> None:
        """Mirror with ``consumer`` until stopped, or until its fetches need a longer wait (``Stalled``)."""
        watch = StallWatch(wait=self.fetch_wait)
        while not self.stopping.is_set():
            try:
                if not self.assigned:
                    self._assign(consumer)
                    watch = StallWatch(wait=self.fetch_wait)
                self._watch(watch, consumer, self._consume(consumer))
                started = clock()
                for name in self.views:
                    self.sync(name)
                self.metrics.spent("mirror", started)
            except Stalled as exc:
                log.warning("the Redis mirror: %s; reading on with a new consumer", exc)
                return
            except redis.RedisError as exc:
                self.metrics.redis_errors.inc()
                self._warn(f"Redis at {shown(self.cfg.redis_url)} is unavailable ({exc}); the views keep flowing "
                           "to their topics and Redis catches up when it is back")  # fmt: skip
                self._unassign(consumer)
                self.stopping.wait(1.0)
            except Exception:
                log.exception("the Redis mirror failed; retrying in 1 s")
                self._unassign(consumer)
                self.stopping.wait(1.0)

    def _watch(self, watch: StallWatch, consumer: Consumer, read: int) -> None:
        """``read`` messages came: a stall watch's news (a new consumer with a longer wait when ``Stalled``)."""
        if read:
            watch.seen()
        else:
            watch.check(consumer, {(tp.topic, tp.partition) for tp in consumer.assignment()})

    def _warn(self, message: str) -> None:
        if time.monotonic() - self.warned > 30:
            log.warning(message)
            self.warned = time.monotonic()

    def _unassign(self, consumer: Consumer) -> None:
        """Stop reading while Redis is away (nothing piles up in memory); start again from Redis's offsets."""
        if self.assigned:
            consumer.unassign()
        self.assigned = False

    def _drop_staged(self) -> None:
        """Remove this mirror's staging lists (best effort: they expire anyway)."""
        with contextlib.suppress(redis.RedisError):
            self.client.delete(*(key for name in self.views for key in self._lists(name)))

    def _staging(self, name: str) -> str:
        return view_staging_key(self.prefix, name, self.mirror)

    def _lists(self, name: str) -> list[str]:
        """This mirror's staging list of view ``name``, and the one a first fill carries later entries in."""
        return [self._staging(name), f"{self._staging(name)}#carried"]

    def _assign(self, consumer: Consumer) -> None:
        """Read the cuts topic from its last records and each view topic from the offsets Redis holds."""
        low, high = consumer.get_watermark_offsets(TopicPartition(self.cfg.cuts_topic, CUTS_PARTITION), timeout=10)
        todo = [TopicPartition(self.cfg.cuts_topic, CUTS_PARTITION, last_cuts_start(low, high, len(self.views)))]
        ids = topic_ids(AdminClient(clients.kafka_client(self.cfg)), list(self.topics))
        for name, view in self.views.items():
            self._same_topic(name, ids.get(view.topic))
            held = self.client.hget(view_key(self.prefix, name), "offsets")
            self.held[name] = held.decode() if isinstance(held, bytes) else "{}"
            offsets = {int(p): int(o) for p, o in json.loads(self.held[name]).items()}
            self.read[name] = {p: offsets.get(p, 0) for p in range(self.cfg.partitions)}
            self.client.delete(*self._lists(name))  # what this mirror staged before it stopped reading
            todo += [TopicPartition(view.topic, p, o) for p, o in self.read[name].items()]
        consumer.assign(todo)
        self.assigned = True

    def _same_topic(self, name: str, now: str | None) -> None:
        """Forget what Redis holds of view ``name`` if it came from another incarnation of its topic; record ``now``."""
        meta = view_key(self.prefix, name)
        held = self.client.hget(meta, "topic_id")
        was = held.decode() if isinstance(held, bytes) else held
        if now is None or was == now:
            return
        if was is not None:
            log.warning("%s is not the view topic Redis's rows of view %s came from (topic id %s, now %s: deleted and "
                        "made again, or a broker that lost its data): removing them and filling Redis again from it",
                        self.views[name].topic, name, was, now)  # fmt: skip
            self._remove(name)
        self.client.hset(meta, "topic_id", now)

    def _remove(self, name: str) -> None:
        """Delete every row of view ``name`` from Redis, and its hash (offsets and cut)."""
        meta = view_key(self.prefix, name)
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in meta) + ":*"
        batch: list[bytes] = []
        for key in self.client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                self.client.unlink(*batch)
                batch.clear()
        self.client.unlink(*batch, meta)

    def hand(self, lsn: int, rows: list[Delivery]) -> None:
        """A point's rows as Kafka acknowledged them (``streams.cuts.Cuts.on_rows``; any thread): staged with the
        next read, each one that follows the last record read of its partition (others are read from the topic)."""
        self.handed.append((lsn, rows))

    def _take_handed(self, read: dict[str, list[Record]]) -> None:
        """Add the rows handed over since the last read to ``read`` (view -> records), each one that is the next
        of its partition; the topic's copies are passed over (``_consume``)."""
        while self.handed:
            lsn, rows = self.handed.popleft()
            for topic, partition, offset, key, value in rows:
                name = self.topics.get(topic)
                if self.assigned and name is not None and self.read[name].get(partition) == offset:
                    read.setdefault(name, []).append((partition, offset, key, lsn, value))
                    self.read[name][partition] = offset + 1

    def _consume(self, consumer: Consumer) -> int:
        """Stage what one read brought (view records, cuts) and the rows handed over; how many messages it
        brought."""
        read: dict[str, list[Record]] = {}
        messages = consumer.consume(1000, READ_WAIT)
        started = clock()
        self._take_handed(read)
        for msg in messages:
            topic, partition, offset = msg.topic() or "", int(msg.partition() or 0), int(msg.offset() or 0)
            error = msg.error()
            name = self.topics.get(topic)
            if error is not None:
                if error.code() != KafkaError._PARTITION_EOF:
                    log.warning("reading %s: %s", topic, error)
                elif name is not None:
                    self.read[name][partition] = max(self.read[name][partition], offset)
                continue
            if name is not None:
                if offset < self.read[name][partition]:
                    continue  # handed over already
                key = msg.key()
                if key is not None:
                    lsn = header_lsn(record(msg).headers)[0]
                    read.setdefault(name, []).append((partition, offset, key, lsn, msg.value()))
                self.read[name][partition] = offset + 1
            elif msg.value() is not None:
                self.take(decode_cut(msg.value()))  # type: ignore[arg-type]
        for name, records in read.items():
            self._stage(name, records)
        self.metrics.spent("mirror", started)
        return len(messages)

    def take(self, cut: dict[str, Any]) -> None:
        """A cut (``tables.views.CUT_SCHEMA``'s fields), read from the cuts topic or handed over by the assembler as
        it is made: the view's newest is applied once the view records up to its ends are read. The same cut twice
        (from both) is applied once; one at the same LSN with other ends (rows written again there) replaces it."""
        with self.cuts_lock:
            held = self.cuts.get(cut["view"])
            if held is None or cut["commit_lsn"] > held["commit_lsn"] or (
                cut["commit_lsn"] == held["commit_lsn"] and cut["ends"] != held["ends"]
            ):
                self.cuts[cut["view"]] = cut

    def _stage(self, name: str, records: list[Record]) -> None:
        """Append a read's records to this mirror's staging list of the view, in offset order."""
        staging = self._staging(name)
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(staging, *self._entries(name, records))
        pipe.expire(staging, STAGED_TTL)
        pipe.execute()
        self.staged += len(records)
        self.metrics.redis_records.inc(len(records))

    def sync(self, name: str) -> None:
        """Apply ``name`` up to its newest cut once the consumer read that far."""
        with self.cuts_lock:
            cut = self.cuts.get(name)
        if cut is None:
            return
        ends = {e["partition"]: e["offset"] for e in cut["ends"]}
        held = {int(p): int(o) for p, o in json.loads(self.held[name]).items()}
        if all(held.get(p, 0) >= o for p, o in ends.items()) and cut.get("applied"):
            return
        if any(self.read[name].get(p, 0) < o for p, o in ends.items()):
            return  # not read that far yet
        offsets = json.dumps({str(p): max(held.get(p, 0), o) for p, o in sorted(ends.items())})
        args = [self.held[name], offsets, cut["commit_lsn"], lsn_text(cut["commit_lsn"])]
        args += [n for p, o in sorted(ends.items()) for n in (p, o)]
        outcome = self._fill(name, args) and self._apply(name, args, cut["commit_lsn"])
        if outcome is False:
            log.warning("Redis holds other offsets for view %s than this mirror expected: reading again", name)
            self.assigned = False  # another mirror wrote, or Redis lost its data: start from what it holds
            return
        cut["applied"] = True  # (an older cut than Redis shows: nothing to do for it, ever)
        if outcome:
            self.held[name] = offsets
            self.applied[name] = cut["commit_lsn"]

    def _fill(self, name: str, args: list[Any]) -> bool:
        """Before a view's first cut in Redis (no offsets held: a first fill, or a fill again), apply its staged
        entries ``redis_fill_rows`` per script, so that Redis answers other clients between them (it shows no cut
        yet); the cut's own script applies the rest. Whether Redis held the offsets expected."""
        if self.held[name] != "{}":
            return True
        keys, rows = [view_key(self.prefix, name), *self._lists(name)], self.cfg.redis_fill_rows
        left = int(self.client.llen(keys[1]))
        if left > rows:
            log.info("Redis mirror: filling view %s, which Redis shows no cut of yet: %d records staged, %d per "
                     "script", name, left, rows)  # fmt: skip
        while left > rows:  # each piece answers how many entries are left (-1: Redis holds other offsets)
            left = int(self.fill(keys=keys, args=[args[0], rows, *args[4:]]))
        return left >= 0

    def _apply(self, name: str, args: list[Any], lsn: int) -> bool | None:
        """Run the script applying ``name``'s staged records up to a cut: False when Redis held other offsets than
        expected, None when it shows a newer cut already (it changes nothing: a cut handed over by the assembler may
        be shown before the cuts topic holds it, and a mirror started again then reads an older one there), True.
        A cut's rows change together, so Redis serves no other client while it runs: a long one is said."""
        started = time.monotonic()
        try:
            done = int(self.apply(keys=[view_key(self.prefix, name), *self._lists(name)], args=args))
            return None if done == 2 else done == 1
        finally:  # a cut longer than the client's socket timeout is timed too (the script runs on in Redis)
            took = time.monotonic() - started
            self.metrics.redis_apply.observe(took)
            if took > SLOW_APPLY:
                log.warning("Redis mirror: applying view %s's cut at %s took %.1f s, during which Redis answered no "
                            "other client (a cut's rows change together)", name, lsn_text(lsn), took)  # fmt: skip

    def _entries(self, name: str, records: list[Record]) -> list[bytes]:
        """Staging entries: ``<partition> <offset> <lsn> <key length> <Redis key><JSON or nothing>``."""
        view = self.views[name]
        out = []
        for partition, offset, key, lsn, value in records:
            row = row_key(self.prefix, name, self.decoder.decode(key), view.key_columns).encode()
            doc = b""
            if value is not None:
                decoded = self.decoder.decode(value)
                decoded.pop(LSN_FIELD, None)
                doc = dumps(decoded)
            out.append(b"%d %d %d %d %s%s" % (partition, offset, lsn, len(row), row, doc))
        return out
