"""LlamaBoard (``llamafactory-cli webui``) on a loopback port, driven by headless Chromium through Selenium, as a user
drives it: fields found by their English labels, typed into, dropdown options picked from their lists, buttons
clicked by their text. The browser is Debian's ``chromium`` with its ``chromium-driver`` (scripts/setup.sh installs
them); nothing is downloaded (Selenium is given both paths, so its driver manager never runs)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
DRIVER = ("/usr/bin/chromedriver",)


def _first(paths) -> str | None:
    return next((p for p in paths if os.path.exists(p)), None)


def missing() -> str | None:
    """Why the browser test cannot run here (None when it can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (requirements-cpu.txt; scripts/setup.sh installs it)"
    if not _first(CHROMIUM) or not _first(DRIVER):
        return ("no Chromium and chromedriver in /usr/bin (Debian: `apt-get install -y chromium chromium-driver`; "
                "scripts/setup.sh installs them where it may)")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def webui(workdir: Path, timeout: float = 120):
    """``llamafactory-cli webui`` in ``workdir`` (its saves/ and llamaboard_cache/ land there) on a free loopback
    port, analytics off, no GPU, the venv's bin first on PATH (Start runs ``llamafactory-cli train`` found there);
    yields (url, log path). The server and the runs it started end with the block."""
    port = free_port()
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ, GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port),
               GRADIO_ANALYTICS_ENABLED="False", CUDA_VISIBLE_DEVICES="", BROWSER="true", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    for key in ("LLAMABOARD_ENABLED", "LLAMABOARD_WORKDIR", "FORCE_TORCHRUN", "NPROC_PER_NODE"):
        env.pop(key, None)
    log = Path(workdir) / "webui.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([os.path.join(bindir, "llamafactory-cli"), "webui"], cwd=str(workdir), env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        end = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"LlamaBoard did not start:\n{log.read_text()[-3000:]}") from None
                time.sleep(0.5)
        yield url, log
    finally:
        try:
            os.killpg(proc.pid, 15)  # the server and the training process it started (same session)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


@contextmanager
def chromium(width: int = 1400, height: int = 1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _first(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--lang=en-US"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(_first(DRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()


#: Scroll the window so that the text ``arguments[1]`` inside ``arguments[0]`` is in the upper middle of the view.
SCROLL_TO_TEXT = """
const walker = document.createTreeWalker(arguments[0], NodeFilter.SHOW_TEXT);
while (walker.nextNode()) {
  const node = walker.currentNode, at = node.data.indexOf(arguments[1]);
  if (at >= 0) {
    const range = document.createRange(); range.setStart(node, at); range.setEnd(node, at + arguments[1].length);
    window.scrollBy(0, range.getBoundingClientRect().top - window.innerHeight * 0.4); return true;
  }
}
return false;
"""


class Page:
    """The LlamaBoard page in ``driver``: its visible fields by their English labels."""

    def __init__(self, driver, url: str, timeout: float = 60):
        from selenium.webdriver.common.by import By

        self.d, self.By = driver, By
        driver.get(url)
        self.wait_for(lambda: self._visible(self._field_xpath("Model path")), timeout, "the page's fields")

    # ------------------------------------------------------------------ finding
    def _visible(self, xpath: str):
        return next((e for e in self.d.find_elements(self.By.XPATH, xpath) if e.is_displayed()), None)

    @staticmethod
    def _field_xpath(label: str) -> str:
        return (f"//span[@data-testid='block-info'][normalize-space()='{label}']"
                "/ancestor::*[self::label or contains(@class,'block')][1]//*[self::textarea or self::input]")

    def wait_for(self, check, timeout: float, what: str):
        end = time.monotonic() + timeout
        while True:
            found = check()
            if found:
                return found
            if time.monotonic() > end:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            time.sleep(0.3)

    def field(self, label: str):
        return self.wait_for(lambda: self._visible(self._field_xpath(label)), 20, f"the field {label!r}")

    # ------------------------------------------------------------------ acting
    def type(self, label: str, text: str) -> None:
        """Replace a textbox's text with ``text``, as typed (gradio reads it on blur)."""
        from selenium.webdriver.common.keys import Keys

        box = self.field(label)
        box.click()
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.DELETE)
        box.send_keys(text)
        box.send_keys(Keys.TAB)

    def choose(self, label: str, option: str) -> None:
        """Pick ``option`` from a dropdown's list (filtered by typing it), as a user clicks it."""
        from selenium.webdriver.common.keys import Keys

        box = self.field(label)
        self.d.execute_script("arguments[0].scrollIntoView({block: 'center'});", box)  # clear of the toasts on top
        box.click()
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(option)
        item = self.wait_for(lambda: self._visible(f"//ul[@role='listbox']/li[@aria-label='{option}']"), 20,
                             f"option {option!r} of {label!r}")
        item.click()
        self.d.find_element(self.By.TAG_NAME, "body").click()

    def click(self, text: str) -> None:
        """Click the visible button (or accordion header) whose text is ``text``."""
        button = self.wait_for(lambda: self._visible(
            f"//button[normalize-space()='{text}' or ./span[normalize-space()='{text}']]"), 20, f"button {text!r}")
        button.click()

    def output(self) -> str:
        """The text of the output box of the visible tab (the markdown under its Start button)."""
        start = self._visible("//button[normalize-space()='Start']")
        box = start.find_elements(self.By.XPATH, "following::div[@data-testid='markdown'][1]") if start else []
        return box[0].text if box else ""

    def run_until_done(self, timeout: float, shot: Path | None = None, shot_when: str = "") -> str:
        """Click Start and read the output box until the run ends ("Finished." or "Failed." on top); ``shot``: a
        screenshot of the box the first time it shows ``shot_when`` while the run goes."""
        before = self.output()  # the last run's end, until the page starts showing this one
        self.click("Start")
        self.wait_for(lambda: self.output() != before, 60, "the run to start")

        def ended():
            nonlocal shot
            text = self.output()
            if shot is not None and shot_when and shot_when in text and not text.startswith(("Finished.", "Failed.")):
                box = self._visible("//button[normalize-space()='Start']/following::div[@data-testid='markdown'][1]")
                self.d.execute_script(SCROLL_TO_TEXT, box, shot_when)
                self.d.save_screenshot(str(shot))
                shot = None
            return text.startswith(("Finished.", "Failed.")) and text

        return self.wait_for(ended, timeout, "the run to end")
