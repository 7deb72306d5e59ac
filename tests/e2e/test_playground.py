"""The playground page (GET /) in a real headless Chromium (Debian's chromium + chromium-driver), driven through
the W3C WebDriver protocol over HTTP: types a prompt, clicks Send, and checks that coloured tokens and the live
figures appear. Skips where no Chromium is installed; `.ci/run` installs it (install.sh --dev).

The screenshot goes to $SPECSERVE_ARTIFACTS (default: the test's temporary directory); its path is printed.
"""

from __future__ import annotations

import base64
import os
import pathlib
import shutil
import subprocess
import time

import pytest
import requests
from ray import serve

from specserve.serve import build_app
from specserve.serve.listen import free_port
from tests.conftest import save_tokenized_pair, start_local_serve, stop_local_serve

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("no Chromium here (apt-get install chromium chromium-driver)", allow_module_level=True)

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C WebDriver key of an element reference


class Browser:
    """A headless Chromium session through chromedriver's WebDriver endpoint (no client library needed)."""

    def __init__(self):
        port = free_port()
        self.driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(self.url + "/status", timeout=2).json()["value"]["ready"]:
                    break
            except (requests.ConnectionError, KeyError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.driver.kill()
                raise RuntimeError("chromedriver did not start")
            time.sleep(0.2)
        options = {"binary": CHROMIUM, "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                                                "--disable-dev-shm-usage", "--window-size=1280,1000"]}
        reply = requests.post(self.url + "/session", timeout=60, json={
            "capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}}).json()
        self.session = reply["value"]["sessionId"]

    def command(self, method: str, path: str, body: dict | None = None):
        reply = requests.request(method, f"{self.url}/session/{self.session}{path}", json=body, timeout=120)
        value = reply.json()["value"]
        if reply.status_code != 200:
            raise RuntimeError(f"{method} {path}: {value}")
        return value

    def open(self, url: str) -> None:
        self.command("POST", "/url", {"url": url})

    def element(self, css: str) -> str:
        return self.command("POST", "/element", {"using": "css selector", "value": css})[ELEMENT]

    def type(self, css: str, text: str) -> None:
        element = self.element(css)
        self.command("POST", f"/element/{element}/clear", {})
        self.command("POST", f"/element/{element}/value", {"text": text})

    def click(self, css: str) -> None:
        self.command("POST", f"/element/{self.element(css)}/click", {})

    def js(self, script: str, *args):
        return self.command("POST", "/execute/sync", {"script": script, "args": list(args)})

    def screenshot(self, path: pathlib.Path) -> None:
        path.write_bytes(base64.b64decode(self.command("GET", "/screenshot")))

    def quit(self) -> None:
        try:
            requests.delete(f"{self.url}/session/{self.session}", timeout=30)
        finally:
            self.driver.terminate()
            self.driver.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = save_tokenized_pair(tmp_path_factory.mktemp("playground-models"), noise=0.05)
    addresses = start_local_serve()
    args = {"target": str(root / "target"), "draft": str(root / "draft"), "dtype": "float32", "gamma": "auto",
            "model_name": "tiny", "target_resources": {"torch_threads": 1}, "draft_placement": "colocated"}
    serve.run(build_app(args), name="playground", route_prefix="/")
    yield addresses
    stop_local_serve()


@pytest.fixture
def browser():
    b = Browser()
    yield b
    b.quit()


COUNTS = """
const count = (css) => document.querySelectorAll('#chat ' + css).length;
return {accepted: count('.tok.acc'), corrections: count('.tok.cor'), bonus: count('.tok.bonus'),
        rejected: count('.tok.rej'), tokens: count('.tok'), busy: document.getElementById('send').disabled,
        acceptance: document.getElementById('acceptance').textContent,
        per_round: document.getElementById('tokens-per-round').textContent,
        tps: document.getElementById('tps').textContent, rounds: document.getElementById('rounds').textContent,
        error: document.getElementById('error').textContent, model: document.getElementById('model').textContent,
        chart: document.getElementById('gamma-chart').toDataURL().length};
"""


def wait_for_answer(browser: Browser, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = browser.js(COUNTS)
        if (state["tokens"] and not state["busy"]) or state["error"] or time.monotonic() > deadline:
            return state
        time.sleep(0.3)


def test_the_playground_colours_tokens_and_shows_live_figures(server, browser, tmp_path):
    page = requests.get(server["http"] + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text  # nothing fetched from elsewhere
    browser.open(server["http"] + "/")
    blank = browser.js("return document.getElementById('gamma-chart').toDataURL().length")
    browser.type("#seed", "3")
    browser.click('#gamma option[value="3"]')  # fixed γ: the tiny pair's auto may find speculation not worth it
    browser.type("#max_tokens", "60")
    browser.type("#prompt", "Write a short poem about the sea.")
    browser.click("#send")
    state = wait_for_answer(browser)
    assert not state["error"], state
    assert state["model"] == "tiny"
    assert state["accepted"] > 0 and state["corrections"] + state["bonus"] > 0, state  # coloured by origin
    assert state["tokens"] >= 60  # every emitted token is a span (rejected draft tokens add more)
    assert state["acceptance"].endswith("%") and 0 < int(state["acceptance"][:-1]) <= 100, state
    assert float(state["per_round"]) > 1.0 and float(state["tps"]) > 0 and int(state["rounds"]) > 0, state
    assert state["chart"] != blank  # the γ chart was drawn
    # a second turn goes into the same chat, with the history sent along
    browser.type("#prompt", "And one about the mountains.")
    browser.click("#send")
    second = wait_for_answer(browser)
    assert not second["error"] and second["tokens"] > state["tokens"], second
    assert browser.js("return document.querySelectorAll('#chat .msg').length") == 4
    out = pathlib.Path(os.environ.get("SPECSERVE_ARTIFACTS", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    shot = out / "playground.png"
    browser.screenshot(shot)
    assert shot.stat().st_size > 10_000
    print(f"\nplayground screenshot: {shot}")
