"""The page at ``/`` in headless Chromium, and the KV cache state endpoint, on a real
server (subprocess, tiny random-weight model, a 128-block pool, prefix caching on) that
requires an API key.

The browser is Debian's ``chromium`` (``scripts/test.sh`` installs it when it can) or
playwright's own; with neither, the browser test fails saying so. With
``UPDATE_SCREENSHOT=1`` the mid-run screenshot replaces ``docs/playground.png``.
"""

from __future__ import annotations

import base64
import os
import shutil

import pytest
import requests

from tests.helpers.server import REPO_ROOT, ServerProcess

KEY = "playground-key-7"
AUTH = {"Authorization": f"Bearer {KEY}"}
NUM_BLOCKS = 128
SYSTEM = ("You are a patient assistant who answers questions about the sea, ships and "
          "the weather in plain words. ") * 8
SCREENSHOT = REPO_ROOT / "docs" / "playground.png"


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    args = ["--model", str(tiny_model_factory("llama")), "--dtype", "float32",
            "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-model-len", "1024",
            "--enable-prefix-caching", "--log-level", "warning", "--api-key", KEY,
            "--served-model-name", "tiny-random-llama"]
    with ServerProcess(args) as srv:
        yield srv


def test_page_files_are_open_and_the_state_needs_the_key(server):
    page = requests.get(server.url + "/")
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert '<script src="/static/playground.js">' in page.text
    for name, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
        r = requests.get(f"{server.url}/static/{name}")
        assert r.status_code == 200 and r.headers["Content-Type"].startswith(kind)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = requests.get(server.url + "/v1/kv_cache/state", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert requests.get(server.url + "/static/other.js").status_code in (401, 404)


def test_state_endpoint_shape_and_bad_parameters(server):
    r = requests.get(server.url + "/v1/kv_cache/state", headers=AUTH)
    assert r.status_code == 200
    st = r.json()
    assert st["object"] == "kv_cache.state" and st["num_blocks"] == NUM_BLOCKS
    assert st["block_size"] == 16 and st["prefix_caching"] is True
    assert st["blocks_per_cell"] == 1 and len(base64.b64decode(st["cells"])) == NUM_BLOCKS
    assert st["counters"]["num_used_blocks"] == 0
    summary = requests.get(server.url + "/v1/kv_cache/state?max_cells=10&tables=false",
                           headers=AUTH).json()
    assert summary["blocks_per_cell"] == 13 and len(base64.b64decode(summary["cells"])) == 10
    for query, message in (
            ("max_cells=0", "max_cells must be between 1 and 1048576, got 0"),
            ("max_cells=x", "max_cells must be an integer, got 'x'"),
            ("tables=maybe", "tables must be true or false, got 'maybe'")):
        r = requests.get(f"{server.url}/v1/kv_cache/state?{query}", headers=AUTH)
        err = r.json()["error"]
        assert r.status_code == 400 and err["message"] == message
        assert err["param"] == query.split("=")[0]


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        pytest.fail("the browser test needs playwright (pip install playwright)")
    exe = os.environ.get("PAGEDSERVE_CHROMIUM") or shutil.which("chromium")
    with sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=exe) if exe else p.chromium.launch()
        except Error as e:
            pytest.fail("no Chromium for the browser test: install Debian's chromium "
                        f"(apt-get install -y chromium) or `playwright install chromium` ({e})")
        yield b
        b.close()


def counter(page, name: str) -> int:
    return int(page.inner_text(f"#c-{name}"))


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def test_page_streams_and_shows_the_blocks(server, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 860})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    # The key is asked for once; a wrong one is refused and asked for again.
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", "wrong")
    page.click("#key-submit")
    page.wait_for_function("document.getElementById('key-error').textContent.includes('refused')")
    page.fill("#key-input", KEY)
    page.click("#key-submit")
    page.wait_for_selector("body[data-ready='1']")
    assert page.inner_text("#model-name") == "tiny-random-llama"
    # the map is drawn by the first poll, which starts once the page is ready
    page.wait_for_function(
        f"document.querySelectorAll('#block-map .blk').length === {NUM_BLOCKS}")
    assert page.locator("#block-map .blk").count() == NUM_BLOCKS
    assert counter(page, "used") == 0 and counter(page, "free") == NUM_BLOCKS

    # As long as the context allows (about 185 prompt tokens): on a fast host the tiny
    # model's 400 tokens could all stream between two of the page's 250 ms polls.
    page.fill("#max-tokens", "800")
    page.fill("#system-prompt", SYSTEM)
    send(page, "Tell me about the tides.")
    msg = page.locator(".chat[data-chat='1'] .msg.assistant")
    # While it streams: text already there, more to come, blocks in use, counters moving,
    # one request in the table, running. All seen at one instant (the page's next poll
    # may already show the request finished), and that instant's text kept.
    partial = page.wait_for_function(
        """(numBlocks) => {
                   const m = document.querySelector(".chat[data-chat='1'] .msg.assistant");
                   const rows = document.querySelectorAll('#requests tbody tr');
                   const num = (id) => Number(document.getElementById(id).textContent);
                   const ok = m && !m.dataset.done && m.querySelector('.text').textContent.length > 0
                     && document.querySelectorAll('#block-map .blk.used').length > 0
                     && num('c-running') === 1 && num('c-tps') > 0
                     && num('c-used') > 0 && num('c-free') < numBlocks
                     && rows.length === 1
                     && rows[0].querySelector('.status').textContent === 'running';
                   return ok ? m.querySelector('.text').innerText : false; }""",
        arg=NUM_BLOCKS).json_value()
    page.wait_for_selector(".chat[data-chat='1'] .msg.assistant[data-done='1']", timeout=60_000)
    final = msg.locator(".text").inner_text()
    assert len(final) > len(partial) > 0 and final.startswith(partial)
    assert int(msg.get_attribute("data-pieces")) > 1
    assert "TTFT" in msg.inner_text() and "tokens/s" in msg.inner_text()

    # Two more chats with the same system prompt share its blocks while both run.
    page.fill("#max-tokens", "600")
    page.click("#new-chat")
    send(page, "And the waves?")
    page.click("#new-chat")
    send(page, "What makes the wind blow?")
    page.wait_for_function(
        """() => document.querySelectorAll('#tabs button.busy').length === 2
                 && document.querySelectorAll('#block-map .blk.used.shared').length > 0""")
    page.screenshot(path=str(tmp_path / "playground.png"))
    both_busy = "document.querySelectorAll('#tabs button.busy').length === 2"
    if os.environ.get("UPDATE_SCREENSHOT") == "1":
        if not page.evaluate(both_busy):  # one finished while the picture was taken
            pytest.fail("a chat finished during the screenshot: run again to retake it")
        shutil.copyfile(tmp_path / "playground.png", SCREENSHOT)
    assert (tmp_path / "playground.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shared = page.locator("#block-map .blk.used.shared").first
    shared.hover()
    tip = page.inner_text("#tooltip")
    assert "ref count 2" in tip and "prefix-cached yes" in tip and "fill 16/16 tokens" in tip
    assert len(tip.split("owners ")[1].split("\n")[0].split(", ")) == 2

    # Both finish: nothing in use, the prompts' full blocks kept as cached-free blocks.
    page.wait_for_function("document.querySelectorAll('.msg.assistant[data-done]').length === 3",
                           timeout=60_000)
    page.wait_for_function("document.getElementById('c-used').textContent === '0'")
    assert page.locator("#block-map .blk.used").count() == 0
    assert page.locator("#block-map .blk.cached").count() == counter(page, "cached") > 0
    assert float(page.inner_text("#c-hits").rstrip("%")) > 0

    # Stop ends the stream; the server aborts the request and its blocks return.
    page.click("#new-chat")
    send(page, "One more, please.")
    page.wait_for_function("document.querySelectorAll('#block-map .blk.used').length > 0")
    page.click("#stop")
    stopped = page.locator(".chat[data-chat='4'] .msg.assistant")
    stopped.locator(".stats").wait_for()
    assert stopped.locator(".stats").inner_text().endswith("stopped")
    page.wait_for_function("document.getElementById('c-used').textContent === '0'"
                           " && document.getElementById('c-running').textContent === '0'")
    assert errors == []
    page.close()


def test_readme_uses_the_screenshot():
    assert SCREENSHOT.is_file() and "docs/playground.png" in (REPO_ROOT / "README.md").read_text()


def test_static_files_ship_in_the_package():
    import ast
    import fnmatch

    text = (REPO_ROOT / "pyproject.toml").read_text()
    section = text.split("[tool.setuptools.package-data]\n", 1)[1].split("\n[", 1)[0]
    line = next(ln for ln in section.splitlines() if ln.startswith('"*" = '))
    globs = ast.literal_eval(line.split("=", 1)[1].strip())  # every package's data files
    files = sorted(p.name for p in (REPO_ROOT / "server" / "static").iterdir())
    assert files == ["index.html", "playground.css", "playground.js"]
    assert all(any(fnmatch.fnmatch(f, g) for g in globs) for f in files)
