// The ragkv web page: a chat over the server's OpenAI-compatible API, and a documents panel.
// Everything the model or a document says goes into the DOM as text nodes, or as Markdown that marked
// renders with raw HTML escaped and DOMPurify then sanitizes; never as HTML of its own.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  history: [],          // the conversation sent with every question: [{role, content}]
  titles: new Map(),    // document source -> its name, from GET /v1/documents
  busy: null,           // the AbortController of the answer being streamed
  needsKey: false,
};
const PHASES = { chunking: "chunking", precompute: "prefilling chunk caches", embedding: "embedding and saving" };
const STOP_WORDS = new Set(("the a an and or of to in on at for with by from is are was were be been it its this that " +
  "what which who whom how why when where do does did can could would should will about into as not no").split(" "));

// ---- HTTP ----------------------------------------------------------------------------------------
function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = $("key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

/** A readable sentence for a failed request: what happened, then the server's own message. */
function errorText(status, bodyText) {
  let detail = "";
  try { detail = JSON.parse(bodyText).error.message; } catch (e) { detail = (bodyText || "").trim().slice(0, 300); }
  const what = status === 401 ? "Not authorized (401): enter a valid API key above"
    : status === 413 ? "Too large (413): the server refused a request this big"
    : status === 429 ? "Server busy (429): too many requests are waiting; try again in a moment"
    : status >= 500 ? "Server error (" + status + ")"
    : status === 0 ? "No answer from the server (is ragkv serve still running?)"
    : "Request failed (" + status + ")";
  return detail ? what + ". " + detail : what + ".";
}

/** Server-sent events: feed text as it arrives, get back the JSON payload of each complete "data:" line. */
class SseParser {
  constructor() { this.buf = ""; }
  feed(text) {
    this.buf += text;
    const out = [];
    let cut;
    while ((cut = this.buf.indexOf("\n\n")) >= 0) {
      const block = this.buf.slice(0, cut); this.buf = this.buf.slice(cut + 2);
      for (const line of block.split("\n")) {
        const data = line.startsWith("data:") ? line.slice(5).trim() : "";
        if (data && data !== "[DONE]") { try { out.push(JSON.parse(data)); } catch (e) { /* not JSON: skip */ } }
      }
    }
    return out;
  }
}

// ---- rendering -----------------------------------------------------------------------------------
function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}
function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
// raw HTML in the model's Markdown is shown as text, not parsed: it never becomes an element
marked.use({ gfm: true, breaks: true, renderer: { html: ({ text }) => escapeHtml(text) } });
const PURIFY = {
  ALLOWED_TAGS: ["p", "br", "strong", "em", "del", "code", "pre", "blockquote", "ul", "ol", "li", "a", "h1", "h2",
    "h3", "h4", "h5", "h6", "hr", "table", "thead", "tbody", "tr", "th", "td", "span"],
  ALLOWED_ATTR: ["href", "title", "start", "align", "class"],
  ALLOWED_URI_REGEXP: /^(?:https?:|mailto:|#)/i,
};
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") { node.setAttribute("target", "_blank"); node.setAttribute("rel", "noopener noreferrer"); }
});
function renderMarkdown(node, text) {
  node.innerHTML = DOMPurify.sanitize(marked.parse(text), PURIFY);
}

/** A document's name for people: its title from the list, else the last part of its source (never a server path). */
function docName(source) {
  const title = state.titles.get(source);
  if (title && title !== source) return title;  // a title of its own (an upload's file name)
  return source.replace(/^[a-z][a-z0-9+.-]*:(?!\/\/)/i, "").split(/[\\/]/).filter(Boolean).pop() || source;
}

/** The question's words as a pattern: each word's stem and any ending ("guides" finds "guide", "guided"). */
function queryPattern(question) {
  const words = question.toLowerCase().match(/[\p{L}\p{N}]+/gu) || [];
  const stems = [...new Set(words.filter((w) => w.length > 2 && !STOP_WORDS.has(w))
    .map((w) => (w.length > 4 ? w.replace(/(es|s)$/, "") : w)))];
  if (!stems.length) return null;
  return new RegExp("(?<![\\p{L}\\p{N}])(?:" + stems.join("|") + ")[\\p{L}\\p{N}]*", "giu");
}

/** The chunk's text with its best-matching sentence in <mark> and the question's words in <b>. */
function passage(text, pattern) {
  const box = el("div", "passage");
  // a sentence ends at . ! or ? before a space (not inside "api.py") or at a blank line
  const sentences = (text.match(/[\s\S]*?(?:[.!?]+(?=\s)|\n\s*\n|$)\s*/g) || []).filter(Boolean);
  const hits = (s) => (pattern ? new Set((s.match(pattern) || []).map((w) => w.toLowerCase())).size : 0);
  let best = -1, bestHits = 0;
  sentences.forEach((s, i) => { const h = hits(s); if (h > bestHits) { best = i; bestHits = h; } });
  const words = (parent, s) => {
    let at = 0;
    for (const m of pattern ? s.matchAll(pattern) : []) {
      parent.append(s.slice(at, m.index), el("b", "", m[0]));
      at = m.index + m[0].length;
    }
    parent.append(s.slice(at));
  };
  sentences.forEach((s, i) => {
    if (i === best) { const m = el("mark"); words(m, s); box.append(m); } else words(box, s);
  });
  return box;
}

function sourcesList(sources, question) {
  const wrap = el("details", "sources");
  wrap.append(el("summary", "", sources.length + (sources.length === 1 ? " source" : " sources")));
  const pattern = queryPattern(question);
  for (const s of sources) {
    const card = el("div", "source");
    const head = el("div", "source-head");
    head.append(el("span", "source-name", docName(s.source)), el("span", "source-chunk", "chunk " + s.chunk));
    if (typeof s.score === "number") head.append(el("span", "score", "score " + s.score.toFixed(3)));
    card.append(head, passage(s.text || "", pattern));
    card.title = s.source;
    wrap.append(card);
  }
  // a long chunk scrolls inside its card: bring its matched sentence into view once the list opens
  wrap.addEventListener("toggle", () => wrap.querySelectorAll(".passage").forEach((box) => {
    const mark = box.querySelector("mark");
    if (mark) box.scrollTop = mark.offsetTop - 4;  // .passage is positioned: offsetTop is within it
  }));
  return wrap;
}

function addMessage(role) {
  $("empty").hidden = true;
  const msg = el("div", "msg " + role);
  const bubble = el("div", "bubble");
  msg.append(bubble);
  $("messages").append(msg);
  return { msg, bubble };
}
function scrollDown() { const m = $("messages"); m.scrollTop = m.scrollHeight; }

// ---- chat ----------------------------------------------------------------------------------------
function setBusy(controller) {
  state.busy = controller;
  $("ask").textContent = controller ? "Stop" : "Send";
  $("ask").classList.toggle("stop", !!controller);
}

async function ask() {
  if (state.busy) { state.busy.abort(); return; }
  const q = $("question").value.trim();
  if (!q) return;
  $("question").value = ""; autoGrow();
  addMessage("user").bubble.append(el("div", "text", q));
  state.history.push({ role: "user", content: q });
  const { msg, bubble } = addMessage("assistant");
  const answer = el("div", "answer markdown");
  const status = el("div", "status", "waiting for the first token ...");
  bubble.append(answer, status);
  scrollDown();
  const controller = new AbortController();
  setBusy(controller);
  let text = "", final = null, usage = null, error = null, pending = false;
  const paint = () => { pending = false; renderMarkdown(answer, text); scrollDown(); };
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ messages: state.history, stream: true, stream_options: { include_usage: true },
                             ragkv: { retrieve: true } }),
    });
    if (!r.ok) throw new Error(errorText(r.status, await r.text()));
    const reader = r.body.getReader(), dec = new TextDecoder(), sse = new SseParser();
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      for (const ev of sse.feed(dec.decode(value, { stream: true }))) {
        if (ev.error) { error = "The server stopped the answer: " + ev.error.message; continue; }
        if (ev.usage) usage = ev.usage;
        if (ev.ragkv) final = ev;
        const c = ev.choices && ev.choices[0];
        if (c && c.delta && c.delta.content) {
          text += c.delta.content;
          status.textContent = "generating ...";
          status.classList.add("live");
          if (!pending) { pending = true; requestAnimationFrame(paint); }
        }
      }
    }
  } catch (e) {
    error = e.name === "AbortError" ? "Stopped." : e instanceof TypeError ? errorText(0, e.message) : e.message;
  }
  setBusy(null);
  paint();
  status.classList.remove("live");
  finishAnswer(msg, bubble, status, { text, final, usage, error, question: q });
}

function finishAnswer(msg, bubble, status, { text, final, usage, error, question }) {
  if (error && error !== "Stopped.") {
    bubble.append(el("div", "error", error));
    bubble.lastChild.setAttribute("role", "alert");
  }
  if (!text.trim()) {
    if (!error) bubble.append(el("div", "error", "The model returned an empty answer."));
    state.history.pop();  // the question got no answer: leave it out of the conversation
    status.textContent = error === "Stopped." ? "stopped" : "failed";
    msg.classList.add("failed");
    return;
  }
  state.history.push({ role: "assistant", content: text });
  const choice = final && final.choices && final.choices[0];
  const truncated = choice && choice.finish_reason === "length";
  status.textContent = error === "Stopped." ? "stopped" : truncated ? "" : "done";
  if (truncated) {
    status.append(el("span", "truncated", "truncated: the answer hit the max_tokens limit"));
  }
  if (final) {
    const s = final.ragkv;
    const cached = usage && usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : s.reused_tokens;
    const prompt = usage ? usage.prompt_tokens : s.prompt_tokens;
    const stats = el("div", "stats");
    stats.append(
      el("span", "stat ttft", "TTFT " + Math.round(s.ttft_ms) + " ms"),
      el("span", "stat reused", "reused " + cached + " of " + prompt + " prompt tokens"),
      el("span", "stat", s.generated_tokens + " answer tokens"),
    );
    bubble.append(stats);
    if (s.sources && s.sources.length) bubble.append(sourcesList(s.sources, question));
  }
  scrollDown();
}

// ---- documents -----------------------------------------------------------------------------------
async function listDocs() {
  const list = $("docs");
  let r;
  try { r = await fetch("/v1/documents", { headers: headers() }); } catch (e) { list.replaceChildren(el("li", "error", errorText(0, e.message))); return; }
  if (!r.ok) { list.replaceChildren(el("li", "error", errorText(r.status, await r.text()))); return; }
  const docs = (await r.json()).data;
  state.titles = new Map(docs.map((d) => [d.source, d.title]));
  list.replaceChildren(...docs.map(docItem));
  if (!docs.length) list.append(el("li", "muted", "Nothing indexed yet: upload a file."));
}

function docItem(d) {
  const li = el("li", "doc");
  const info = el("div", "doc-info");
  info.append(el("span", "doc-name", docName(d.source)), el("span", "doc-meta", d.chunks + " chunks"));
  info.title = d.source;
  const del = el("button", "delete", "Delete");
  del.type = "button";
  del.setAttribute("aria-label", "Delete " + docName(d.source));
  del.onclick = async () => {
    if (!del.classList.contains("confirm")) { del.classList.add("confirm"); del.textContent = "Confirm"; return; }
    del.disabled = true;
    const r = await fetch("/v1/documents/" + encodeURIComponent(d.id), { method: "DELETE", headers: headers() })
      .catch((e) => ({ ok: false, status: 0, text: async () => e.message }));
    if (!r.ok) { uploadStatus(errorText(r.status, await r.text()), true); del.disabled = false; return; }
    uploadStatus("deleted " + docName(d.source));
    listDocs();
  };
  li.append(info, del);
  return li;
}

function uploadStatus(text, isError) {
  $("upload-status").textContent = text;
  $("upload-status").classList.toggle("error", !!isError);
}

function upload() {
  const f = $("file").files[0];
  if (!f) { uploadStatus("choose a file first", true); return; }
  const bar = $("upload-progress");
  const form = new FormData();
  form.append("file", f);
  const xhr = new XMLHttpRequest();
  const sse = new SseParser();
  let seen = 0, failed = false;
  xhr.open("POST", "/v1/documents?stream=true");
  for (const [k, v] of Object.entries(headers())) xhr.setRequestHeader(k, v);
  bar.hidden = false; bar.value = 0;
  $("upload").disabled = true;
  uploadStatus("uploading " + f.name + ": 0%");
  xhr.upload.onprogress = (e) => {
    if (!e.lengthComputable) return;
    bar.value = Math.round((100 * e.loaded) / e.total);
    uploadStatus("uploading " + f.name + ": " + bar.value + "%");
  };
  xhr.upload.onload = () => { bar.removeAttribute("value"); uploadStatus("indexing " + f.name + " ..."); };
  const events = () => {
    if (xhr.status >= 400) return;
    const fresh = xhr.responseText.slice(seen); seen = xhr.responseText.length;
    for (const ev of sse.feed(fresh)) {
      if (ev.object === "document.progress") {
        bar.max = ev.total; bar.value = ev.done;
        uploadStatus("indexing " + f.name + ": " + (PHASES[ev.phase] || ev.phase) + " " + ev.done + "/" + ev.total);
      } else if (ev.error) {
        failed = true; uploadStatus("upload failed: " + ev.error.message, true);
      } else if (ev.object === "document.index") {
        failed = ev.status !== 201;
        uploadStatus(failed ? "upload failed: " + ev.failed + " chunk caches were not stored; upload again to retry"
          : "indexed " + f.name + ": " + ev.chunks + " chunks, " + ev.computed + " caches computed", failed);
      }
    }
  };
  xhr.onprogress = events;
  xhr.onload = () => {
    events();
    $("upload").disabled = false;
    bar.hidden = true; bar.max = 100;
    if (xhr.status >= 400) uploadStatus("upload failed: " + errorText(xhr.status, xhr.responseText), true);
    listDocs();
  };
  xhr.onerror = () => {
    bar.hidden = true;
    $("upload").disabled = false;
    uploadStatus("upload failed: the connection closed before the server answered (a file over the server's " +
      "size limit is refused this way; try a smaller one)", true);
  };
  xhr.send(form);
}

// ---- API key, model name, layout -----------------------------------------------------------------
/** Show the key field only when the server wants keys: /v1/models answers 401 without one. */
async function probeKeys() {
  try {
    const r = await fetch("/v1/models");
    state.needsKey = r.status === 401;
    if (r.ok) $("model").textContent = (await r.json()).data[0].id;
  } catch (e) { /* listDocs reports an unreachable server */ }
  $("key-box").hidden = !state.needsKey;
  if (state.needsKey) $("key").value = sessionStorage.getItem("ragkv-key") || "";
}

function autoGrow() {
  const q = $("question");
  q.style.height = "auto";
  q.style.height = Math.min(q.scrollHeight, 200) + "px";
}

function wire() {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); ask(); });
  $("question").addEventListener("keydown", (e) => {
    // Enter sends (Shift+Enter: a new line); while an answer streams only the Stop button stops it
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); if (!state.busy) ask(); }
  });
  $("question").addEventListener("input", autoGrow);
  $("upload").onclick = upload;
  $("file").onchange = () => { $("file-label").textContent = $("file").files[0] ? $("file").files[0].name : "Choose a .txt or .md file"; };
  $("key").addEventListener("change", () => { sessionStorage.setItem("ragkv-key", $("key").value.trim()); listDocs(); });
  $("new-chat").onclick = () => {
    if (state.busy) state.busy.abort();
    state.history = [];
    $("messages").replaceChildren($("empty"));
    $("empty").hidden = false;
  };
  const drawer = (open) => {
    document.body.classList.toggle("drawer-open", open);
    $("menu").setAttribute("aria-expanded", String(open));
  };
  $("menu").onclick = () => drawer(!document.body.classList.contains("drawer-open"));
  document.querySelector(".chat").addEventListener("click", () => drawer(false));
}

wire();
probeKeys().then(listDocs);
