"""The dashboard in a real headless Chromium against a real 2-host mesh in network namespaces.

Chromium and chromedriver run inside the mesh's client host (``ip netns exec``), like every other
request of the multi-host tests: no packet to a 198.18.x address leaves from this machine's own
namespace. The page must show both nodes and the plan, and its chat box must stream an answer
identical to the API's; a screenshot is kept in ``artifacts/dashboard.png`` (git-ignored).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.cluster import HTTP, Cluster
from harness.netns import netns_mesh
from meshnode.model.build import build_model
from meshnode.weights.profile import profile_model

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("MESHNODE_TEST_ARTIFACTS", Path(__file__).resolve().parent.parent / "artifacts"))
MESSAGES = [{"role": "user", "content": "Where do rivers go?"}]
MAX_TOKENS = 24

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
        reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
    ),
]

# Starts headless Chromium through chromedriver (both children of the script that runs this, so both
# in its namespace), with a throw-away profile.
CHROME = rf"""
profile = tempfile.mkdtemp(prefix="meshnode-chromium-")
opts = webdriver.ChromeOptions()
opts.binary_location = {CHROMIUM!r}
for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", "--window-size=1280,1500", "--user-data-dir=" + profile):
    opts.add_argument(flag)
driver = webdriver.Chrome(service=Service({CHROMEDRIVER!r}), options=opts)
"""

# Runs inside the client namespace: drives Chromium through chromedriver (both its children, so
# both in the namespace) and prints what the page showed as one JSON object.
DRIVER = (
    r"""
import json, shutil, sys, tempfile, time
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

url, shot, prompt, nodes, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
"""
    + CHROME
    + r"""out = {}

def wait(check, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    out["timeout"] = what
    raise SystemExit(json.dumps(out))

def texts(css):
    # Read in one script: the page re-renders every second, and an element found in one call
    # may be gone by the next (StaleElementReferenceException).
    return driver.execute_script(
        "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.innerText.trim())", css)

try:
    driver.set_page_load_timeout(30)
    driver.get(url)
    wait(lambda: {e.get_attribute("data-node") for e in driver.find_elements(By.CSS_SELECTOR, "#nodes tr[data-node]")}
         == set(nodes), 30, "both nodes listed")
    wait(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#plan .stage")) == len(nodes), 30, "plan bars")
    out["rows"] = texts("#nodes tbody tr")
    out["stages"] = driver.execute_script(
        "return Array.from(document.querySelectorAll('#plan .stage')).map(e => ({node: e.dataset.node, "
        "layers: parseInt(e.dataset.layers), width: e.getBoundingClientRect().width, text: e.innerText.trim()}))")
    out["health"] = driver.find_element(By.ID, "health").text
    out["events"] = texts("#events li")
    # Record every text the answer shows, as the page writes it (proof that it streams).
    driver.execute_script('''
        window.__seen = [];
        new MutationObserver((records) => {
          for (const r of records)
            if (r.target.matches && r.target.matches('.turn.assistant .text'))
              for (const n of r.addedNodes) window.__seen.push(n.textContent);
        }).observe(document.getElementById('transcript'), {childList: true, subtree: true, characterData: true});
    ''')
    for field, value in (("chat-max-tokens", max_tokens), ("chat-temperature", "0")):
        box = driver.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    driver.find_element(By.ID, "chat-input").send_keys(prompt)
    driver.find_element(By.ID, "chat-send").click()
    wait(lambda: driver.find_elements(By.CSS_SELECTOR,
                                      '.turn.assistant[data-state="done"], .turn.assistant[data-state="failed"]'),
         90, "the chat answer")
    out["state"] = driver.find_element(By.CSS_SELECTOR, ".turn.assistant").get_attribute("data-state")
    out["answer"] = driver.execute_script("return document.querySelector('.turn.assistant .text').textContent")
    out["chat_status"] = driver.find_element(By.ID, "chat-status").text
    out["seen"] = driver.execute_script("return window.__seen")
    # the live figures come from /v1/mesh, polled every second
    wait(lambda: driver.find_element(By.ID, "tokens").text not in ("", "-", "\u2013", "0"), 10, "tokens figure")
    out["tokens"] = driver.find_element(By.ID, "tokens").text
    out["requests"] = driver.find_element(By.ID, "requests").text
    out["last_tps"] = driver.find_element(By.ID, "last-tps").text
    out["spec_accept"] = driver.find_element(By.ID, "spec-accept").text
    out["spec_cancelled"] = driver.find_element(By.ID, "spec-cancelled").text
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(shot)
    out["screenshot"] = shot
finally:
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)
print(json.dumps(out))
"""
)

SCRAPE = "import sys,urllib.request\nprint(urllib.request.urlopen(sys.argv[1],timeout=10).read().decode())\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(
        tmp_path_factory.mktemp("dash") / "llama",
        "llama",
        num_layers=8,
        hidden_size=128,
        intermediate_size=256,
        dtype="float32",
    )


def metrics_of(cluster, host) -> dict[tuple[str, tuple], float]:
    raw = cluster.client.run([sys.executable, "-c", SCRAPE, f"http://{host.ip}:{HTTP}/metrics"], timeout=30).stdout
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(raw)
        for s in family.samples
    }


def test_dashboard_shows_the_mesh_and_streams_a_chat(model, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("Chromium runs inside a network namespace: needs root")
    total = profile_model(model).total_bytes(256)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    shot.unlink(missing_ok=True)
    with netns_mesh(2, "dash") as mesh:
        cluster = Cluster(mesh, model, tmp_path, max_context=256)
        for h in cluster.hosts:
            # neither holds the model alone: both are stages (pipeline pinned: "auto" may pick a tensor pair);
            # speculation off, so the figures of guesses show their empty state whatever the answer repeats
            cluster.start(h, int(total * 0.6), env={"MESHNODE_STRATEGY": "pipeline", "MESHNODE_SPECULATIVE": "off"})
        views = cluster.wait(lambda: cluster.converged(cluster.hosts, 2, stages=2), 40, "convergence")
        plan = views[0]["plan"]
        assert len(plan["stages"]) == 2
        names = [h.name for h in cluster.hosts]
        expected = cluster.chat(cluster.hosts[0], MESSAGES, MAX_TOKENS)  # the API's answer (greedy)

        page = f"http://{cluster.hosts[0].ip}:{HTTP}/"
        run = cluster.client.run(
            [sys.executable, "-c", DRIVER, page, str(shot), MESSAGES[0]["content"], json.dumps(names), str(MAX_TOKENS)],
            timeout=180,
            check=False,
            cwd=str(Path(__file__).resolve().parent.parent),
        )
        assert run.returncode == 0, f"browser run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{cluster.logs()}"
        page_view = json.loads(run.stdout.strip().splitlines()[-1])

        # both nodes, with their roles; the plan as one bar per node, width in proportion to layers
        assert len(page_view["rows"]) == 2
        coordinator = views[0]["coordinator"]
        for row in page_view["rows"]:
            node = next(n for n in names if row.startswith(n))
            assert "stage" in row and (("coordinator" in row) == (node == coordinator)), row
        layers = {s["nodes"][0]: s["end_layer"] - s["start_layer"] for s in plan["stages"]}
        bars = {b["node"]: b for b in page_view["stages"]}
        assert {n: b["layers"] for n, b in bars.items()} == layers
        ratio = [bars[n]["width"] / layers[n] for n in names]
        assert abs(ratio[0] - ratio[1]) <= 0.05 * max(ratio), page_view["stages"]
        assert page_view["health"] == "serving"
        assert any("join" in e for e in page_view["events"]), page_view["events"]

        # the chat box streamed the same answer the API gives, piece by piece
        assert page_view["state"] == "done", page_view
        assert page_view["answer"] == expected
        partial = [t for t in page_view["seen"] if 0 < len(t) < len(expected)]
        assert partial and all(expected.startswith(t) for t in partial), page_view["seen"]
        assert int(page_view["tokens"]) >= MAX_TOKENS  # this node's counter, as /v1/mesh reports it
        assert page_view["spec_accept"] == "\u2013"  # speculative decoding off: no guesses to show
        assert page_view["spec_cancelled"] == "\u2013"
        assert shot.exists() and shot.stat().st_size > 10_000

        # the head timed every hop to the other stage; both nodes counted the other's join
        head, other = plan["stages"][-1]["nodes"][0], plan["stages"][0]["nodes"][0]
        m = metrics_of(cluster, cluster.host(head))
        assert m[("meshnode_hop_latency_seconds_count", (("peer", other), ("phase", "decode")))] >= MAX_TOKENS - 1
        assert m[("meshnode_hop_latency_seconds_count", (("peer", other), ("phase", "prefill")))] >= 1
        for h in cluster.hosts:
            assert metrics_of(cluster, h)[("meshnode_membership_changes_total", (("kind", "join"),))] >= 1
        print(f"dashboard screenshot: {shot}")


# Loads the page in the client namespace, waits for the unreachable-peer warning, prints it as JSON.
WARNING_DRIVER = (
    r"""
import json, shutil, sys, tempfile, time
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

url, shot = sys.argv[1], sys.argv[2]
"""
    + CHROME
    + r"""
try:
    driver.get(url)
    box = driver.find_element(By.ID, "unreachable")
    deadline = time.time() + 20
    while not box.is_displayed() and time.time() < deadline:
        time.sleep(0.1)
    driver.save_screenshot(shot)
    print(json.dumps({"shown": box.is_displayed(), "text": box.text,
                      "peers": [e.get_attribute("data-node")
                                for e in box.find_elements(By.CSS_SELECTOR, "[data-node]")],
                      "health": driver.find_element(By.ID, "health").text,
                      "health_class": driver.find_element(By.ID, "health").get_attribute("class")}))
finally:
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)
"""
)


def test_dashboard_warns_of_a_peer_announced_but_unreachable(model, tmp_path):
    """A real mDNS announcement of a node whose port nothing listens on: the page says so, with
    the fix, and the health badge turns to a warning (the node itself still serves)."""
    if os.geteuid() != 0:
        pytest.skip("Chromium runs inside a network namespace: needs root")
    from harness.cluster import GRPC, KEY

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "dashboard-unreachable.png"
    shot.unlink(missing_ok=True)
    with netns_mesh(2, "dashwarn") as mesh:
        h0, h1 = mesh.hosts
        cluster = Cluster(mesh, model, tmp_path, max_context=256)
        cluster.start(h0, 8 * 2**30)
        h1.popen(
            [
                sys.executable,
                "-m",
                "meshnode.control.discovery",
                "--node-id",
                "ghost",
                "--cluster-key",
                KEY,
                "--grpc-port",
                str(GRPC),
                "--address",
                h1.ip,
                "--seconds",
                "120",
            ],
            log_path=tmp_path / "ghost.log",
        )
        cluster.wait(
            lambda: (
                [p["node_id"] for p in cluster.mesh_view(h0).get("unreachable", [])] == ["ghost"]
                and cluster.mesh_view(h0)["healthy"]
            ),
            60,
            "h0 to report the ghost unreachable",
        )
        run = cluster.client.run(
            [sys.executable, "-c", WARNING_DRIVER, f"http://{h0.ip}:{HTTP}/", str(shot)],
            timeout=120,
            check=False,
            cwd=str(Path(__file__).resolve().parent.parent),
        )
        assert run.returncode == 0, f"browser run failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
        page = json.loads(run.stdout.strip().splitlines()[-1])
        assert page["shown"] and page["peers"] == ["ghost"], page
        assert f"ghost is announced over mDNS but does not answer at {h1.ip}:{GRPC}" in page["text"]
        assert "Privacy & Security > Local Network" in page["text"] and "firewall" in page["text"]
        assert page["health"] == "serving · peers unreachable" and "warn" in page["health_class"]
        assert shot.exists() and shot.stat().st_size > 10_000
