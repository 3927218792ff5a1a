"""The search-tree page in a real browser (headless Chromium): opened before a search starts, it picks
the search up, draws its nodes and scores while it runs, and ends with the selected line; it keeps the
tree fitted to the window as it grows, so that the root and every selected node are in view without
scrolling, on a desktop window and on a phone's, until the user zooms (and the Fit button fits again).

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package (the `dev` extra)."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest

from tests.server.live import live_server
from tests.server.test_ui_e2e import AUTH, KEY, long_search

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
    pytest.skip(f"headless Chromium is not installed ({CHROMIUM}, {CHROMEDRIVER}): "
                "apt-get install -y chromium chromium-driver", allow_module_level=True)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

SELECTED_FILL = "rgb(0, 158, 115)"  # --selected in the page's style
PATHS = 16
DESKTOP, PHONE = (1400, 900), (390, 844)


@pytest.fixture(scope="module")
def server(tiny_llama):
    # 4 sequences at a time: the live search lasts long enough for the page to see it run on a fast CPU
    env = {"PONDER_SERVER__API_KEY": KEY, "PONDER_CACHE__BLOCK_SIZE": "4", "PONDER_SCHEDULER__MAX_NUM_SEQS": "4"}
    with live_server("--model", str(tiny_llama), "--device", "cpu", env=env) as (base, _):
        yield base


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=%d,%d" % DESKTOP):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        # The key on every request of the page, its fetches and its event stream included.
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": AUTH})
        viewport(driver, DESKTOP)  # the window's inner size, whatever the browser's own bars take
        yield driver
    finally:
        driver.quit()


def nodes(driver) -> list[dict]:
    return driver.execute_script("""
        return [...document.querySelectorAll('#tree g.node')].map(g => ({
            id: +g.dataset.id, step: +g.dataset.step, status: g.dataset.status,
            score: g.querySelector('text.score').textContent, title: g.querySelector('title').textContent,
            fill: getComputedStyle(g.querySelector('circle')).fill}));""")


def viewport(driver, size: tuple[int, int], mobile: bool = False) -> None:
    width, height = size
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 3 if mobile else 1, "mobile": mobile})


def not_in_view(driver) -> dict:
    """The root and the selected nodes that are not wholly inside both the window and the tree's box, whose
    centre another element covers, and how far the page scrolls."""
    return driver.execute_script("""
        const W = innerWidth, H = innerHeight, box = document.getElementById('tree').getBoundingClientRect();
        const out = [], covered = [];
        for (const g of document.querySelectorAll('#tree g.node')) {
            if (g.dataset.status !== 'selected' && g.dataset.step !== '0') continue;
            const r = g.querySelector('circle').getBoundingClientRect();
            if (r.left < Math.max(0, box.left) || r.right > Math.min(W, box.right) || r.top < Math.max(0, box.top)
                || r.bottom > Math.min(H, box.bottom)) out.push(+g.dataset.id);
            const hit = document.elementFromPoint((r.left + r.right) / 2, (r.top + r.bottom) / 2);
            const node = hit && hit.closest('g.node');
            if (!node || (node.dataset.status !== 'selected' && node.dataset.step !== '0')) covered.push(+g.dataset.id);
        }
        const page = document.scrollingElement;
        return {outside: out, covered: covered, scroll: [page.scrollWidth - W, page.scrollHeight - H],
                window: [W, H], tree: [box.width, box.height],
                list_bottom: document.querySelector('aside').getBoundingClientRect().bottom,
                fitted: document.getElementById('tree').dataset.fitted};""")


def in_view(view: dict) -> bool:
    return view["outside"] == [] and view["covered"] == [] and view["scroll"] == [0, 0]


def test_the_page_draws_a_running_search_live_and_its_answer(server, browser):
    browser.get(server + "/ui")
    WebDriverWait(browser, 20).until(lambda d: d.find_element(By.ID, "no-searches").is_displayed())
    result = {}
    # Long enough that the page (which looks for new searches every 2 s) sees it run: 100 steps of 16 paths.
    body = {**long_search(server, n=PATHS, max_steps=100, max_step_tokens=4), "max_tokens": 400}
    worker = threading.Thread(target=lambda: result.update(
        response=httpx.post(server + "/v1/chat/completions", headers=AUTH, json=body, timeout=300)))
    worker.start()
    try:
        # Nodes with scores appear while the search still runs.
        WebDriverWait(browser, 60, poll_frequency=0.1).until(
            lambda d: sum(1 for n in nodes(d) if n["score"]) >= 8)
        seen_running = nodes(browser)
        state = httpx.get(server + "/ui/searches", headers=AUTH).json()["data"][0]["state"]
        listed = browser.find_element(By.CSS_SELECTOR, "#searches li.current")
        assert state == "running" and "result" not in result
        assert listed.get_attribute("data-state") == "running"
        assert {n["status"] for n in seen_running} >= {"running", "kept"} and seen_running[0]["step"] == 0
        assert seen_running[0]["title"] == "prompt: w1 w2 w3"
        # Fitted while it grows: the root is in view.
        assert in_view(not_in_view(browser)), not_in_view(browser)
    finally:
        worker.join(300)
    choice = result["response"].json()["choices"][0]
    steps = result["response"].json()["search"]["steps"]
    WebDriverWait(browser, 30, poll_frequency=0.2).until(
        lambda d: sum(1 for n in nodes(d) if n["status"] == "selected") == steps + 1)
    final = nodes(browser)
    assert len(final) == 1 + (PATHS + 1) * steps and len(final) > len(seen_running)  # the greedy anchor's line too
    selected = sorted((n for n in final if n["status"] == "selected"), key=lambda n: n["step"])
    assert [n["score"] for n in selected[1:]] == [f"{s:.2f}" for s in choice["search"]["step_scores"]]
    assert all(n["fill"] == SELECTED_FILL for n in selected)
    assert {n["status"] for n in final} == {"selected", "kept", "pruned", "finished"}
    assert selected[1]["title"].startswith("step 1 (selected, score ")
    browser.find_element(By.CSS_SELECTOR, f"#tree g.node[data-id='{selected[-1]['id']}'] circle").click()
    assert browser.find_element(By.ID, "detail").text.startswith(f"step {steps}, selected, score ")
    time.sleep(0.1)


def test_the_tree_opens_fitted_at_a_desktop_and_a_phone_size_and_a_zoom_keeps_the_users_view(server, browser):
    body = {**long_search(server, n=PATHS, max_steps=12, max_step_tokens=4), "max_tokens": 48}
    response = httpx.post(server + "/v1/chat/completions", headers=AUTH, json=body, timeout=300).json()
    steps = response["search"]["steps"]
    assert steps == 12
    browser.get(server + "/ui")
    WebDriverWait(browser, 30, poll_frequency=0.2).until(
        lambda d: sum(1 for n in nodes(d) if n["status"] == "selected") == steps + 1)
    desktop = not_in_view(browser)
    assert in_view(desktop) and desktop["window"] == list(DESKTOP) and desktop["fitted"] == "true", desktop

    viewport(browser, PHONE, mobile=True)
    WebDriverWait(browser, 10, poll_frequency=0.1).until(lambda d: not_in_view(d)["window"] == list(PHONE))
    time.sleep(0.2)  # the page refits on the resize's next frame
    phone = not_in_view(browser)
    assert in_view(phone), phone
    # The list folds into one line above the tree, which keeps most of the window.
    assert phone["list_bottom"] <= 60 and phone["tree"][1] >= 0.5 * PHONE[1], phone
    toggle = browser.find_element(By.ID, "toggle")
    assert toggle.is_displayed() and not browser.find_element(By.ID, "searches").is_displayed()
    toggle.click()
    assert browser.find_element(By.ID, "searches").is_displayed()
    browser.find_element(By.CSS_SELECTOR, "#searches li").click()  # picking a search folds the list again
    WebDriverWait(browser, 5).until(lambda d: not d.find_element(By.ID, "searches").is_displayed())

    # A zoom is the user's: the page stops fitting; Fit takes the view back.
    scale = [float(v) for v in browser.find_element(By.ID, "tree").get_attribute("data-scale").split()]
    browser.execute_script("""
        const box = document.getElementById('tree'), r = box.getBoundingClientRect();
        box.dispatchEvent(new WheelEvent('wheel', {deltaY: -800, clientX: r.left + 40, clientY: r.top + r.height / 2,
                                                   bubbles: true, cancelable: true}));""")
    WebDriverWait(browser, 5, poll_frequency=0.1).until(lambda d: not_in_view(d)["fitted"] == "false")
    zoomed = [float(v) for v in browser.find_element(By.ID, "tree").get_attribute("data-scale").split()]
    assert zoomed[0] / scale[0] == pytest.approx(zoomed[1] / scale[1], rel=1e-3) and zoomed[1] > 2 * scale[1]
    assert not in_view(not_in_view(browser))
    browser.find_element(By.ID, "fit").click()
    WebDriverWait(browser, 5, poll_frequency=0.1).until(lambda d: in_view(not_in_view(d)))
    assert not_in_view(browser)["fitted"] == "true"
