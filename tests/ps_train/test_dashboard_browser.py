"""TensorBoard in a real browser on a finished run: the servers' scalars, the custom-scalars
page and the HParams table with the declared columns. Runs where Playwright is installed
(``pip install playwright``) with its own Chromium (``playwright install chromium``) or the
system's (``apt-get install chromium``); skips, saying so, elsewhere."""

import shutil
import socket
import subprocess
import sys

import pytest

from ps_train.observe.dashboard import SWEPT
from tests.ps_train._app import run_app


def _browser_or_skip():
    try:
        from playwright.sync_api import sync_playwright  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        pytest.skip("Playwright is not installed (pip install playwright; its Chromium or a system one)")
    if shutil.which("tensorboard") is None:
        pytest.skip("the tensorboard command is not on PATH")
    return sync_playwright


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(p):
    """Playwright's own Chromium, else the system's; skips when neither starts."""
    try:
        return p.chromium.launch()
    except Exception as e:  # noqa: BLE001 - any launch failure means no usable bundled Chromium
        bundled = e
    system = next((path for name in SYSTEM_CHROMIUM if (path := shutil.which(name))), None)
    if system is None:
        pytest.skip(f"Playwright's Chromium does not start here ({bundled}) and no system Chromium is on PATH")
    try:
        return p.chromium.launch(executable_path=system)
    except Exception as e:  # noqa: BLE001 - as above
        pytest.skip(f"neither Playwright's Chromium ({bundled}) nor {system} ({e}) starts here")


SYSTEM_CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


@pytest.mark.timeout(300)
def test_tensorboard_shows_server_scalars_custom_scalars_and_hparams(tmp_path):
    sync_playwright = _browser_or_skip()
    with sync_playwright() as p:
        browser = _launch(p)
        run_app(tmp_path / "runs" / "run", "mode=async", "train.steps=8", "logging.server_every=0.2", timeout=180)
        port = _free_port()
        tb = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path / "runs"), "--port", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            for line in tb.stderr:  # it names its address once it serves
                if f":{port}" in line:
                    break
            else:
                pytest.fail("TensorBoard exited before it served the run")
            page = browser.new_page()
            page.goto(f"{url}/#timeseries")
            # Time Series draws only the cards in view (the rpc group comes first): filter.
            page.get_by_role("combobox", name="Filter tags (regex)").fill("server/")
            for tag in ("server/updates_per_s", "server/requests_in_flight", "server/peak_rss_mb"):
                page.get_by_text(tag).first.wait_for(timeout=60_000)
            page.goto(f"{url}/#custom_scalars")
            page.get_by_text("updates applied/s per server").first.wait_for(timeout=60_000)
            page.goto(f"{url}/#hparams")
            for column in ("mode.name", "optim.lr", "cluster.num_servers"):
                assert column in SWEPT
                page.get_by_text(column).first.wait_for(timeout=60_000)
            assert page.get_by_text("checkpoint.every").count() == 0
        finally:
            tb.terminate()
            tb.wait(10)
            browser.close()
