"""`mmcli review`: the store and the server (paths, tokens, malformed records, edits that resume
keeps), and the page in a real headless Chromium (grid, boxes, filters, sorting, an edit)."""

import http.client
import json
import shutil
import threading
import urllib.error
import urllib.request

import pytest
from conftest import caption_cli, photo
from typer.testing import CliRunner

from mmcli.cli.app import app
from mmcli.errors import ConfigError
from mmcli.jobs.records import JsonlOutput
from mmcli.review.server import ReviewServer
from mmcli.review.store import ReviewStore
from mmcli.testing import boxes_record, make_test_video

BOX = [40.0, 30.0, 200.0, 150.0]  # pixels of the 512x512 astronaut


@pytest.fixture(scope="module")
def labeled(tiny_dir, tmp_path_factory):
    """A real caption run over three images and a video (sidecars, logprobs), a detect record
    with one box, and an image outside the folder reached through a symlink."""
    root = tmp_path_factory.mktemp("review") / "imgs"
    root.mkdir()
    photo("astronaut.jpg").save(root / "astronaut.jpg")
    photo("coffee.jpg").save(root / "coffee.jpg")
    photo("chelsea.jpg", (160, 120)).save(root / "chelsea.png")
    make_test_video(root / "clip.mp4")
    outside = root.parent / "outside.jpg"
    photo("rocket.jpg").save(outside)
    (root / "linked.jpg").symlink_to(outside)
    out = root.parent / "labels.jsonl"
    labels = [root, "-o", out, "--logprobs", "--sidecar", ".txt"]
    result = caption_cli(*labels, model=tiny_dir, max_new_tokens=6)
    assert result.exit_code == 0, result.output
    record = boxes_record(root / "astronaut.jpg", [{"label": "helmet", "bbox": BOX}], (512, 512))
    output = JsonlOutput(out).open()
    output.append(record)
    output.close()
    return root, out


@pytest.fixture
def server(labeled):
    root, out = labeled
    snapshot = out.read_bytes()
    srv = ReviewServer(ReviewStore([out]), "127.0.0.1", 0, 1 << 27)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    out.write_bytes(snapshot)  # each test starts from the run's records


def _get(srv, path):
    try:
        with urllib.request.urlopen(srv.url + path.lstrip("/")) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(srv, body, token):
    request = urllib.request.Request(
        srv.url + "api/review",
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Content-Type": "application/json",
            **({"X-Review-Token": token} if token else {}),
        },
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _id(srv, key):
    return srv.store.index[key]


def test_media_come_only_from_inside_the_labeled_folder(server):
    assert _get(server, f"/media/{_id(server, 'coffee.jpg')}")[0] == 200
    assert _get(server, f"/media/{_id(server, 'linked.jpg')}")[0] == 403  # a symlink out of it
    assert _get(server, "/media/9999")[0] == 400
    assert _get(server, "/static/../store.py")[0] == 404
    assert _get(server, "/static/%2e%2e/store.py")[0] == 404
    clip = _id(server, "clip.mp4")
    status, data = _get(server, f"/media/{clip}/frame/1")
    assert status == 200 and data[:2] == b"\xff\xd8"  # a JPEG of the video's second sampled frame


def test_edits_need_the_pages_token(server, labeled):
    _, out = labeled
    before = out.read_bytes()
    edit = {"id": _id(server, "coffee.jpg"), "task": "caption", "action": "edit", "value": "x"}
    assert _post(server, edit, None)[0] == 403
    assert _post(server, edit, "not-the-token")[0] == 403
    assert out.read_bytes() == before


def test_a_missing_image_is_a_missing_image(server, labeled):
    root, _ = labeled
    moved = root / "coffee.jpg"
    data = moved.read_bytes()
    moved.unlink()
    try:
        status, body = _get(server, f"/media/{_id(server, 'coffee.jpg')}")
        assert status == 404 and b"missing or unreadable" in body
    finally:
        moved.write_bytes(data)


def test_two_reviewers_on_one_file_never_tear_a_record(labeled):
    _, out = labeled
    before = out.read_bytes()
    lines = len(before.splitlines())
    reviewers = [ReviewStore([out]), ReviewStore([out])]
    key = reviewers[0].index["coffee.jpg"]

    def edit(store, n):
        for k in range(15):
            store.review(key, "caption", "edit", f"reviewer {n} edit {k}")

    threads = [threading.Thread(target=edit, args=(s, n)) for n, s in enumerate(reviewers)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == lines + 30 and all(r["key"] for r in records)
    finally:
        out.write_bytes(before)


def test_a_malformed_record_file_is_refused_with_its_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "a", "task": "caption"}\nnot json\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2: not a JSON record"):
        ReviewStore([bad])
    result = CliRunner().invoke(app, ["review", str(bad), "--port", "0"])
    assert result.exit_code == 2 and "bad.jsonl:2" in result.output


def test_an_edit_is_appended_rewrites_the_sidecar_and_resume_keeps_it(server, labeled, tiny_dir):
    root, out = labeled
    key = "coffee.jpg"
    status, answer = _post(
        server,
        {"id": _id(server, key), "task": "caption", "action": "edit", "value": "a cup"},
        server.token,
    )
    assert status == 200 and answer["label"]["text"] == "a cup"
    last = json.loads(out.read_text().splitlines()[-1])
    assert last["key"] == key and last["text"] == "a cup" and last["review"]["action"] == "edit"
    assert (root / "coffee.txt").read_text() == "a cup\n"
    approve = {"id": _id(server, "chelsea.png"), "task": "caption", "action": "approve"}
    assert _post(server, approve, server.token)[0] == 200
    args = [root, "-o", out, "--task", "caption"]
    lines = len(out.read_text().splitlines())
    rerun = caption_cli(*args, "--overwrite", model=tiny_dir, max_new_tokens=6)
    redone = [json.loads(line)["key"] for line in out.read_text().splitlines()[lines:]]
    assert rerun.exit_code == 0 and key not in redone and "chelsea.png" not in redone
    assert "astronaut.jpg" in redone  # not reviewed: --overwrite redoes it
    lines = len(out.read_text().splitlines())
    again = caption_cli(*args, "--redo-reviewed", model=tiny_dir, max_new_tokens=6)
    assert again.exit_code == 0, again.output
    redone = [json.loads(line)["key"] for line in out.read_text().splitlines()[lines:]]
    assert sorted(redone) == ["chelsea.png", key]


# The page, in the system's headless Chromium.

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.skip("needs Debian's chromium and chromium-driver (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    yield driver
    driver.quit()


def _cards(driver, expected=None):
    from selenium.webdriver.support.ui import WebDriverWait

    def ready(d):
        cards = d.find_elements("css selector", ".card")
        return (cards,) if expected is None or len(cards) == expected else False

    return WebDriverWait(driver, 10).until(ready)[0]


def test_the_page_shows_the_items_and_draws_boxes_where_recorded(server, browser):
    browser.get(server.url)
    cards = _cards(browser, 5)
    assert sorted(c.get_attribute("data-key") for c in cards) == sorted(server.store.index)
    astronaut = next(c for c in cards if c.get_attribute("data-key") == "astronaut.jpg")
    image = astronaut.find_element("css selector", "img.main")
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 10).until(lambda d: image.get_attribute("naturalWidth") != "0")
    box = astronaut.find_element("css selector", ".box")
    img, rect = image.rect, box.rect
    assert abs((rect["x"] - img["x"]) / img["width"] - BOX[0] / 512) < 0.01
    assert abs((rect["y"] - img["y"]) / img["height"] - BOX[1] / 512) < 0.01
    assert abs(rect["width"] / img["width"] - (BOX[2] - BOX[0]) / 512) < 0.01
    assert "helmet" in box.text
    clip = next(c for c in cards if c.get_attribute("data-key") == "clip.mp4")
    assert len(clip.find_elements("css selector", ".strip img")) >= 2  # the sampled frames


def test_filters_and_sorting_change_what_is_shown(server, browser):
    from selenium.webdriver.support.ui import Select

    browser.get(server.url)
    _cards(browser, 5)
    Select(browser.find_element("id", "task")).select_by_value("detect")
    assert [c.get_attribute("data-key") for c in _cards(browser, 1)] == ["astronaut.jpg"]
    Select(browser.find_element("id", "task")).select_by_value("")
    _cards(browser, 5)
    browser.find_element("id", "q").send_keys("no-such-text")
    _cards(browser, 0)
    assert browser.find_element("id", "counts").text.startswith("0 of 5")
    browser.execute_script(
        "const q = document.getElementById('q'); q.value = '';q.dispatchEvent(new Event('input'));"
    )
    _cards(browser, 5)
    Select(browser.find_element("id", "sort")).select_by_value("confidence")
    store = server.store
    least = min(
        (it for it in store.items if it.confidence() > float("-inf")),
        key=lambda it: it.confidence(),
    )
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # the sorted page replaces the cards: one found before it lands may be gone when it is read
    WebDriverWait(browser, 10, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: d.find_elements("css selector", ".card")[0].get_attribute("data-key") == least.key
    )


def test_an_edit_on_the_page_appends_a_record(server, browser, labeled):
    from selenium.webdriver.support.ui import WebDriverWait

    _, out = labeled
    browser.get(server.url)
    card = next(c for c in _cards(browser, 5) if c.get_attribute("data-key") == "chelsea.png")
    card.click()
    block = WebDriverWait(browser, 10).until(
        lambda d: d.find_element("css selector", '#detail .task-block[data-task="caption"]')
    )
    editor = block.find_element("css selector", "textarea")
    editor.clear()
    editor.send_keys("a cat, corrected")
    block.find_element("css selector", "button.save").click()
    WebDriverWait(browser, 10).until(
        lambda d: d.find_element("tag name", "body").get_attribute("data-saved") == "1"
    )
    last = json.loads(out.read_text().splitlines()[-1])
    assert last["key"] == "chelsea.png" and last["text"] == "a cat, corrected"
    assert last["review"]["by"] == "person"


def test_a_request_for_another_host_gets_neither_the_page_nor_its_token(server):
    """DNS rebinding: a page whose name now points here asks with its own Host; refused before
    the page (and its edit token) or any label is sent. The server's own address is served."""
    port = server.server_address[1]
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1.evil.example:{port}"):
        for method, path in (("GET", "/"), ("GET", "/api/items"), ("POST", "/api/review")):
            conn = http.client.HTTPConnection("127.0.0.1", port)
            conn.request(
                method,
                path,
                body=b"{}" if method == "POST" else None,
                headers={"Host": host, "X-Review-Token": server.token},
            )
            response = conn.getresponse()
            body = response.read()
            conn.close()
            assert response.status == 400 and server.token.encode() not in body, (host, path)
    for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("GET", "/", headers={"Host": host})
        assert conn.getresponse().status == 200
        conn.close()
