"""The registry's state and the records that change it.

Promise: no I/O. ``Store.apply`` folds one record of the ``_schemas`` log into the
state (records use Confluent's key/value JSON layout); every read answers from the
state; every write is planned here as the records to append, after validating the
request, so the state only ever changes by replaying the log. The same log replayed
in the same order gives the same ids and versions on every instance, and
``Store.snapshot`` gives records that rebuild the whole state in a fresh log, ids and
versions unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from registry import errors
from registry.compatibility import LEVELS, InvalidSchema, Schema, check, parse

DEFAULT_LEVEL = "BACKWARD"
Record = tuple[bytes, bytes | None]


def _json(data: object) -> bytes:
    return json.dumps(data, separators=(",", ":"), sort_keys=False).encode()


def _schema_key(subject: str, version: int) -> bytes:
    return _json({"keytype": "SCHEMA", "subject": subject, "version": version, "magic": 1})


def _config_key(subject: str | None) -> bytes:
    return _json({"keytype": "CONFIG", "subject": subject, "magic": 0})


@dataclass
class Version:
    version: int
    schema_id: int
    deleted: bool = False


class Store:
    """Subjects, versions, ids and compatibility levels of one registry."""

    def __init__(self) -> None:
        self.schemas: dict[int, Schema] = {}
        self.ids: dict[str, int] = {}
        self.subjects: dict[str, dict[int, Version]] = {}
        self.global_level = DEFAULT_LEVEL
        self.subject_levels: dict[str, str] = {}
        # where each id was first registered: a rebuilt log keeps the ids of permanently deleted versions
        self.homes: dict[int, tuple[str, int]] = {}

    # ---- applying the log -------------------------------------------------------------
    def apply(self, key: bytes | None, value: bytes | None) -> None:
        """Fold one ``_schemas`` record into the state; unknown record kinds are skipped."""
        if key is None:
            return
        k = json.loads(key)
        kind = k.get("keytype")
        v = json.loads(value) if value is not None else None
        if kind == "SCHEMA":
            self._apply_schema(k["subject"], int(k["version"]), v)
        elif kind == "CONFIG":
            self._apply_config(k.get("subject"), v)

    def _apply_schema(self, subject: str, version: int, v: dict[str, Any] | None) -> None:
        versions = self.subjects.setdefault(subject, {})
        if v is None:  # permanent delete
            versions.pop(version, None)
            if not versions:
                del self.subjects[subject]
            return
        schema_id = int(v["id"])
        if schema_id not in self.schemas:
            schema = parse(v["schema"])
            self.schemas[schema_id] = schema
            self.ids.setdefault(schema.canonical, schema_id)
            self.homes.setdefault(schema_id, (subject, version))
        versions[version] = Version(version, schema_id, bool(v.get("deleted", False)))

    def _apply_config(self, subject: str | None, v: dict[str, Any] | None) -> None:
        level = v.get("compatibilityLevel") if v else None
        if subject is None:
            self.global_level = level or DEFAULT_LEVEL
        elif level is None:
            self.subject_levels.pop(subject, None)
        else:
            self.subject_levels[subject] = level

    # ---- reads --------------------------------------------------------------------------
    def _live(self, subject: str, deleted: bool = False) -> list[Version]:
        return sorted(
            (v for v in self.subjects.get(subject, {}).values() if deleted or not v.deleted),
            key=lambda v: v.version,
        )

    def subject_names(self, deleted: bool = False) -> list[str]:
        return sorted(s for s in self.subjects if self._live(s, deleted))

    def versions(self, subject: str, deleted: bool = False) -> list[int]:
        live = self._live(subject, deleted)
        if not live:
            raise errors.subject_not_found(subject)
        return [v.version for v in live]

    def schema_by_id(self, schema_id: int) -> Schema:
        try:
            return self.schemas[schema_id]
        except KeyError:
            raise errors.schema_not_found(f"Schema {schema_id} not found") from None

    def subject_versions_of(self, schema_id: int) -> list[dict[str, Any]]:
        self.schema_by_id(schema_id)
        return [
            {"subject": subject, "version": v.version}
            for subject in sorted(self.subjects)
            for v in self._live(subject)
            if v.schema_id == schema_id
        ]

    def version(self, subject: str, version: str | int, deleted: bool = False) -> dict[str, Any]:
        found = self._find_version(subject, version, deleted)
        return self._describe(subject, found)

    def _find_version(self, subject: str, version: str | int, deleted: bool = False) -> Version:
        number = parse_version(version)
        live = self._live(subject, deleted=True)
        if not live or (not deleted and all(v.deleted for v in live)):
            raise errors.subject_not_found(subject)
        if number == -1:
            candidates = [v for v in live if deleted or not v.deleted]
            return candidates[-1]
        found = self.subjects[subject].get(number)
        if found is None or (found.deleted and not deleted):
            raise errors.version_not_found(subject, number)
        return found

    def _describe(self, subject: str, v: Version) -> dict[str, Any]:
        return {
            "subject": subject,
            "version": v.version,
            "id": v.schema_id,
            "schema": self.schemas[v.schema_id].canonical,
        }

    def lookup(self, subject: str, text: str, deleted: bool = False) -> dict[str, Any]:
        candidate = parse_request_schema(text)
        live = self._live(subject, deleted)
        if not live:
            raise errors.subject_not_found(subject)
        for v in reversed(live):
            if self.schemas[v.schema_id].canonical == candidate.canonical:
                return self._describe(subject, v)
        raise errors.schema_not_found()

    def level(self, subject: str | None) -> str:
        if subject is not None and subject in self.subject_levels:
            return self.subject_levels[subject]
        return self.global_level

    # ---- planned writes -------------------------------------------------------------------
    def plan_register(self, subject: str, text: str) -> tuple[dict[str, Any], list[Record]]:
        """The answer to a registration and the records to append (none if already there)."""
        candidate = parse_request_schema(text)
        live = self._live(subject)
        for v in live:
            if self.schemas[v.schema_id].canonical == candidate.canonical:
                return {"id": v.schema_id}, []
        problems = check(self.level(subject), candidate, [self.schemas[v.schema_id] for v in live])
        if problems:
            raise errors.incompatible(problems)
        schema_id = self.ids.get(candidate.canonical, max(self.schemas, default=0) + 1)
        version = max(self.subjects.get(subject, {}), default=0) + 1
        value = _schema_value(subject, Version(version, schema_id), candidate.canonical)
        return {"id": schema_id}, [(_schema_key(subject, version), value)]

    def _version_record(self, subject: str, v: Version, *, permanent: bool) -> Record:
        key = _schema_key(subject, v.version)
        if permanent:
            return key, None
        deleted = Version(v.version, v.schema_id, deleted=True)
        return key, _schema_value(subject, deleted, self.schemas[v.schema_id].canonical)

    def plan_delete_subject(self, subject: str, permanent: bool) -> tuple[list[int], list[Record]]:
        everything = self._live(subject, deleted=True)
        if not everything:
            raise errors.subject_not_found(subject)
        if permanent:
            if any(not v.deleted for v in everything):
                raise errors.subject_not_soft_deleted(subject)
            targets = everything
        else:
            targets = [v for v in everything if not v.deleted]
            if not targets:
                raise errors.subject_not_found(subject)
        records = [self._version_record(subject, v, permanent=permanent) for v in targets]
        return [v.version for v in targets], records

    def plan_delete_version(self, subject: str, version: str, permanent: bool) -> tuple[int, list[Record]]:
        found = self._find_version(subject, version, deleted=permanent)
        if permanent and not found.deleted:
            raise errors.version_not_soft_deleted(subject, found.version)
        return found.version, [self._version_record(subject, found, permanent=permanent)]

    def plan_config(self, subject: str | None, level: object) -> list[Record]:
        if not isinstance(level, str) or level.upper() not in LEVELS:
            raise errors.invalid_compatibility(level)
        return [(_config_key(subject), _json({"compatibilityLevel": level.upper()}))]

    def plan_delete_config(self, subject: str | None) -> tuple[str, list[Record]]:
        previous = self.level(subject)
        return previous, [(_config_key(subject), None)]

    def test_compatibility(self, subject: str, version: str | None, text: str) -> list[str]:
        """Problems of ``text`` against one version (or, when None, the subject's history)."""
        candidate = parse_request_schema(text)
        level = self.level(subject)
        if version is None:
            live = self._live(subject)
            return check(level, candidate, [self.schemas[v.schema_id] for v in live])
        try:
            found = self._find_version(subject, version)
        except errors.RegistryError as exc:
            if exc.code == 40401 and parse_version(version) == -1:
                return []  # nothing registered yet: anything is compatible
            raise
        return check(level.removesuffix("_TRANSITIVE"), candidate, [self.schemas[found.schema_id]])

    # ---- rebuilding a lost log -----------------------------------------------------------
    def snapshot(self) -> list[Record]:
        """Records that rebuild this whole state in a fresh log, schemas in id order."""
        return [*self._orphan_records(), *self._version_records(), *self._config_records()]

    def _orphan_records(self) -> list[Record]:
        """Ids no version uses any more (permanently deleted): registered then deleted again,
        first, so the live versions written after them win any shared subject/version key."""
        used = {v.schema_id for versions in self.subjects.values() for v in versions.values()}
        records: list[Record] = []
        for schema_id in sorted(set(self.schemas) - used):
            subject, version = self.homes[schema_id]
            gone = Version(version, schema_id, deleted=True)
            value = _schema_value(subject, gone, self.schemas[schema_id].canonical)
            records += [(_schema_key(subject, version), value), (_schema_key(subject, version), None)]
        return records

    def _version_records(self) -> list[Record]:
        every = [(v.schema_id, subject, v.version, v) for subject, vs in self.subjects.items() for v in vs.values()]
        return [
            (_schema_key(subject, number), _schema_value(subject, v, self.schemas[v.schema_id].canonical))
            for _, subject, number, v in sorted(every, key=lambda item: item[:3])
        ]

    def _config_records(self) -> list[Record]:
        levels = [(None, self.global_level), *sorted(self.subject_levels.items())]
        return [(_config_key(subject), _json({"compatibilityLevel": level})) for subject, level in levels]


def _schema_value(subject: str, v: Version, canonical: str) -> bytes:
    return _json(
        {"subject": subject, "version": v.version, "id": v.schema_id, "schema": canonical, "deleted": v.deleted}
    )


def parse_version(version: str | int) -> int:
    """A version id from a URL: 'latest' and -1 mean the newest; otherwise 1..2^31-1."""
    if str(version) in ("latest", "-1"):
        return -1
    try:
        number = int(version)
    except (TypeError, ValueError):
        raise errors.invalid_version(str(version)) from None
    if not 1 <= number <= 2**31 - 1:
        raise errors.invalid_version(str(version))
    return number


def parse_request_schema(text: object) -> Schema:
    if not isinstance(text, str):
        raise errors.invalid_schema("the request needs a 'schema' string holding the Avro schema JSON")
    try:
        return parse(text)
    except InvalidSchema as exc:
        raise errors.invalid_schema(str(exc)) from exc
