"""A fast path for ``decode_request``: OTLP export bytes read at the wire level.

At fleet scale a telemetry shard decodes 100,000 data points a second, and reading them from
protobuf objects (a Python wrapper for every message, attribute and value) was half of its
CPU. Exporters send the same shape every time: the same resource, the same metric names, the
same attributes and histogram bounds, only the numbers move. So this reads the wire format
directly, and what repeats (a resource's instance id, a point's attributes, a histogram's
bounds) is decoded once, by protobuf itself, and remembered by its bytes.

It is only a fast path. ``decode_fast`` answers exactly what
``decode_request(ExportMetricsServiceRequest.FromString(raw))`` would, or None: for anything
it does not read itself (a point that would be ignored, a field it does not expect, a message
set twice, an Envoy resource, malformed bytes), and the caller then takes the protobuf path,
which gives the same points, ignored counts and errors as before.
``tests/unit/control_plane/telemetry/test_otlp_wire.py`` holds the two to the same answers over
mutated and random exports.

Why it is one module of this length: a protobuf wire reader for exactly the OTLP shapes the
servers send, with its caches; split, its invariants (what it declines and hands to the protobuf
path) would be in two places.
"""

from __future__ import annotations

import math
import operator
import struct
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.proto.resource.v1 import resource_pb2

from control_plane.telemetry.decode import (
    DELTA,
    KINDS,
    MAX_INSTANCE_ID_CHARS,
    PointTuple,
    bounds_problem,
    instance_id,
    sorted_attributes,
)
from control_plane.telemetry.envoy import is_envoy

# Each memo is emptied when it reaches this many entries: a fleet repeats a few hundred
# distinct attribute sets and resources per shard, an exporter that never repeats only costs
# the protobuf path's work again.
MAX_MEMO = 50_000
# Templates are about the size of their export (1-3 KB for a model server's): one per
# exporting resource, so this bounds them to ~60 MB in a process that sees more resources.
MAX_TEMPLATES = 20_000

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class _Fallback(Exception):
    """Not read here: the protobuf path decides."""


def decode_fast(
    raw: bytes, max_points: int
) -> tuple[list[PointTuple], dict[str, int], list[str]] | None:
    """``decode_request`` of the export in ``raw`` when every point is one it would keep (or of
    a metric it does not use), else None."""
    reader = _Reader(raw, max_points)
    try:
        reader.request()
    except (_Fallback, IndexError, struct.error, UnicodeDecodeError, DecodeError, OverflowError):
        return None
    ignored = {"unknown_metric": reader.unknown} if reader.unknown else {}
    return reader.points, ignored, []


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise _Fallback


def _fields(buf: bytes, pos: int, end: int) -> list[tuple[int, int, int, int]]:
    """(field number, wire type, start, end) of each field of the message in buf[pos:end]:
    a varint's value is buf[start:end] undecoded, a fixed 8 bytes start..start+8, a
    length-delimited field its payload. Groups and truncation fall back."""
    out = []
    while pos < end:
        tag = buf[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(buf, pos)
        wire = tag & 7
        if wire == _LEN:
            n = buf[pos]
            if n < 0x80:
                pos += 1
            else:
                n, pos = _varint(buf, pos)
            start, pos = pos, pos + n
        elif wire == _I64:
            start, pos = pos, pos + 8
        elif wire == _VARINT:
            start = pos
            while buf[pos] & 0x80:
                pos += 1
            pos += 1
            if pos - start > 10:  # longer than any varint: protobuf rejects it
                raise _Fallback
        elif wire == _I32:
            start, pos = pos, pos + 4
        else:
            raise _Fallback
        if pos > end:
            raise _Fallback
        out.append((tag >> 3, wire, start, pos))
    return out


def _memo(table: dict[Any, Any], key: Any, make: Callable[[Any], Any]) -> Any:
    """``make(key)``, remembered."""
    found = table.get(key)
    if found is None:
        if len(table) >= MAX_MEMO:
            table.clear()
        found = table[key] = make(key)
    return found


_resources: dict[bytes, str] = {}  # Resource bytes -> instance id ("" to fall back)
_attributes: dict[tuple[bytes, ...], tuple[tuple[str, str], ...]] = {}  # KeyValue bytes
_bounds: dict[bytes, tuple[tuple[float, ...], str]] = {}  # packed bounds -> (bounds, problem)
_names: dict[bytes, tuple[str, str | None]] = {}  # metric name bytes -> (name, kind)
_checked: dict[bytes, bool] = {}  # instrumentation scopes protobuf parsed


def _endpoint_of(data: bytes) -> str:
    resource = resource_pb2.Resource.FromString(data)
    endpoint = instance_id(resource.attributes)
    envoy = is_envoy(metrics_pb2.ResourceMetrics(resource=resource))
    return "" if envoy or not endpoint or len(endpoint) > MAX_INSTANCE_ID_CHARS else endpoint


def _attributes_of(pieces: tuple[bytes, ...]) -> tuple[tuple[str, str], ...]:
    return sorted_attributes([KeyValue.FromString(piece) for piece in pieces])


def _bounds_of(data: bytes) -> tuple[tuple[float, ...], str]:
    if len(data) % 8:
        raise _Fallback
    bounds = struct.unpack(f"<{len(data) // 8}d", data)
    return bounds, bounds_problem(bounds)


def _name_of(data: bytes) -> tuple[str, str | None]:
    name = data.decode("utf-8")
    return name, KINDS.get(name)


def _scope_checked(data: bytes) -> bool:
    InstrumentationScope.FromString(data)  # raises DecodeError where protobuf would
    return True


# A point's recipe: where its numbers are among a template's unpacked values (None: absent,
# 0). Number points: ("n", name, kind, attrs, delta, start, time, value); histograms: ("h",
# name, kind, attrs, delta, start, time, count, sum, first bucket, bounds).
_Recipe = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class _Template:
    """The shape of one ResourceMetrics as an exporter sends it every time: everything but its
    numbers (timestamps, values, counts) is the same bytes, so a later export is read with one
    ``layout.unpack_from``, which gives the bytes between the numbers too, to be matched."""

    endpoint: str
    length: int
    layout: struct.Struct  # the payload: its static pieces ("Ns") and numbers, in order
    static_of: Callable[[tuple[Any, ...]], Any]  # the static pieces of what layout unpacks
    static: Any  # static_of of the payload the template was made from
    recipes: tuple[_Recipe, ...]  # their indices are into what layout unpacks
    unknown: int  # points of metrics the store does not use: counted, not read

    def unpack(self, buf: bytes, pos: int, end: int) -> tuple[Any, ...] | None:
        """The payload's pieces when it has this shape, else None."""
        if end - pos != self.length:
            return None
        values = self.layout.unpack_from(buf, pos)
        return values if self.static_of(values) == self.static else None

    def read(self, values: tuple[Any, ...], reader: _Reader) -> None:
        reader.spend(len(self.recipes) + self.unknown)
        reader.unknown += self.unknown
        append, endpoint = reader.points.append, self.endpoint
        for recipe in self.recipes:
            shape, name, kind, attrs, delta, i_start, i_time = recipe[:7]
            start_ns = values[i_start] if i_start is not None else 0
            time_ns = values[i_time] if i_time is not None else 0
            duration = max(0.0, (time_ns - start_ns) / 1e9) if start_ns else 0.0
            if shape == "n":
                value = float(values[recipe[7]])
                if not math.isfinite(value) or (kind == "counter" and value < 0):
                    raise _Fallback  # nan, negative
                append((endpoint, name, kind, attrs, (value,), (), delta, start_ns, duration))
                continue
            i_count, i_sum, first, bounds = recipe[7:]
            counts = array("d", values[first : first + len(bounds) + 1])
            count = values[i_count] if i_count is not None else 0
            if sum(counts) != count:
                raise _Fallback  # bucket_mismatch
            if i_sum is not None and not math.isfinite(values[i_sum]):
                raise _Fallback  # nan
            append((endpoint, name, kind, attrs, counts, bounds, delta, start_ns, duration))


class _Reader:
    def __init__(self, buf: bytes, max_points: int) -> None:
        self.buf = buf
        self.budget = max_points
        self.points: list[PointTuple] = []
        self.unknown = 0

    def request(self) -> None:
        buf = self.buf
        for field, wire, start, end in _fields(buf, 0, len(buf)):
            if field != 1 or wire != _LEN:
                raise _Fallback
            key = _resource_key(buf, start, end)
            template = _templates.get(key)
            values = template.unpack(buf, start, end) if template is not None else None
            if template is None or values is None:
                template = _TemplateBuilder(buf, start, end).build()
                if len(_templates) >= MAX_TEMPLATES:
                    _templates.clear()
                _templates[key] = template
                values = template.unpack(buf, start, end)
                assert values is not None  # the template's own payload
            template.read(values, self)

    def spend(self, count: int) -> None:
        if self.budget < count:
            raise _Fallback  # too_many_points
        self.budget -= count


_templates: dict[bytes, _Template] = {}  # the resource's bytes -> its last template


def _resource_key(buf: bytes, start: int, end: int) -> bytes:
    """The Resource field's bytes when the ResourceMetrics begins with it (as exporters write
    it), else b"" (a template is still checked before it is used)."""
    if start < end and buf[start] == 0x0A:
        n, at = _varint(buf, start + 1)
        return buf[at : at + n]
    return b""


class _TemplateBuilder:
    """Reads one ResourceMetrics's structure, field by field, into a ``_Template``."""

    def __init__(self, buf: bytes, pos: int, end: int) -> None:
        self.buf, self.pos, self.end = buf, pos, end
        self.slots: list[tuple[int, int, str]] = []  # (start, end, struct code) of numbers
        self.recipes: list[tuple[Any, ...]] = []  # recipes with slot numbers for indices
        self.unknown = 0  # points of metrics the store does not use

    def build(self) -> _Template:
        buf, pos, end = self.buf, self.pos, self.end
        resource = None
        scopes = []
        for field, wire, start, stop in _fields(buf, pos, end):
            if wire != _LEN or field not in (1, 2, 3) or (field == 1 and resource is not None):
                raise _Fallback
            if field == 1:
                resource = buf[start:stop]
            elif field == 2:
                scopes.append((start, stop))
            else:
                self._string(start, stop)
        endpoint = _memo(_resources, resource or b"", _endpoint_of)
        if not endpoint:
            raise _Fallback
        for start, stop in scopes:
            self.scope_metrics(start, stop)
        return self._template(endpoint)

    def _template(self, endpoint: str) -> _Template:
        fmt, static_at, cursor = ["<"], [], self.pos
        first_value: list[int] = []  # per slot, the index of its first value
        n_values = 0  # what the layout unpacks so far
        for start, stop, code in sorted(self.slots):
            if start < cursor:
                raise _Fallback  # cannot happen for distinct fields; never guessed at
            if start > cursor:
                fmt.append(f"{start - cursor}s")
                static_at.append(n_values)
                n_values += 1
            fmt.append(code)
            first_value.append(n_values)
            n_values += 0 if code.endswith("x") else int(code[:-1] or 1)
            cursor = stop
        fmt.append(f"{self.end - cursor}s")  # (0s unpacks b"": something to match, always)
        static_at.append(n_values)
        order = {slot[0]: i for i, slot in enumerate(sorted(self.slots))}

        def index(start: int | None) -> int | None:
            return None if start is None else first_value[order[start]]

        recipes = tuple(
            (*r[:5], *(index(at) if isinstance(at, int) or at is None else at for at in r[5:]))
            for r in self.recipes
        )
        layout = struct.Struct("".join(fmt))
        static_of = operator.itemgetter(*static_at)
        static = static_of(layout.unpack_from(self.buf, self.pos))
        return _Template(
            endpoint, self.end - self.pos, layout, static_of, static, recipes, self.unknown
        )

    def _string(self, start: int, end: int) -> None:
        self.buf[start:end].decode("utf-8")  # protobuf rejects a string that is not UTF-8

    def _slot(self, start: int, size: int, code: str) -> int:
        self.slots.append((start, start + size, code))
        return start

    def scope_metrics(self, pos: int, end: int) -> None:
        buf = self.buf
        scope_seen = False
        for field, wire, start, stop in _fields(buf, pos, end):
            if wire != _LEN or field not in (1, 2, 3) or (field == 1 and scope_seen):
                raise _Fallback
            if field == 2:
                self.metric(start, stop)
            elif field == 1:
                scope_seen = True
                _memo(_checked, buf[start:stop], _scope_checked)
            else:
                self._string(start, stop)

    def metric(self, pos: int, end: int) -> None:
        buf = self.buf
        name_at = data = None
        for field, wire, start, stop in _fields(buf, pos, end):
            if wire != _LEN:
                raise _Fallback
            if field == 1 and name_at is None:
                name_at = (start, stop)
            elif field in (2, 3):
                self._string(start, stop)
            elif field in (5, 7, 9) and data is None:
                data = (field, start, stop)
            else:  # exponential histograms, summaries, metadata, a field set twice
                raise _Fallback
        raw_name = buf[name_at[0] : name_at[1]] if name_at else b""
        name, kind = _memo(_names, raw_name, _name_of)
        if data is None:
            if kind is not None:
                raise _Fallback
            self.unknown += 1  # no data: one point, as protobuf's path counts it
            return
        data_field, start, stop = data
        temporality = 0
        points = []
        for field, wire, at, to in _fields(buf, start, stop):
            if field == 1 and wire == _LEN:
                points.append((at, to))
            elif data_field != 5 and field == 2 and wire == _VARINT:
                temporality = _varint(buf, at)[0]
            elif not (data_field == 7 and field == 3 and wire == _VARINT):  # is_monotonic
                raise _Fallback
        histogram = data_field == 9
        read = self.histogram_point if histogram else self.number_point
        if kind is None:
            # Not used, only counted; its points are read for their numbers' places all the
            # same, so that the template holds everything else (its name, its shape) as bytes
            # to match, and a later export is counted without being decoded.
            for at, to in points:
                read(name, "", False, at, to)
            self.unknown += len(points)
            return
        if (kind == "histogram") != histogram or (kind == "counter" and data_field != 7):
            raise _Fallback  # wrong_type
        if kind != "gauge" and temporality not in (1, 2):
            raise _Fallback  # bad_temporality
        if kind == "gauge" and temporality == DELTA:
            raise _Fallback
        delta = data_field != 5 and temporality == DELTA
        for at, to in points:
            self.recipes.append(read(name, kind, delta, at, to))

    def number_point(self, name: str, kind: str, delta: bool, pos: int, end: int) -> _Recipe:
        buf = self.buf
        at_of: dict[int, int] = {}  # field -> its slot
        flags = 0
        attrs: list[bytes] = []
        for field, wire, at, to in _fields(buf, pos, end):
            if field == 7 and wire == _LEN:
                attrs.append(buf[at:to])
            elif wire == _I64 and field in (2, 3, 4, 6) and field not in at_of:
                at_of[field] = self._slot(at, 8, "d" if field == 4 else "q" if field == 6 else "Q")
            elif field == 8 and wire == _VARINT:
                flags = _varint(buf, at)[0]
            else:  # exemplars, a field set twice, or of the wrong type
                raise _Fallback
        value = at_of.get(6 if 6 in at_of else 4)
        if flags & 1 or value is None or (4 in at_of and 6 in at_of):
            raise _Fallback  # no_value (or both values: the last wins, left to protobuf)
        return ("n", name, kind, _attrs(attrs), delta, at_of.get(2), at_of.get(3), value)

    def histogram_point(self, name: str, kind: str, delta: bool, pos: int, end: int) -> _Recipe:
        buf = self.buf
        at_of: dict[int, int] = {}
        flags = buckets = 0
        bounds_at = None
        attrs: list[bytes] = []
        for field, wire, at, to in _fields(buf, pos, end):
            if field == 9 and wire == _LEN:
                attrs.append(buf[at:to])
            elif wire == _I64 and field in (2, 3, 4, 5, 11, 12) and field not in at_of:
                at_of[field] = self._slot(at, 8, "8x" if field > 10 else "d" if field == 5 else "Q")
            elif field == 6 and wire == _LEN and 6 not in at_of:
                buckets = (to - at) // 8
                if buckets * 8 != to - at:
                    raise _Fallback
                at_of[6] = self._slot(at, to - at, f"{buckets}Q")
            elif field == 7 and wire == _LEN and bounds_at is None:
                bounds_at = (at, to)
            elif field == 10 and wire == _VARINT:
                flags = _varint(buf, at)[0]
            else:  # exemplars, unpacked or repeated arrays, a field set twice or wrongly typed
                raise _Fallback
        if flags & 1 or 6 not in at_of or bounds_at is None:
            raise _Fallback  # no_value, bad_buckets
        raw_bounds = buf[bounds_at[0] : bounds_at[1]]
        bounds, problem = _memo(_bounds, raw_bounds, _bounds_of)
        if problem or len(bounds) + 1 != buckets:
            raise _Fallback  # bad_buckets, bucket_mismatch
        return ("h", name, kind, _attrs(attrs), delta, at_of.get(2), at_of.get(3),
                at_of.get(4), at_of.get(5), at_of[6], bounds)  # fmt: skip


def _attrs(pieces: list[bytes]) -> tuple[tuple[str, str], ...]:
    return _memo(_attributes, tuple(pieces), _attributes_of)
