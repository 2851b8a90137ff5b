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
from collections.abc import Callable
from typing import Any

import msgspec
import msgspec.inspect as mi


def unknown_paths(document: dict[str, Any], schema: type[msgspec.Struct]) -> dict[str, Any]:
    """``{path: value}`` for every non-null key of ``document`` that ``schema`` (a struct whose
    fields may be structs, lists and unions of them) has no field for, in document order."""
    found: dict[str, Any] = {}
    walk = _walker(schema)
    if walk is not None:
        walk(document, "", found)
    return found


Walk = Callable[[Any, str, dict[str, Any]], None]
"""Looks into one value under its path, adding what it finds to the ``found`` dict."""


@functools.cache
def _walker(schema: type[msgspec.Struct]) -> Walk | None:
    return _compile(mi.type_info(schema), {})


def _compile(kind: mi.Type, structs: dict[type, Walk]) -> Walk | None:
    """A walker for values of ``kind``; None where there is nothing to look into (a scalar, a
    free-form object). Built once per schema: a request's walk then visits only the values
    that can hold an unknown key, with no type inspection on the way."""
    while isinstance(kind, mi.Metadata):
        kind = kind.type
    if isinstance(kind, mi.StructType):
        return structs.get(kind.cls) or _struct_walker(kind, structs)
    if isinstance(kind, mi.ListType):
        return _list_walker(_compile(kind.item_type, structs))
    if isinstance(kind, mi.UnionType):
        return _union_walker(kind, structs)
    return None


def _struct_walker(struct: mi.StructType, structs: dict[type, Walk]) -> Walk:
    fields: dict[str, Walk | None] = {}
    tag_field = struct.tag_field

    def walk(value: Any, path: str, found: dict[str, Any]) -> None:
        if not isinstance(value, dict):
            return
        for key, item in value.items():
            if item is None or key == tag_field:
                continue
            if key in fields:
                inner = fields[key]
                if inner is not None:
                    inner(item, f"{path}.{key}" if path else key, found)
            else:
                found[f"{path}.{key}" if path else key] = item

    # Registered before its fields compile: a struct may (indirectly) hold itself.
    structs[struct.cls] = walk
    for field in struct.fields:
        fields[field.encode_name] = _compile(field.type, structs)
    return walk


def _list_walker(item: Walk | None) -> Walk | None:
    if item is None:
        return None

    def walk(value: Any, path: str, found: dict[str, Any]) -> None:
        if isinstance(value, list):
            for i, element in enumerate(value):
                if element is not None:
                    item(element, f"{path}[{i}]", found)

    return walk


def _union_walker(union: mi.UnionType, structs: dict[type, Walk]) -> Walk | None:
    """An object goes to the first struct member its tag names (or the first untagged one),
    a list to the first list member: the member that decoded it."""
    members = [_bare(member) for member in union.types]
    tagged: list[tuple[str | None, Any, Walk]] = [
        (member.tag_field, member.tag, _compile(member, structs))  # type: ignore[misc]
        for member in members
        if isinstance(member, mi.StructType)
    ]
    lists = [member for member in members if isinstance(member, mi.ListType)]
    list_walk = _compile(lists[0], structs) if lists else None
    if not tagged and list_walk is None:
        return None

    def walk(value: Any, path: str, found: dict[str, Any]) -> None:
        if isinstance(value, dict):
            for tag_field, tag, inner in tagged:
                if tag_field is None or value.get(tag_field) == tag:
                    inner(value, path, found)
                    return
        elif isinstance(value, list) and list_walk is not None:
            list_walk(value, path, found)

    return walk


def _bare(kind: mi.Type) -> mi.Type:
    """``kind`` without its constraints (a bounded list is a list: ``Meta(max_length=...)``)."""
    while isinstance(kind, mi.Metadata):
        kind = kind.type
    return kind
