"""Helpers of the browser tests: an Airflow api-server process and a headless Debian Chromium driven by Selenium."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def api_server(log: Path, *, timeout: float = 180.0, base_path: str = "") -> Iterator[str]:
    """``airflow api-server`` on a free loopback port with this process's Airflow settings; yields its URL.

    With ``base_path`` (``/airflow``) it serves below that path (``[api] base_url``), and the URL ends with it.
    """
    port = free_port()
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    if base_path:
        env["AIRFLOW__API__BASE_URL"] = f"http://127.0.0.1:{port}{base_path}/"
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "airflow",
                "api-server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its workers die with the group
        )
        url = f"http://127.0.0.1:{port}{base_path}"
        try:
            deadline = time.monotonic() + timeout
            while not _answers(f"{url}/api/v2/version"):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the api-server did not start; see {log}")
                time.sleep(1)
            yield url
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def chromium(width: int = 1400, height: int = 1000):
    """A headless Chromium (the Debian package) under its matching chromedriver, resolving no host but loopback:
    ``127.0.0.1`` (the api-server) and ``127.0.0.2`` (the report tests' listener, ``report_runs.LISTENER_HOST``).

    A request to any other host (a page naming a CDN) then fails at once, logged in the console, the
    same on every machine, instead of waiting on whatever DNS the machine has.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not Path(path).exists()]
    if missing:
        raise RuntimeError(f"{missing} not found: install the Debian packages chromium and chromium-driver")

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE 127.0.0.2",
    ):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def sign_in(browser, url: str) -> None:
    """Log in to the Airflow UI at ``url`` as the local login (the UI keeps the token in a cookie)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tasks.orchestration.local_airflow import LOGIN

    wait = WebDriverWait(browser, 60)
    browser.get(url + "/")
    wait.until(lambda b: b.find_elements(By.NAME, "username"))
    browser.find_element(By.NAME, "username").send_keys(LOGIN[0])
    browser.find_element(By.NAME, "password").send_keys(LOGIN[1])
    browser.find_element(By.XPATH, "//button[normalize-space()='Sign in']").click()
    wait.until(lambda b: "/auth/login" not in b.current_url)


def open_report_tab(browser, wait, url: str, dag_id: str, run_id: str) -> str:
    """Open run ``run_id``'s "Validation report" tab in the Airflow UI at ``url`` and switch into its frame;
    returns the frame's ``src``."""
    from selenium.webdriver.common.by import By

    browser.get(f"{url}/dags/{dag_id}/runs/{run_id}")
    wait.until(lambda b: b.find_elements(By.LINK_TEXT, "Validation report")).pop().click()
    frame = wait.until(lambda b: b.find_elements(By.TAG_NAME, "iframe"))[0]
    source = frame.get_attribute("src")
    browser.switch_to.frame(frame)
    return source
