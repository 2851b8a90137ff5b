"""The Batch API's wire shapes: input files and requests read, batch, file and result objects
written, in OpenAI's and Anthropic's forms.

An OpenAI input file is JSONL, one request a line: ``custom_id`` (unique in the file),
``method`` POST, ``url`` the batch's endpoint, ``body`` the endpoint's request. Anthropic's
requests come in the create call itself: ``custom_id`` and ``params`` (a Messages request).
A stream cannot be a batch line's answer, so ``stream: true`` is refused by name.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from dataclasses import dataclass
from typing import Any

import msgspec

from sluicegate.gateway.db.batch_tables import Batch, BatchFile, BatchLine

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
ANTHROPIC_ENDPOINT = "/v1/messages"
MAX_LINES = 50_000
"""OpenAI's limit of requests per batch."""
MAX_ANTHROPIC_REQUESTS = 100_000
_ANTHROPIC_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


@dataclass(frozen=True, slots=True)
class LineError:
    """Why an input file cannot be run, in OpenAI's ``errors.data`` shape."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


def _body_error(body: Any, where: str) -> str | None:
    if not isinstance(body, dict):
        return f"{where} must be a JSON object."
    if body.get("stream"):
        return f"{where}.stream: streaming is not supported in a batch."
    if not isinstance(body.get("model"), str):
        return f"{where}.model is required."
    return None


def parse_openai_input(
    content: bytes, endpoint: str
) -> tuple[list[tuple[str, dict[str, Any]]], list[LineError]]:
    """The file's requests (custom id, body), or every reason it cannot run (up to 100)."""
    lines: list[tuple[str, dict[str, Any]]] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    for number, raw in enumerate(content.splitlines(), start=1):
        if len(errors) >= 100:
            break
        if not raw.strip():
            continue
        try:
            request = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            errors.append(LineError("invalid_json_line", "This line is not valid JSON.", number))
            continue
        if not isinstance(request, dict):
            errors.append(LineError("invalid_request", "A line must be a JSON object.", number))
            continue
        custom_id = request.get("custom_id")
        problem = None
        if not isinstance(custom_id, str) or not custom_id:
            problem = ("missing_required_parameter", "custom_id is required.", "custom_id")
        elif custom_id in seen:
            problem = ("duplicate_custom_id", f"custom_id {custom_id!r} is not unique.", None)
        elif request.get("method") != "POST":
            problem = ("invalid_method", "method must be POST.", "method")
        elif request.get("url") != endpoint:
            problem = ("mismatched_endpoint", f"url must be the batch's {endpoint}.", "url")
        elif (why := _body_error(request.get("body"), "body")) is not None:
            problem = ("invalid_request", why, "body")
        unknown = set(request) - {"custom_id", "method", "url", "body"}
        if problem is None and unknown:
            name = sorted(unknown)[0]
            problem = ("invalid_request", f"Unrecognized request argument: {name}.", name)
        if problem is not None:
            errors.append(LineError(problem[0], problem[1], number, problem[2]))
            continue
        seen.add(custom_id)
        lines.append((custom_id, request["body"]))
    if not lines and not errors:
        errors.append(LineError("empty_file", "The input file has no requests."))
    if len(lines) > MAX_LINES:
        errors.append(LineError("too_many_requests", f"A batch holds at most {MAX_LINES}."))
    return lines, errors


def parse_anthropic_requests(requests: Any) -> list[tuple[str, dict[str, Any]]]:
    """The requests of a message batch; ValueError naming the first thing wrong."""
    if not isinstance(requests, list) or not requests:
        raise ValueError("requests: must be a non-empty list.")
    if len(requests) > MAX_ANTHROPIC_REQUESTS:
        raise ValueError(f"requests: a batch holds at most {MAX_ANTHROPIC_REQUESTS}.")
    parsed: list[tuple[str, dict[str, Any]]] = []
    seen: set[str] = set()
    for index, request in enumerate(requests):
        where = f"requests.{index}"
        if not isinstance(request, dict):
            raise ValueError(f"{where}: must be an object.")
        unknown = set(request) - {"custom_id", "params"}
        if unknown:
            raise ValueError(f"{where}.{sorted(unknown)[0]}: Extra inputs are not permitted")
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not _ANTHROPIC_CUSTOM_ID.match(custom_id):
            raise ValueError(f"{where}.custom_id: must match ^[a-zA-Z0-9_-]{{1,64}}$.")
        if custom_id in seen:
            raise ValueError(f"{where}.custom_id: {custom_id!r} is not unique in the batch.")
        if (why := _body_error(request.get("params"), f"{where}.params")) is not None:
            raise ValueError(why)
        seen.add(custom_id)
        parsed.append((custom_id, request["params"]))
    return parsed


def unix(when: dt.datetime | None) -> int | None:
    return int(when.timestamp()) if when is not None else None


def rfc3339(when: dt.datetime | None) -> str | None:
    return when.astimezone(dt.UTC).isoformat().replace("+00:00", "Z") if when else None


def file_object(row: BatchFile) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.size,
        "created_at": unix(row.created_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def _ended_at(batch: Batch, status: str) -> int | None:
    return unix(batch.ended_at) if batch.status == status else None


def openai_batch(batch: Batch) -> dict[str, Any]:
    errors = batch.errors
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": unix(batch.created_at),
        "in_progress_at": unix(batch.in_progress_at),
        "expires_at": unix(batch.expires_at),
        "finalizing_at": _ended_at(batch, "completed"),
        "completed_at": _ended_at(batch, "completed"),
        "failed_at": _ended_at(batch, "failed"),
        "expired_at": _ended_at(batch, "expired"),
        "cancelling_at": unix(batch.cancelling_at),
        "cancelled_at": _ended_at(batch, "cancelled"),
        "request_counts": {
            "total": batch.total,
            "completed": batch.succeeded,
            "failed": batch.failed,
        },
        "metadata": batch.batch_metadata,
    }


_PROCESSING = {"validating": "in_progress", "in_progress": "in_progress", "cancelling": "canceling"}


def anthropic_batch(batch: Batch, base_url: str) -> dict[str, Any]:
    processing = _PROCESSING.get(batch.status, "ended")
    unfinished = batch.total - batch.succeeded - batch.failed
    ended = processing == "ended"
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": processing,
        "request_counts": {
            "processing": 0 if ended else unfinished,
            "succeeded": batch.succeeded,
            "errored": batch.failed,
            "canceled": unfinished if batch.status == "cancelled" else 0,
            "expired": unfinished if batch.status == "expired" else 0,
        },
        "ended_at": rfc3339(batch.ended_at),
        "created_at": rfc3339(batch.created_at),
        "expires_at": rfc3339(batch.expires_at),
        "archived_at": None,
        "cancel_initiated_at": rfc3339(batch.cancelling_at),
        "results_url": f"{base_url}/v1/messages/batches/{batch.id}/results" if ended else None,
    }


def request_line_id(batch_id: str, line: int) -> str:
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{line}".encode()).hexdigest()[:24]


_UNRUN = {
    "expired": ("batch_expired", "This request could not be run before the batch expired."),
    "cancelled": ("batch_cancelled", "This request was not run: the batch was cancelled."),
}


def openai_result(batch: Batch, line: BatchLine) -> tuple[bool, dict[str, Any]]:
    """(whether it goes to the output file, the line in OpenAI's output/error file shape)."""
    out: dict[str, Any] = {"id": request_line_id(batch.id, line.line), "custom_id": line.custom_id}
    if line.state != "done":
        code, message = _UNRUN.get(batch.status, _UNRUN["cancelled"])
        return False, {**out, "response": None, "error": {"code": code, "message": message}}
    response = {
        "status_code": line.status_code,
        "request_id": line.request_id,
        "body": line.response,
    }
    ok = line.status_code is not None and 200 <= line.status_code < 300
    return ok, {**out, "response": response, "error": None}


def anthropic_result(batch: Batch, line: BatchLine) -> dict[str, Any]:
    if line.state != "done":
        kind = "expired" if batch.status == "expired" else "canceled"
        return {"custom_id": line.custom_id, "result": {"type": kind}}
    if line.status_code is not None and 200 <= line.status_code < 300:
        return {
            "custom_id": line.custom_id,
            "result": {"type": "succeeded", "message": line.response},
        }
    return {"custom_id": line.custom_id, "result": {"type": "errored", "error": line.response}}
