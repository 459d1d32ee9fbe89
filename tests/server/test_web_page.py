"""The web page at / in a real headless chromium (Debian's chromium + chromium-driver; nothing downloaded).

Real answers come from the tiny random-weight model of the ``server`` fixture (16 tokens at most,
so its text is noise); what a real model might write (Markdown, raw HTML) and what a troubled
server answers (413, 429, 5xx) are played to the page by a stand-in ``fetch``, because the tiny
model cannot be made to write them and the shared server should not be made to fail.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.server.conftest import KEYS

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the serve extra")

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="needs Debian's chromium and chromium-driver packages (.ci/services.sh installs them)",
)
LIGHTHOUSES = "Lighthouses guide ships along rocky coasts with bright rotating lamps. " * 8
# every chat request the page sends, with the events the server streamed back (a pass-through spy)
SPY = """
window.sent = []; window.finishes = []; window.cached = []; window.texts = [];
const realFetch = window.fetch;
window.fetch = async (url, opts) => {
  const r = await realFetch(url, opts);
  if (!String(url).includes('/chat/completions')) return r;
  window.sent.push(JSON.parse(opts.body));
  const i = window.texts.push('') - 1;
  r.clone().text().then((text) => {  // read beside the page, so its stream arrives as it comes
  for (const line of text.split('\\n')) {
    if (!line.startsWith('data: {')) continue;
    const ev = JSON.parse(line.slice(6));
    const delta = ev.choices && ev.choices[0] && ev.choices[0].delta;
    if (delta && delta.content) window.texts[i] += delta.content;
    if (ev.choices && ev.choices[0] && ev.choices[0].finish_reason) window.finishes.push(ev.choices[0].finish_reason);
    if (ev.usage) window.cached.push(ev.usage.prompt_tokens_details.cached_tokens);
  }});
  return r;
};
"""
# a stand-in fetch for /v1/chat/completions answering (status, body), a body of SSE payloads when status is 200
FAKE_CHAT = """
const [status, events, pauseMs] = arguments;
const realFetch = window.fetch;
window.fetch = async (url, opts) => {
  if (!String(url).includes('/chat/completions')) return realFetch(url, opts);
  if (status !== 200) return new Response(events, {status, headers: {'Content-Type': 'application/json'}});
  const enc = new TextEncoder();
  const body = new ReadableStream({async start(c) {
    for (const ev of events) {
      c.enqueue(enc.encode('data: ' + JSON.stringify(ev) + '\\n\\n'));
      if (pauseMs) await new Promise((done) => setTimeout(done, pauseMs));
    }
    c.enqueue(enc.encode('data: [DONE]\\n\\n')); c.close();
  }});
  return new Response(body, {status: 200, headers: {'Content-Type': 'text/event-stream'}});
};
"""


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def by(css: str):
    from selenium.webdriver.common.by import By

    return (By.CSS_SELECTOR, css)


def wait(browser, seconds: float = 120):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, seconds, poll_frequency=0.05)


def open_page(browser, url: str) -> None:
    """Load the page and wait until its documents list answered."""
    browser.get(url + "/")
    wait(browser).until(lambda d: d.execute_script("return document.getElementById('docs').textContent").strip())


def ask(browser, question: str) -> object:
    """Type ``question``, send it, and return the assistant message once its answer ended."""
    count = len(browser.find_elements(*by(".msg.assistant")))
    box = browser.find_element(*by("#question"))
    box.send_keys(question)
    browser.find_element(*by("#ask")).click()
    wait(browser).until(lambda d: len(d.find_elements(*by(".msg.assistant"))) == count + 1)
    wait(browser).until(lambda d: d.find_element(*by("#ask")).text == "Send")
    return browser.find_elements(*by(".msg.assistant"))[-1]


def fake_answer(*pieces: str, finish: str = "stop") -> list[dict]:
    """The SSE payloads of a chat answer streamed as ``pieces``, with ragkv's stats and usage."""
    chunk = {"object": "chat.completion.chunk"}
    events = [{**chunk, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]} for p in pieces]
    stats = {"ttft_ms": 12.5, "reused_tokens": 40, "prompt_tokens": 60, "generated_tokens": len(pieces), "sources": []}
    events.append({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "ragkv": stats})
    events.append(
        {**chunk, "choices": [], "usage": {"prompt_tokens": 60, "prompt_tokens_details": {"cached_tokens": 40}}}
    )
    return events


@pytest.fixture
def page(server, browser):
    """The page of the keyless server, loaded afresh at desktop width."""
    open_page(browser, server.url)
    return browser


def test_upload_shows_its_progress_then_lists_the_document_by_name(page, tmp_path):
    note = tmp_path / "lighthouses.txt"
    note.write_text(LIGHTHOUSES)
    # every text the upload box shows, kept as it changes: the progress lines come and go
    page.execute_script(
        "window.seen = []; const box = document.getElementById('upload-status');"
        "new MutationObserver(() => window.seen.push(box.textContent)).observe(box, {childList: true});"
    )
    page.find_element(*by("#file")).send_keys(str(note))
    page.find_element(*by("#upload")).click()
    wait(page).until(lambda d: "indexed lighthouses.txt" in d.find_element(*by("#upload-status")).text)
    seen = page.execute_script("return window.seen")
    assert any(re.fullmatch(r"uploading lighthouses\.txt: \d+%", t) for t in seen), seen  # XHR upload progress
    # indexing progress: the events of one read of the stream show at once, so not every phase or
    # count is seen (a quick prefill's events can arrive with the embedding's): one phase with its count
    phase = r"indexing lighthouses\.txt: (chunking|prefilling chunk caches|embedding and saving) \d+/\d+"
    assert any(re.fullmatch(phase, t) for t in seen), seen
    wait(page).until(lambda d: "lighthouses.txt" in d.find_element(*by("#docs")).text)
    names = [e.text for e in page.find_elements(*by("#docs .doc-name"))]
    assert "lighthouses.txt" in names and not any(":" in n or "/" in n for n in names), names


def test_an_answer_streams_as_generating_then_shows_stats_sources_and_truncation(page, server):
    with server.client() as c:  # the document this test asks about, whatever ran before
        r = c.post("/v1/documents", json={"source": "/srv/notes/lighthouses.txt", "text": LIGHTHOUSES})
        assert r.status_code == 201, r.text
    open_page(page, server.url)
    page.execute_script(SPY)
    # every status the answer shows, in order
    page.execute_script(
        "window.statuses = []; new MutationObserver(() => {"
        " const m = [...document.querySelectorAll('.msg.assistant .status')].pop();"
        " if (m && m.textContent !== window.statuses.at(-1)) window.statuses.push(m.textContent); })"
        ".observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});"
    )
    msg = ask(page, "What guides ships along rocky coasts?")
    wait(page, 10).until(lambda d: d.execute_script("return window.finishes.length") == 1)
    [finish] = page.execute_script("return window.finishes")
    ended = "truncated: the answer hit the max_tokens limit" if finish == "length" else "done"
    assert page.execute_script("return window.statuses") == ["waiting for the first token ...", "generating ...", ended]
    assert msg.find_element(*by(".answer")).text.strip()
    stats = msg.find_element(*by(".stats")).text
    assert re.search(r"TTFT \d+ ms", stats) and re.search(r"reused \d+ of \d+ prompt tokens", stats), stats
    assert bool(msg.find_elements(*by(".truncated"))) == (finish == "length")
    msg.find_element(*by(".sources summary")).click()
    cards = msg.find_elements(*by(".source"))
    named = [c for c in cards if c.find_element(*by(".source-name")).text == "lighthouses.txt"]
    assert named, [c.text for c in cards]  # the document's name, not the server's path
    assert all("/srv/notes" not in c.text for c in cards)
    assert re.fullmatch(r"score -?\d\.\d{3}", named[0].find_element(*by(".score")).text)
    passage = named[0].find_element(*by(".passage"))
    assert " ".join(passage.text.split()) in " ".join(LIGHTHOUSES.split())  # the chunk's text ...
    marked = passage.find_element(*by("mark")).text  # ... with the sentence that matched the question
    assert "guide ships along rocky coasts" in marked
    assert {b.text.lower() for b in passage.find_elements(*by("b"))} >= {"guide", "ships", "rocky", "coasts"}


def test_a_follow_up_sends_the_conversation_and_still_reuses_chunk_caches(page):
    page.execute_script(SPY)
    ask(page, "Where do apples grow?")
    second = ask(page, "And when?")
    wait(page, 10).until(lambda d: d.execute_script("return window.cached.length") == 2)
    sent = page.execute_script("return window.sent")
    assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
    assert sent[1]["messages"][1]["content"] == page.execute_script("return window.texts[0]")
    assert sent[1]["messages"][2]["content"] == "And when?"
    assert all(c > 0 for c in page.execute_script("return window.cached"))  # both answers reused chunk caches
    assert len(page.find_elements(*by(".msg.assistant .stats .ttft"))) == 2  # TTFT per answer
    assert "reused" in second.find_element(*by(".stats .reused")).text
    page.find_element(*by("#new-chat")).click()
    assert not page.find_elements(*by(".msg")) and page.execute_script("return state.history.length") == 0


def test_the_status_says_generating_while_the_tokens_stream(page):
    # 2 s between tokens, polled every 50 ms: a loaded machine still sees the page between two tokens
    page.execute_script(FAKE_CHAT, 200, fake_answer("Lamps ", "turn ", "slowly."), 2000)
    page.find_element(*by("#question")).send_keys("How do lamps turn?")
    page.find_element(*by("#ask")).click()
    answer, status = ".msg.assistant .answer", ".msg.assistant .status"
    wait(page, 10).until(lambda d: d.find_element(*by(answer)).text == "Lamps")
    assert page.find_element(*by(status)).text == "generating ..."  # the first token is in, the rest to come
    wait(page, 20).until(lambda d: d.find_element(*by(answer)).text == "Lamps turn slowly.")
    wait(page, 10).until(lambda d: d.find_element(*by(status)).text == "done")


def test_markdown_is_rendered_and_raw_html_never_reaches_the_dom(page):
    attack = '<img src="x" onerror="window.pwned = 1"><script>window.pwned = 2</script>'
    link = "[click](javascript:window.pwned=3)"
    events = fake_answer(
        "## Lamps\n\n**Bright** lamps and `code`:\n\n", "- one\n- two\n\n", attack, "\n\n", link, finish="length"
    )
    page.execute_script(FAKE_CHAT, 200, events)
    msg = ask(page, "Show me some HTML")
    answer = msg.find_element(*by(".answer"))
    assert answer.find_element(*by("h2")).text == "Lamps"
    assert answer.find_element(*by("strong")).text == "Bright"
    assert [li.text for li in answer.find_elements(*by("li"))] == ["one", "two"]
    assert not answer.find_elements(*by("img, script, iframe, [onerror]"))
    assert "<img" in answer.text  # shown as text, not parsed
    assert all(not (a.get_attribute("href") or "").startswith("javascript") for a in answer.find_elements(*by("a")))
    assert page.execute_script("return window.pwned") is None
    assert msg.find_element(*by(".truncated")).text == "truncated: the answer hit the max_tokens limit"


@pytest.mark.parametrize(
    ("status", "says"),
    [(413, "Too large (413)"), (429, "Server busy (429)"), (500, "Server error (500)"), (503, "Server error (503)")],
)
def test_server_errors_are_readable_messages(page, status, says):
    body = json.dumps({"error": {"message": "the server's own words", "type": "x", "param": None, "code": None}})
    page.execute_script(FAKE_CHAT, status, body)
    msg = ask(page, "Anything?")
    error = msg.find_element(*by(".error")).text
    assert error.startswith(says) and "the server's own words" in error
    assert page.execute_script("return state.history.length") == 0  # the failed question left the conversation


def test_the_key_field_shows_only_when_the_server_requires_keys(page, keyed_server):
    assert not page.find_element(*by("#key-box")).is_displayed()
    page.get(keyed_server.url + "/")
    wait(page).until(lambda d: d.find_element(*by("#key-box")).is_displayed())
    wait(page).until(lambda d: "Not authorized (401)" in d.find_element(*by("#docs")).text)
    page.find_element(*by("#key")).send_keys("sk-wrong-key")
    error = ask(page, "Where do apples grow?").find_element(*by(".error")).text
    assert error.startswith("Not authorized (401)") and "unknown API key" in error  # a real 401
    key = page.find_element(*by("#key"))
    key.clear()
    key.send_keys(next(iter(KEYS)))
    page.find_element(*by("#question")).click()  # leaving the field applies the key
    wait(page).until(lambda d: "401" not in d.find_element(*by("#docs")).text)


def test_a_document_is_deleted_after_a_confirming_second_click(page, server):
    with server.client() as c:
        assert (
            c.post("/v1/documents", json={"source": "mem:ferns", "text": "Ferns grow in shade. " * 5}).status_code
            == 201
        )
    open_page(page, server.url)
    item = next(d for d in page.find_elements(*by("#docs .doc")) if d.find_element(*by(".doc-name")).text == "ferns")
    button = item.find_element(*by(".delete"))
    button.click()
    assert button.text == "Confirm"
    button.click()
    wait(page).until(lambda d: "deleted ferns" in d.find_element(*by("#upload-status")).text)
    # the list is fetched again after the status says so
    names = "return [...document.querySelectorAll('#docs .doc-name')].map(e => e.textContent)"
    wait(page).until(lambda d: "ferns" not in d.execute_script(names))
    with server.client() as c:
        assert "mem:ferns" not in [d["source"] for d in c.get("/v1/documents").json()["data"]]


def test_the_page_fits_a_phone(page, server):
    page.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride", {"width": 390, "height": 844, "deviceScaleFactor": 3, "mobile": True}
    )
    try:
        open_page(page, server.url)
        long_line = "x" * 400
        page.execute_script(FAKE_CHAT, 200, fake_answer(f"A long word {long_line}\n\n```\n{long_line}\n```\n"))
        ask(page, "A question long enough to wrap on a phone screen, and then some more words")
        fits = "return [document.documentElement.scrollWidth, window.innerWidth, document.body.scrollWidth]"
        scroll_width, width, body_width = page.execute_script(fits)
        assert width == 390 and scroll_width <= width and body_width <= width
        box = page.find_element(*by("#question"))
        rect = page.execute_script(
            "const r = arguments[0].getBoundingClientRect(); return [r.left, r.right, r.bottom];", box
        )
        assert box.is_displayed() and rect[0] >= 0 and rect[1] <= 390 and rect[2] <= 844
        assert page.find_element(*by("#sidebar")).rect["x"] < 0  # the documents drawer starts closed ...
        page.find_element(*by("#menu")).click()  # ... and the menu opens it
        wait(page, 10).until(lambda d: d.find_element(*by("#sidebar")).rect["x"] >= 0)
        assert page.find_element(*by("#upload")).is_displayed()
    finally:
        page.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_an_upload_over_the_size_limit_is_a_readable_message(page, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("Lamps. " * (9 * 1024 * 1024 // 7))  # over the server's 8 MiB default limit
    page.find_element(*by("#file")).send_keys(str(big))
    page.find_element(*by("#upload")).click()
    wait(page, 60).until(lambda d: "upload failed" in d.find_element(*by("#upload-status")).text)
    status = page.find_element(*by("#upload-status")).text
    assert status.startswith("upload failed: Too large (413)") and "limit of 8388608 bytes" in status, status


def test_the_page_loads_nothing_from_other_sites(page, server):
    urls = page.execute_script(
        "return [...document.querySelectorAll('script[src], link[href]')].map((e) => e.src || e.href)"
    )
    assert urls and all(u.startswith(server.url + "/static/") for u in urls), urls
    with server.client() as c:  # the vendored libraries ship with their licenses
        for name in ("marked.LICENSE.txt", "purify.LICENSE.txt", "VENDOR.txt"):
            assert c.get(f"/static/{name}").status_code == 200
