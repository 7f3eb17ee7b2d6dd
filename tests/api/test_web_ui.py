"""Headless Chromium, driven through chromedriver (Selenium), opens the web UI, types a message with
thinking switched on, and must show the streamed answer and a collapsible thinking block. Waits
are real-time polls of the live page (not a virtual-time budget, which let a slow CI machine dump
the page before the stream arrived). The screenshot is kept in $GEMMA4_ARTIFACTS (CI artifact)
or the test's temporary folder."""
import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver")
pytestmark = pytest.mark.skipif(not CHROMIUM or not CHROMEDRIVER,
                                reason="chromium and chromedriver (Debian chromium-driver) are needed")

from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture
def browser(tmp_path):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1100,700", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium then never tries to fetch a driver from the network.
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def test_page_is_served(server):
    status, page = server.get("/")
    assert status == 200
    assert "<title>gemma4</title>" in page and "/v1/chat/completions" in page
    assert "<script src" not in page and "<link" not in page  # self-contained: no CDN


def answer_finished(driver):
    messages = driver.find_element(By.ID, "messages").get_attribute("textContent")
    streaming = driver.find_elements(By.CSS_SELECTOR, "#messages .cursor")
    return "The answer is 42." in messages and not streaming


def test_ui_streams_answer_with_thinking(server, browser, tmp_path):
    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda d: "connecting" not in d.find_element(By.ID, "model-name").text)
    # The scripted engine reports itself as synthetic (/v1/models), so the page must warn.
    assert browser.find_element(By.ID, "synthetic").is_displayed()
    browser.find_element(By.ID, "thinking").click()
    browser.find_element(By.ID, "input").send_keys("Please think about it")
    browser.find_element(By.ID, "send").click()
    try:
        WebDriverWait(browser, 60, poll_frequency=0.2).until(answer_finished)
    except TimeoutException:
        console = "\n".join(entry["message"] for entry in browser.get_log("browser"))
        pytest.fail("no finished answer after 60 s; page text:\n"
                    f"{browser.find_element(By.TAG_NAME, 'body').get_attribute('textContent')}\n"
                    f"browser console:\n{console}")
    thinking = browser.find_elements(By.CSS_SELECTOR, "#messages details.thinking")
    assert thinking, "no collapsible thinking block"
    assert "Let me think." in thinking[0].get_attribute("textContent")
    was_open = thinking[0].get_attribute("open") is not None
    thinking[0].find_element(By.TAG_NAME, "summary").click()  # collapsible: a click toggles it
    assert (thinking[0].get_attribute("open") is not None) != was_open

    artifacts = Path(os.environ.get("GEMMA4_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    screenshot = artifacts / "web-ui.png"
    assert browser.save_screenshot(str(screenshot))
    assert screenshot.stat().st_size > 10000
