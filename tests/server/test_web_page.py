"""The web page at / in a real headless chromium (Debian's chromium + chromium-driver; nothing downloaded)."""

from __future__ import annotations

import shutil

import pytest

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the serve extra")

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="needs Debian's chromium and chromium-driver packages (.ci/services.sh installs them)",
)


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


def test_upload_ask_and_see_streamed_text_with_stats(server, browser, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    note = tmp_path / "lighthouses.txt"
    note.write_text("Lighthouses guide ships along rocky coasts with bright rotating lamps. " * 8)
    browser.get(server.url + "/")
    wait = WebDriverWait(browser, 120)
    # every text the upload box shows, kept as it changes: the progress lines come and go
    browser.execute_script(
        "window.seen = []; const box = document.getElementById('upload-status');"
        "new MutationObserver(() => window.seen.push(box.textContent)).observe(box, {childList: true});"
    )
    browser.find_element(By.ID, "file").send_keys(str(note))
    browser.find_element(By.ID, "upload").click()
    wait.until(lambda d: "indexed lighthouses.txt" in d.find_element(By.ID, "upload-status").text)
    seen = browser.execute_script("return window.seen")
    assert any(t.startswith("indexing lighthouses.txt: prefilling chunk caches 1/") for t in seen), seen
    assert "indexing lighthouses.txt: embedding and saving 1/1" in seen
    wait.until(lambda d: "lighthouses.txt" in d.find_element(By.ID, "docs").text)
    browser.find_element(By.ID, "question").send_keys("What guides ships along rocky coasts?")
    browser.find_element(By.ID, "ask").click()
    wait.until(lambda d: "TTFT" in d.find_element(By.ID, "stats").text)
    stats = browser.find_element(By.ID, "stats").text
    assert "reused" in stats and "answer tokens" in stats
    assert browser.find_element(By.ID, "answer").text.strip()
    assert "upload:lighthouses.txt" in browser.find_element(By.ID, "sources").text
