"""The chat page at / in a real headless browser (Debian's chromium and chromedriver, driven by Selenium)
against the real app on the default model: a message sent through the form streams a reply into the
page, the stop button ends a reply and frees the server's slot, and model text never becomes markup.

Where no browser is installed the browser tests are skipped, except under CI (CI or
BARELLM_REQUIRE_BROWSER set), where that is a failure: `make test` installs them when run as root."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from test_server import serving  # noqa: E402

REQUIRED = bool(os.environ.get("BARELLM_REQUIRE_BROWSER") or os.environ.get("CI"))
SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "webui.png"


def _browser() -> tuple[str, str]:
    """Paths of chromium and chromedriver; skips (or fails under CI) when either is missing."""
    chrome = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    missing = [name for name, path in (("chromium", chrome), ("chromedriver", driver)) if path is None]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip)")
    if missing:
        msg = f"the web page test needs {', '.join(missing)}: apt-get install chromium chromium-driver"
        if REQUIRED:
            pytest.fail(msg + " (CI must not skip this test)")
        pytest.skip(msg)
    assert chrome is not None and driver is not None
    return chrome, driver


@pytest.fixture(scope="module")
def site(smollm_gguf: Path) -> Iterator[tuple[str, Any]]:
    import barellm
    from barellm.serve.app import create_app

    model = barellm.load(smollm_gguf, slots=2, context=1024)
    app = create_app(model, model_id="smollm2-135m")
    with serving(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    chrome, driver_path = _browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(what: str, cond: Callable[[], Any], timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _replies(driver: Any) -> list[Any]:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, ".message.assistant")


def _send(driver: Any, text: str) -> Any:
    from selenium.webdriver.common.by import By

    n = len(_replies(driver))
    driver.find_element(By.ID, "prompt").send_keys(text)
    driver.find_element(By.ID, "send").click()
    return _wait("the reply to appear", lambda: len(_replies(driver)) > n and _replies(driver)[-1])


def test_page_is_served_with_a_strict_policy(site: tuple[str, Any]) -> None:
    url, _ = site
    r = httpx.get(url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert "<script" in r.text and "http" not in r.text.split("<body>")[0].replace("http-equiv", "")
    for name, kind in (("chat.js", "javascript"), ("chat.css", "css")):
        r = httpx.get(f"{url}/static/{name}")
        assert r.status_code == 200 and kind in r.headers["content-type"]
    assert httpx.get(f"{url}/static/index.html").status_code == 404
    assert httpx.get(f"{url}/static/../app.py").status_code == 404


@pytest.mark.model
def test_chat_streams_into_the_page_and_stop_works(site: tuple[str, Any], browser: Any) -> None:
    from selenium.webdriver.common.by import By

    url, app = site
    metrics = app.state.server.metrics
    browser.get(url + "/")
    _wait("the model picker", lambda: browser.find_element(By.ID, "model").get_attribute("value") == "smollm2-135m",
          30)
    temperature = browser.find_element(By.ID, "temperature")
    browser.execute_script("arguments[0].value = '0'; arguments[0].dispatchEvent(new Event('input'))", temperature)
    browser.find_element(By.ID, "max-tokens").send_keys("40")

    reply = _send(browser, "Write a Python function that adds two numbers, in a code block.")
    _wait("the reply to finish", lambda: reply.get_attribute("data-state") != "streaming")
    assert reply.get_attribute("data-state") == "done"
    text = reply.get_attribute("data-text")
    assert text and int(reply.get_attribute("data-chunks")) >= 2, "the reply did not stream in pieces"
    if "```" in text:   # the model's code block is shown as code
        assert reply.find_elements(By.CSS_SELECTOR, "pre code")
    history = browser.execute_script("return window.barellmChat.conversation")
    assert [m["role"] for m in history] == ["user", "assistant"] and history[1]["content"] == text
    # the page sent the settings: greedy with 40 tokens at most, as the server saw it
    assert metrics.generated_tokens <= 40

    # a long reply, stopped while it streams: the page says so, and the server frees the slot
    browser.find_element(By.ID, "max-tokens").clear()
    cancelled = metrics.finished["cancelled"]
    reply = _send(browser, "Write a very long story about a dragon who learns to cook.")
    _wait("a few pieces of the reply", lambda: int(reply.get_attribute("data-chunks")) >= 3)
    stop = browser.find_element(By.ID, "stop")
    assert stop.is_enabled()
    stop.click()
    _wait("the reply to stop", lambda: reply.get_attribute("data-state") == "stopped", 30)
    assert "stopped" in reply.get_attribute("class")
    _wait("the server to cancel the generation", lambda: metrics.finished["cancelled"] == cancelled + 1, 30)
    _wait("the slot to be free", lambda: app.state.server.scheduler.slots_in_use == 0, 30)
    assert not stop.is_enabled() and browser.find_element(By.ID, "send").is_enabled()
    shown = len(reply.get_attribute("data-text"))
    time.sleep(0.5)
    assert len(reply.get_attribute("data-text")) == shown   # nothing more arrives


def test_model_text_never_becomes_markup(site: tuple[str, Any], browser: Any) -> None:
    url, _ = site
    browser.get(url + "/")
    hostile = ("<img src=x onerror=\"window.pwned=1\"> **bold** `a<b>c`\n\n"
               "```html\n<script>window.pwned=1</script>\n<b>not bold</b>\n```\n"
               "<iframe src=\"javascript:window.pwned=1\"></iframe>\n```\nunclosed <i>fence")
    out = browser.execute_script("""
        const box = document.createElement('div');
        box.appendChild(window.barellmChat.render(arguments[0]));
        document.body.appendChild(box);
        return {tags: [...box.querySelectorAll('*')].map(e => e.tagName.toLowerCase()),
                strong: [...box.querySelectorAll('strong')].map(e => e.textContent),
                code: [...box.querySelectorAll('pre code')].map(e => e.textContent),
                inline: [...box.querySelectorAll('p code')].map(e => e.textContent),
                langs: [...box.querySelectorAll('pre .lang')].map(e => e.textContent),
                text: box.textContent};
    """, hostile)
    assert set(out["tags"]) <= {"p", "strong", "code", "pre", "span", "button"}, out["tags"]
    assert out["strong"] == ["bold"] and out["inline"] == ["a<b>c"]
    assert out["code"] == ["<script>window.pwned=1</script>\n<b>not bold</b>", "unclosed <i>fence"]
    assert out["langs"] == ["html"]
    assert "<img src=x" in out["text"] and "<iframe" in out["text"]
    time.sleep(0.2)
    assert browser.execute_script("return window.pwned === undefined")


MARKDOWN = """### Fruit

Some **bold** and *italic* text, a [link](https://example.com/a), a [bad one](javascript:alert(1)) and `code`.

- apples
  - green ones
- pears

1. first
2. second

| fruit | count |
|:------|------:|
| apple | 3 |
| pear | 10 |

> quoted

```python
def f(x):  # doubles
    return x * 2 + "s"
```
"""


def test_markdown_renders_headings_lists_tables_links_and_highlighted_code(site: tuple[str, Any],
                                                                         browser: Any) -> None:
    url, _ = site
    browser.get(url + "/")
    out = browser.execute_script("""
        const box = document.createElement('div');
        box.appendChild(window.barellmChat.render(arguments[0]));
        const all = (q) => [...box.querySelectorAll(q)];
        return {h: all('h3, h4, h5, h6').map(e => e.tagName + ' ' + e.textContent),
                strong: all('p strong').map(e => e.textContent),
                em: all('p em').map(e => e.textContent),
                links: all('a').map(e => [e.textContent, e.getAttribute('href'), e.rel]),
                ul: all(':scope > ul > li').map(e => e.firstChild.textContent),
                nested: all('ul > li > ul > li').map(e => e.textContent),
                ol: all('ol > li').map(e => e.textContent),
                th: all('th').map(e => [e.textContent, e.style.textAlign]),
                td: all('td').map(e => e.textContent), quote: all('blockquote p').map(e => e.textContent),
                code: all('pre code').map(e => e.textContent), kw: all('pre code .tok-kw').map(e => e.textContent),
                str: all('pre code .tok-str').map(e => e.textContent),
                com: all('pre code .tok-com').map(e => e.textContent), copy: all('pre button.copy').length,
                text: box.textContent};
    """, MARKDOWN)
    assert out["h"] == ["H5 Fruit"]   # a reply's ### under the page's own headings
    assert out["strong"] == ["bold"] and out["em"] == ["italic"]
    assert out["links"] == [["link", "https://example.com/a", "noopener noreferrer"]]
    assert "[bad one](javascript:alert(1))" in out["text"]        # not a link: only http(s) and mailto are
    assert out["ul"] == ["apples", "pears"] and out["nested"] == ["green ones"] and out["ol"] == ["first", "second"]
    assert out["th"] == [["fruit", "left"], ["count", "right"]] and out["td"] == ["apple", "3", "pear", "10"]
    assert out["quote"] == ["quoted"]
    assert out["code"] == ['def f(x):  # doubles\n    return x * 2 + "s"']   # highlighting keeps the text
    assert out["kw"] == ["def", "return"] and out["str"] == ['"s"'] and out["com"] == ["# doubles"]
    assert out["copy"] == 1


def _clipboard(browser: Any) -> str:
    return browser.execute_async_script(
        "const done = arguments[0]; navigator.clipboard.readText().then(done, (e) => done('error: ' + e));")


@pytest.mark.model
def test_copy_buttons_copy_a_message_and_a_code_block(site: tuple[str, Any], browser: Any) -> None:
    from selenium.webdriver.common.by import By

    url, _ = site
    browser.get(url + "/")
    browser.execute_cdp_cmd("Browser.grantPermissions", {"origin": url, "permissions": [
        "clipboardReadWrite", "clipboardSanitizedWrite"]})
    temperature = browser.find_element(By.ID, "temperature")
    browser.execute_script("arguments[0].value = '0'; arguments[0].dispatchEvent(new Event('input'))", temperature)
    browser.find_element(By.ID, "max-tokens").send_keys("60")
    reply = _send(browser, "Write a Python function that adds two numbers.")
    _wait("the reply to finish", lambda: reply.get_attribute("data-state") == "done")
    text = reply.get_attribute("data-text")
    reply.find_element(By.CSS_SELECTOR, ".head button.copy").click()
    _wait("the whole reply in the clipboard", lambda: _clipboard(browser) == text, 10)
    assert "```" in text, text   # SmolLM2 answers this with a code block
    block = reply.find_element(By.CSS_SELECTOR, "pre")
    block.find_element(By.CSS_SELECTOR, "button.copy").click()
    code = block.find_element(By.CSS_SELECTOR, "code").text
    _wait("the code in the clipboard", lambda: _clipboard(browser).strip() == code.strip(), 10)
    assert "def " in code and "```" not in _clipboard(browser)
    assert block.find_elements(By.CSS_SELECTOR, "code .tok-kw")   # highlighted


def test_the_page_defaults_are_the_servers(site: tuple[str, Any], browser: Any) -> None:
    from selenium.webdriver.common.by import By

    from barellm.generate.sampling import SamplingParams

    url, _ = site
    browser.get(url + "/")
    d = SamplingParams()
    assert float(browser.find_element(By.ID, "temperature").get_attribute("value")) == d.temperature
    assert browser.find_element(By.ID, "temperature-value").text == str(d.temperature)
    assert float(browser.find_element(By.ID, "top-p").get_attribute("value")) == d.top_p


def test_settings_stay_reachable_on_a_narrow_screen(site: tuple[str, Any], browser: Any) -> None:
    from selenium.webdriver.common.by import By

    url, _ = site
    browser.set_window_size(600, 900)
    try:
        browser.get(url + "/")
        key = browser.find_element(By.ID, "api-key")
        toggle = browser.find_element(By.ID, "settings-toggle")
        assert not key.is_displayed() and toggle.is_displayed()
        toggle.click()
        _wait("the settings to open", key.is_displayed, 10)
        key.send_keys("secret-key-123")
        assert key.get_attribute("value") == "secret-key-123" and toggle.get_attribute("aria-expanded") == "true"
        toggle.click()
        _wait("the settings to close", lambda: not key.is_displayed(), 10)
    finally:
        browser.set_window_size(1200, 800)
    browser.get(url + "/")
    assert browser.find_element(By.ID, "api-key").is_displayed()
    assert not browser.find_element(By.ID, "settings-toggle").is_displayed()


@pytest.fixture(scope="module")
def two_models(smollm_gguf: Path, gemma_gguf: Path) -> Iterator[str]:
    """`barellm serve smollm2-135m gemma3-270m` as the command builds it: both loaded, the cache's others
    on demand."""
    from barellm.__main__ import build_parser, parse_args
    from barellm.serve import build_app

    args = parse_args(build_parser(), ["serve", "smollm2-135m", "gemma3-270m", "--slots", "1", "-c", "1024"])
    with serving(build_app(args)) as url:
        yield url


@pytest.mark.model
def test_the_model_picker_chooses_the_model_that_answers(two_models: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(two_models + "/")
    picker = browser.find_element(By.ID, "model")
    _wait("the models", lambda: picker.get_attribute("data-ready") == "true", 30)
    values = [o.get_attribute("value") for o in Select(picker).options]
    assert values[:2] == ["smollm2-135m", "gemma3-270m"] and len(values) == len(set(values))
    temperature = browser.find_element(By.ID, "temperature")
    browser.execute_script("arguments[0].value = '0'; arguments[0].dispatchEvent(new Event('input'))", temperature)
    browser.find_element(By.ID, "max-tokens").send_keys("80")
    for name in ("gemma3-270m", "smollm2-135m"):
        browser.find_element(By.ID, "new-chat").click()
        Select(picker).select_by_value(name)
        reply = _send(browser, "Write a Python function that adds two numbers.")
        _wait("the reply to finish", lambda: reply.get_attribute("data-state") != "streaming")   # noqa: B023
        assert reply.get_attribute("data-state") == "done"
        assert reply.get_attribute("data-model") == name               # the model the server says answered
        assert reply.find_element(By.CSS_SELECTOR, ".role").text.lower() == f"assistant · {name}"
    if SCREENSHOT.parent.is_dir() and os.environ.get("BARELLM_UPDATE_SCREENSHOT"):
        browser.save_screenshot(str(SCREENSHOT))
