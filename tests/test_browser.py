"""End to end, as a person opens the suite: JupyterLab serves a notebook, headless Chromium opens it,
Run > Run All Cells runs it, and the page shows what it should without a GPU (recorded mode): the
banner above a recorded cell, an HTML table, a figure, and no error in any output.

Uses Debian's Chromium and its chromedriver (`apt-get install -y chromium chromium-driver`); no browser
is downloaded. Without them the test skips, unless CGLAB_REQUIRE_BROWSER=1 (as .ci/run sets), where
it fails: CI must not pass by skipping it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Runs in seconds in recorded mode and shows all three: recorded cells under a banner, DataFrames, a figure
# (05_speedup_table shows them too, but it is re-measured and re-recorded more often).
NOTEBOOK = "03_static_buffers.ipynb"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver"
# cgutils/recorded.py (banner) shows a recorded cell under an HTML banner that starts "Recorded on <GPU>".
BANNER_TEXT = "Recorded on"

SERVER_START_S = 120
PAGE_LOAD_S = 120
RUN_ALL_S = 600  # the notebook takes seconds here; the margin is for a slow, busy 2-core machine

# JupyterLab user settings for the run: every cell attached to the page (the default windowing can leave
# off-screen cells out of the DOM), and no news/update checks (no network, and no toast over the page).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
}


def _missing_browser() -> str | None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        return f"{' and '.join(missing)} not found: install Debian's Chromium with `{INSTALL}` (as root)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: `make venv` (or `pip install -e '.[dev]'`)"
    return None


def _skip_or_fail(why: str) -> None:
    if os.environ.get("CGLAB_REQUIRE_BROWSER") == "1":
        pytest.fail(f"CGLAB_REQUIRE_BROWSER=1 but {why}", pytrace=False)
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class Lab:
    """A JupyterLab server on a temporary copy of notebooks/, and a Chromium driven by selenium."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.token = secrets.token_hex(24)
        self.server_log = tmp / "jupyter-lab.log"
        self.driver_log = tmp / "chromedriver.log"
        self.server: subprocess.Popen | None = None
        self.driver = None
        self.url = ""

    # --- server --------------------------------------------------------------------------------------

    def start_server(self) -> None:
        root = self.tmp / "notebooks"
        # A copy: JupyterLab autosaves outputs and checkpoints into the notebook folder. The notebooks import
        # cgutils from the editable install, which finds results/ through the package, not the notebook's folder.
        shutil.copytree(REPO / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        jup = self.tmp / "jupyter"
        env = {k: v for k, v in os.environ.items()
               if k not in ("JUPYTER_PATH", "JUPYTER_CONFIG_PATH", "MPLBACKEND", "CGUTILS_RECORD")}
        env.update(
            # the user's Jupyter/IPython settings, kernels and workspaces stay out
            JUPYTER_CONFIG_DIR=str(jup / "config"), JUPYTER_DATA_DIR=str(jup / "data"),
            JUPYTER_RUNTIME_DIR=str(jup / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(jup / "settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(jup / "workspaces"), IPYTHONDIR=str(jup / "ipython"),
            # what CI shows, also on a GPU machine (live, notebook 05 measures for minutes)
            CGUTILS_MODE="recorded",
        )
        for name, settings in LAB_SETTINGS.items():
            path = jup / "settings" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(settings))
        # the interpreter running the tests: .venv's under `make test`, or the one given as PY= on the GPU box
        cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--ServerApp.token={self.token}",
               "--ServerApp.ip=127.0.0.1", f"--port={_free_port()}", f"--ServerApp.root_dir={root}"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        with open(self.server_log, "wb") as log:
            self.server = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
        # The server writes its URL (with the port it really took) to the runtime dir once it listens.
        runtime = jup / "runtime"
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {self.server.returncode}; log {self.server_log}:\n"
                                   + _tail(self.server_log))
            for info in runtime.glob(f"jpserver-{self.server.pid}.json"):
                try:
                    url = json.loads(info.read_text())["url"]
                except (ValueError, KeyError):
                    continue  # still being written
                if self._api_ok(url):
                    self.url = url.rstrip("/") + "/"
                    return
            time.sleep(0.5)
        raise RuntimeError(f"jupyter lab did not answer within {SERVER_START_S} s; log {self.server_log}:\n"
                           + _tail(self.server_log))

    def _api(self, url: str, path: str, method: str = "GET"):
        req = urllib.request.Request(url.rstrip("/") + "/" + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()

    def _api_ok(self, url: str) -> bool:
        try:
            return self._api(url, "api/status")[0] == 200
        except OSError:
            return False

    def stop_server(self) -> None:
        if self.server is None or self.server.poll() is not None:
            return
        try:  # shuts the kernels down with it (they run in sessions of their own)
            self._api(self.url, "api/shutdown", "POST")
            self.server.wait(30)
            return
        except (OSError, subprocess.TimeoutExpired):
            pass
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.server.pid, sig)
                self.server.wait(wait)
                return
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue

    # --- browser -------------------------------------------------------------------------------------

    def start_browser(self) -> None:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        opts.binary_location = str(CHROMIUM)
        for flag in (
            "--headless", "--disable-gpu", "--window-size=1600,1200",
            # as root (CI, containers) Chromium only starts without its sandbox
            "--no-sandbox", "--disable-dev-shm-usage",
            # no connections of its own: on a closed network they are refused and slow the start
            "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--disable-default-apps", "--disable-extensions",
            f"--user-data-dir={self.tmp / 'chromium-profile'}",
        ):
            opts.add_argument(flag)
        # an explicit driver path: selenium does not look for (or download) one
        service = Service(executable_path=str(CHROMEDRIVER), log_output=str(self.driver_log))
        self.driver = webdriver.Chrome(options=opts, service=service)
        self.driver.set_page_load_timeout(PAGE_LOAD_S)
        self.driver.set_script_timeout(30)

    def stop_browser(self) -> None:
        if self.driver is not None:
            try:
                self.driver.quit()
            finally:
                self.driver = None

    # --- page helpers --------------------------------------------------------------------------------

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def fail(self, message: str) -> None:
        """Fail with a screenshot (and the logs) kept in a temporary folder named in the message."""
        keep = Path(tempfile.mkdtemp(prefix="cglab-browser-failure-"))
        shot = keep / "screenshot.png"
        try:
            self.driver.save_screenshot(str(shot))
            where = f"screenshot: {shot}"
        except Exception as e:  # the browser may be the thing that broke
            where = f"no screenshot ({e}); folder {keep}"
        for log in (self.server_log, self.driver_log):
            if log.exists():
                shutil.copy(log, keep / log.name)
        pytest.fail(f"{message}\n{where} (logs beside it)", pytrace=False)

    def wait(self, what: str, timeout: float, check, interval: float = 0.5, show=None):
        """Poll ``check()`` until it returns something truthy; fail (with a screenshot, and ``show()``'s
        description of the page) after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            time.sleep(interval)
        self.fail(f"timed out after {timeout:.0f} s waiting for {what}" + (f"; page: {show()}" if show else ""))


@pytest.fixture
def lab():
    why = _missing_browser()
    if why:
        _skip_or_fail(why)
    tmp = Path(tempfile.mkdtemp(prefix="cglab-browser-"))
    lab = Lab(tmp)
    try:
        lab.start_server()
        lab.start_browser()
        yield lab
    finally:
        try:
            lab.stop_browser()
        finally:
            lab.stop_server()
            shutil.rmtree(tmp, ignore_errors=True)


# State of the notebook on the page: the kernel as the status bar shows it ("Python 3 (ipykernel) | Idle" only
# once the kernel is connected and idle; "No Kernel | Initializing" before, and Run All clicked then asks
# for a kernel), the execution indicator (it says "idle" before the kernel is there), every code cell's
# prompt, and any open dialog.
PAGE_STATE_JS = """
const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
if (!nb) return null;
const ind = document.querySelector('.jp-Notebook-ExecutionIndicator');
const dialog = document.querySelector('.jp-Dialog');
return {
  kernel: Array.from(document.querySelectorAll('.jp-StatusBar-TextItem'))
               .map(e => e.textContent.trim()).find(t => t.includes(' | ')) || null,
  indicator: ind ? ind.getAttribute('data-status') : null,
  prompts: Array.from(nb.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')).map(p => p.textContent.trim()),
  dialog: dialog ? dialog.innerText.trim().replace(/\\s+/g, ' ') : null,
};
"""


def _kernel_idle(state: dict | None) -> bool:
    kernel = (state or {}).get("kernel") or ""
    return kernel.endswith(" | Idle") and not kernel.startswith("No Kernel") and state["indicator"] == "idle"


# What the outputs show once the run is over.
OUTPUTS_JS = """
const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
const outs = Array.from(nb.querySelectorAll('.jp-OutputArea-output'));
const html = outs.filter(o => o.getAttribute('data-mime-type') === 'text/html');
return {
  banners: html.filter(o => o.textContent.includes(arguments[0]) && o.querySelector('div, b'))
               .map(o => o.textContent.trim()),
  tables: outs.filter(o => o.querySelector('table tbody tr')).length,
  figures: outs.flatMap(o => Array.from(o.querySelectorAll('img')))
               .filter(img => img.complete && img.naturalWidth > 0 && img.naturalHeight > 0).length,
  errors: outs.filter(o => (o.getAttribute('data-mime-type') === 'application/vnd.jupyter.stderr'
                            && /Traceback|^\\w*(Error|Exception)\\b/m.test(o.textContent))
                           || /error/i.test(o.className))
              .map(o => o.textContent.trim().slice(0, 1500)),
};
"""


def test_run_all_in_jupyterlab(lab: Lab):
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    started = time.monotonic()
    lab.driver.get(f"{lab.url}lab/tree/{NOTEBOOK}?reset&token={lab.token}")

    def page_state():
        s = lab.js(PAGE_STATE_JS)
        if s and s["dialog"]:
            lab.fail(f"JupyterLab shows a dialog: {s['dialog']!r}")
        return s

    def ready():
        s = page_state()
        return s if s and s["prompts"] and _kernel_idle(s) else None

    state = lab.wait(f"{NOTEBOOK} to open with its kernel connected and idle", PAGE_LOAD_S, ready, show=page_state)
    n_cells = len(state["prompts"])

    # Run > Run All Cells, clicked as a person would.
    def click(selector: str, what: str):
        def find():
            try:
                els = [e for e in lab.driver.find_elements(By.CSS_SELECTOR, selector) if e.is_displayed()]
            except WebDriverException:
                return None
            return els[0] if els else None

        lab.wait(what, 30, find).click()

    run_menu = "//li[contains(@class,'lm-MenuBar-item')][.//div[contains(@class,'lm-MenuBar-itemLabel')][normalize-space()='Run']]"
    lab.wait("the Run menu", 30, lambda: lab.driver.find_elements(By.XPATH, run_menu))[0].click()
    # the Run menu's entry is runmenu:run-all (it runs notebook:run-all-cells on a notebook)
    click('.lm-Menu-item[data-command="runmenu:run-all"], .lm-Menu-item[data-command="notebook:run-all-cells"]',
          "Run All Cells in the Run menu")

    # Over when nothing is queued or running and at least one cell ran (an error stops Run All early).
    def finished():
        s = page_state()
        if not _kernel_idle(s):
            return None
        prompts = s["prompts"]
        if any("*" in p for p in prompts) or not any(re.search(r"\d", p) for p in prompts):
            return None
        return s

    lab.wait("Run All to finish", RUN_ALL_S, finished, interval=1.0, show=page_state)
    time.sleep(1.0)  # let the last outputs (images) finish rendering
    state = lab.wait("Run All to finish", 30, finished, show=page_state)
    run_s = time.monotonic() - started

    out = lab.js(OUTPUTS_JS, BANNER_TEXT)
    problems = []
    not_run = [i + 1 for i, p in enumerate(state["prompts"]) if not re.search(r"\d", p)]
    if not_run:
        problems.append(f"code cells {not_run} of {n_cells} did not run (Run All stops at an error)")
    if out["errors"]:
        problems.append("error output(s):\n" + "\n---\n".join(out["errors"]))
    if not out["banners"]:
        problems.append(f"no recorded-mode banner (an HTML output with {BANNER_TEXT!r}, from cgutils/recorded.py)")
    if not out["tables"]:
        problems.append("no HTML table in any output")
    if not out["figures"]:
        problems.append("no figure (a loaded <img>) in any output")
    if problems:
        lab.fail(f"{NOTEBOOK} after Run All in JupyterLab ({run_s:.0f} s):\n- " + "\n- ".join(problems))
