"""POST/GET/DELETE /v1/documents, scoped to the caller's tenant; indexing can stream its progress.

Indexing a large upload takes minutes (every chunk's cache is prefilled), so ``POST`` with
``?stream=true`` (or ``Accept: text/event-stream``) answers at once with server-sent events, as
chat completions stream: ``{"object": "document.progress", "phase", "done", "total"}`` per step,
then ``{"object": "document.index", "status", ...report}`` and ``data: [DONE]``. Without it the
call blocks and answers the report, as before. Indexing runs to the end even when the client
leaves: what it stored is committed, and posting the same documents again costs little.

When the server is told to stop (SIGTERM) an upload in flight stops at its next step: the documents
complete by then are committed, the others are not (none is ever half committed), and the answer is
a 503 naming which were indexed (before, uvicorn's drain ran out and cut it to a bare 500 while the
indexing went on behind it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ragkv.digests import text_digest
from ragkv.errors import DocumentNotFoundError, RagkvError, StorageWriteError
from ragkv.retriever.documents import document_source
from ragkv.retriever.kv_retriever import IndexProgress, ProgressFn
from ragkv.server.state import ApiError, ServerState

logger = logging.getLogger(__name__)

__all__ = ["router"]

_END = object()


class _Closing(Exception):
    """The server began shutting down while an upload was indexing."""


def router(state: ServerState) -> APIRouter:
    """The /v1/documents routes bound to ``state``."""
    api = APIRouter(prefix="/v1/documents")

    @api.post("")
    async def add_document(request: Request) -> Any:
        engine = await state.engine(request)
        if state.closing.is_set():
            raise ApiError(503, "the server is shutting down; upload again once it is back", "unavailable")
        docs = await _read_documents(request)  # bad input is a 4xx before any stream starts
        size = sum(len(d.text.encode()) for d in docs)
        await state.admit_upload(engine, size)  # reserves size (and the tenant's turn) until upload_done
        if _wants_stream(request):
            events = _index_events(state, engine, docs, size)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            body, status = await asyncio.to_thread(_index, state, engine, docs, None)
        except (ValueError, RagkvError) as e:
            raise ApiError(400, str(e)) from e
        finally:
            state.upload_done(engine, size)
        return JSONResponse(body, status_code=status)

    @api.get("")
    async def list_documents(request: Request) -> Any:
        engine = await state.engine(request)
        docs = await asyncio.to_thread(engine.documents)
        data = [{"id": d.doc_id, "source": d.source, "title": d.title, "chunks": d.num_chunks} for d in docs]
        return {"object": "list", "data": data}

    @api.delete("/{doc_id}")
    async def delete_document(doc_id: str, request: Request) -> Any:
        engine = await state.engine(request)
        docs = await asyncio.to_thread(engine.documents)
        match = [d for d in docs if doc_id in (d.doc_id, d.source)]
        if not match:
            raise ApiError(404, f"no document {doc_id!r} here; GET /v1/documents lists the ids")
        try:
            report = await asyncio.to_thread(engine.remove, match[0].source)
        except DocumentNotFoundError as e:
            raise ApiError(404, str(e)) from e
        await asyncio.to_thread(state.refresh, engine)
        return {"id": match[0].doc_id, "deleted": True, **asdict(report)}

    return api


def _wants_stream(request: Request) -> bool:
    flag = request.query_params.get("stream", "").lower()
    return flag in ("1", "true", "yes") or "text/event-stream" in request.headers.get("accept", "")


def _index(
    state: ServerState, engine: Any, docs: list[Any], on_progress: ProgressFn | None
) -> tuple[dict[str, Any], int]:
    """Index ``docs`` and make their chunks findable in prompts; the report body and its HTTP status."""

    def step(done: IndexProgress) -> None:
        if state.closing.is_set():  # raised here, the indexer commits what is complete and stops
            raise _Closing
        if on_progress is not None:
            on_progress(done)

    try:
        report = engine.index(docs, progress=False, on_progress=step)
    except StorageWriteError as e:  # the FAISS file could not be written: nothing was committed
        raise ApiError(507, str(e.strerror or e), "insufficient_storage") from e
    except _Closing:
        raise ApiError(503, _interrupted(engine, docs), "unavailable", **{"Retry-After": "10"}) from None
    state.refresh(engine)
    body = asdict(report)
    body["sources"] = [d.source for d in docs]
    if not report.failed:
        return body, 201
    # no lasting tier took some chunk caches (full, over a limit, down): those documents were not committed
    body["error"] = {"message": _refused(engine, report.failed), "type": "insufficient_storage"}
    return body, 507


def _interrupted(engine: Any, docs: list[Any]) -> str:
    """What an upload stopped by the server's shutdown left indexed (its documents committed whole)."""
    retriever = engine.retriever
    indexed = []
    for doc in docs:
        record = retriever.catalog.get_document(document_source(doc), retriever.tenant)
        if record is not None and record.content_digest == text_digest(doc.text):
            indexed.append(doc.source)
    return (
        f"the server is shutting down: the upload stopped with {len(indexed)} of its {len(docs)} documents "
        f"indexed ({', '.join(indexed) or 'none'}); the others are not: upload them again once it is back"
    )


def _refused(engine: Any, failed: int) -> str:
    """Why an upload's caches were not stored, naming each lasting tier's limits."""
    limits = [
        f"{tier.name} (max_bytes={tier.config.max_bytes or 'default'}, "
        f"tenant_max_bytes={tier.config.tenant_max_bytes or 'max_bytes'}, refused {tier.stats().refused})"
        for tier in engine.store.tiers
        if not tier.in_process and tier.writable
    ]
    return (
        f"the store did not take {failed} chunk caches, so their documents were not indexed: "
        f"{'; '.join(limits) or 'no lasting tier'} had no room (or was down); "
        "remove documents, raise the tier's limits, or retry"
    )


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _index_events(state: ServerState, engine: Any, docs: list[Any], size: int) -> AsyncIterator[bytes]:
    """Start indexing ``docs`` on a worker thread now; the events: progress, then the report (or the error).

    The work starts before the response does: a client that leaves before its stream is read still
    gets its documents indexed, and the upload's quota reservation (``size`` bytes) released.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def heard(step: IndexProgress) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, step)

    # a task of its own: a client that leaves stops this stream, never the indexing (nor the refresh)
    def indexed() -> tuple[dict[str, Any], int]:
        try:
            return _index(state, engine, docs, heard)
        finally:
            state.upload_done(engine, size)  # the reservation ends with the indexing, whoever still listens

    work = asyncio.ensure_future(asyncio.to_thread(indexed))
    work.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, _END))
    return _events(queue, work)


async def _events(queue: asyncio.Queue[Any], work: asyncio.Future[tuple[dict[str, Any], int]]) -> AsyncIterator[bytes]:
    """Server-sent events of one indexing run (see :func:`_index_events`)."""
    while (item := await queue.get()) is not _END:
        yield _sse({"object": "document.progress", "phase": item.phase, "done": item.done, "total": item.total})
    try:
        body, status = work.result()
    except ApiError as e:  # the server is shutting down (see _index)
        yield _sse({"error": {"message": str(e.detail), "type": e.kind, "status": e.status_code}})
    except (ValueError, RagkvError) as e:
        yield _sse({"error": {"message": str(e), "type": "invalid_request_error", "status": 400}})
    except Exception:
        logger.exception("indexing failed")
        yield _sse({"error": {"message": "indexing failed; see the server log", "type": "server_error", "status": 500}})
    else:
        yield _sse({"object": "document.index", "status": status, **body})
    yield b"data: [DONE]\n\n"


async def _read_documents(request: Request) -> list[Any]:
    """Documents from a JSON body ``{"source", "text", "title"?}`` (or a list of them) or a multipart upload."""
    from ragkv.retriever.documents import Document

    ctype = request.headers.get("content-type", "")
    if ctype.startswith("multipart/form-data"):
        form = await request.form()
        docs = []
        for value in form.getlist("file"):
            if isinstance(value, str):
                continue
            raw = await value.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ApiError(400, f"{value.filename}: not UTF-8 text; upload plain text or Markdown") from e
            name = value.filename or "upload.txt"
            _no_nul(name, "a file name")
            docs.append(Document(source=f"upload:{name}", text=text.replace("\r\n", "\n"), title=name))
        if not docs:
            raise ApiError(400, "no file in the upload; send multipart field 'file'")
        return docs
    try:
        body = await request.json()
    except ValueError as e:
        raise ApiError(400, 'send JSON {"source": ..., "text": ...} or a multipart \'file\' upload') from e
    items = body if isinstance(body, list) else [body]
    docs = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("text"), str) or not item["text"].strip():
            raise ApiError(400, "each document needs a non-empty 'text' (and a 'source' naming it)")
        source = item.get("source") or ""
        if not isinstance(source, str):
            raise ApiError(400, "a document's 'source' must be a string (a name such as 'wiki:Paris')")
        source = source.strip()
        if not source:
            raise ApiError(
                400, "each document needs a 'source' (a name such as 'wiki:Paris'); re-posting it replaces it"
            )
        title = item.get("title") or source
        if not isinstance(title, str):
            raise ApiError(400, "a document's 'title' must be a string")
        _no_nul(source, "a document's 'source'")
        _no_nul(title, "a document's 'title'")
        docs.append(Document(source=source, text=item["text"], title=title))
    return docs


def _no_nul(value: str, what: str) -> None:
    """Names end up in paths, SQL rows and logs, where a NUL byte truncates or breaks them."""
    if "\x00" in value:
        raise ApiError(400, f"{what} holds a NUL byte (\\u0000); remove it")
