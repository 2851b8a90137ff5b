"""The fields of a request body that its schema does not know, at any depth.

msgspec ignores a JSON object's unknown keys when it decodes one, and a key inside a known object
(``cache_control`` on a content part, a new key in a tool's ``function``, in ``response_format``
or ``stream_options``) is as much a field as one at the top. ``unknown_paths`` finds them all,
under their path in OpenAI's ``param`` syntax (``messages[1].content[0].cache_control``), so a
backend that cannot take them answers a 400 naming the field instead of dropping it (an
OpenAI-compatible upstream gets the client's body whole anyway). Free-form objects (a JSON
Schema, ``metadata``, ``logit_bias``) are not looked into, and a ``null`` is as good as absent:
SDKs echo the objects they were sent with their unset fields as ``null``.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import msgspec.inspect as mi


def unknown_paths(document: dict[str, Any], schema: type[msgspec.Struct]) -> dict[str, Any]:
    """``{path: value}`` for every non-null key of ``document`` that ``schema`` (a struct whose
    fields may be structs, lists and unions of them) has no field for, in document order."""
    found: dict[str, Any] = {}
    _walk(document, _info(schema), "", found)
    return found


@functools.cache
def _info(schema: type[msgspec.Struct]) -> mi.Type:
    return mi.type_info(schema)


_FIELDS: dict[type, dict[str, mi.Type]] = {}


def _fields(struct: mi.StructType) -> dict[str, mi.Type]:
    fields = _FIELDS.get(struct.cls)
    if fields is None:
        fields = _FIELDS[struct.cls] = {f.encode_name: f.type for f in struct.fields}
    return fields


def _walk(value: Any, kind: mi.Type, path: str, found: dict[str, Any]) -> None:
    while isinstance(kind, mi.Metadata):
        kind = kind.type
    if isinstance(kind, mi.UnionType):
        member = _member(value, kind)
        if member is None:
            return
        kind = member
    if isinstance(kind, mi.StructType) and isinstance(value, dict):
        fields = _fields(kind)
        for key, item in value.items():
            if key == kind.tag_field:
                continue
            at = f"{path}.{key}" if path else key
            field = fields.get(key)
            if field is None:
                if item is not None:
                    found[at] = item
            elif item is not None:
                _walk(item, field, at, found)
    elif isinstance(kind, mi.ListType) and isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, kind.item_type, f"{path}[{i}]", found)


def _member(value: Any, union: mi.UnionType) -> mi.Type | None:
    """The member of ``union`` that decoded ``value`` (by tag among tagged structs)."""
    if isinstance(value, dict):
        for member in union.types:
            if isinstance(member, mi.StructType) and (
                member.tag_field is None or value.get(member.tag_field) == member.tag
            ):
                return member
    elif isinstance(value, list):
        for member in union.types:
            if isinstance(member, mi.ListType):
                return member
    return None
