"""Screenshot the web page after a real answer: ``python tools/web_screenshot.py [--model M] [--out PNG]``.

Starts ``ragkv serve`` on a free loopback port with a throwaway data dir, indexes two of the docs,
asks a question in headless chromium (Debian's chromium + chromium-driver), opens the answer's
sources and saves a desktop and a phone-width screenshot. Run it after changing the page, so
docs/serving.md shows the page as it is.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("docs/concepts.md", "docs/serving.md")
QUESTION = "How does ragkv make the first token come sooner?"
FOLLOW_UP = "Which layer is the check layer?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(model: str, data: Path, max_new_tokens: int) -> tuple[subprocess.Popen[bytes], str]:
    """Start the server; return it and its URL once /health answers."""
    port = free_port()
    env = {**os.environ, "RAGKV_DATA_DIR": str(data), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "ragkv.cli", "serve", "--port", str(port), "--model", model,
           "--data-dir", str(data), "--max-new-tokens", str(max_new_tokens)]  # fmt: skip
    process = subprocess.Popen(cmd, env=env, stderr=(data / "server.log").open("wb"))
    url = f"http://127.0.0.1:{port}"
    while process.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(1)
    raise SystemExit(f"ragkv serve exited with {process.returncode}; see {data / 'server.log'}")


def browser(width: int, height: int, mobile: bool) -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--hide-scrollbars"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    metrics = {"width": width, "height": height, "deviceScaleFactor": 2 if mobile else 1, "mobile": mobile}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    return driver


def ask(driver: Any, question: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    count = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    driver.find_element(By.ID, "question").send_keys(question)
    driver.find_element(By.ID, "ask").click()
    wait = WebDriverWait(driver, 600)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == count + 1)
    wait.until(lambda d: d.find_element(By.ID, "ask").text == "Send")


def shoot(url: str, out: Path, width: int, height: int, mobile: bool, questions: tuple[str, ...]) -> None:
    from selenium.webdriver.common.by import By

    driver = browser(width, height, mobile)
    try:
        driver.get(url + "/")
        time.sleep(1)
        for q in questions:
            ask(driver, q)
        details = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant .sources")
        if details:
            # the last question at the top, its answer and the first sources below it
            script = "arguments[0].open = true; [...document.querySelectorAll('.msg.user')].pop().scrollIntoView();"
            driver.execute_script(script, details[-1])
        time.sleep(0.5)
        driver.save_screenshot(str(out))
        print(f"wrote {out}")
    finally:
        driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model alias, path or .gguf [smollm2-135m]")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/web_page.png")
    parser.add_argument("--phone-out", type=Path, default=ROOT / "docs/web_page_phone.png")
    parser.add_argument("--max-new-tokens", type=int, default=120)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ragkv-shot-") as tmp:
        process, url = serve(args.model, Path(tmp), args.max_new_tokens)
        try:
            docs = [{"source": d, "text": (ROOT / d).read_text(), "title": Path(d).name} for d in DOCS]
            httpx.post(url + "/v1/documents", json=docs, timeout=1800).raise_for_status()
            shoot(url, args.out, 1280, 860, False, (QUESTION, FOLLOW_UP))
            shoot(url, args.phone_out, 390, 844, True, (QUESTION,))
        finally:
            process.terminate()
            process.wait(60)


if __name__ == "__main__":
    main()
