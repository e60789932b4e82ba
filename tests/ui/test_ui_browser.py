"""The web view in a real browser (Debian's chromium, headless, through Playwright): the runs list, a comparison of
two runs, a timeline, the live update of a run in progress, and the refusal of a request without the token."""

import pytest

pytest.importorskip("playwright")
pytest.importorskip("uvicorn")

import toy  # noqa: E402
from exogym import Trainer  # noqa: E402
from exogym.cluster.network import Network  # noqa: E402
from exogym.runs.loggers import CSVLogger  # noqa: E402
from exogym.strategy import AsyncDiLoCoStrategy, DiLoCoStrategy, OptimSpec  # noqa: E402
from exogym.ui.browser import chromium_path, headless_page, served  # noqa: E402
from test_ui_server import make_run  # noqa: E402

pytestmark = [pytest.mark.spawns,
              pytest.mark.skipif(chromium_path() is None, reason="no chromium: apt-get install -y chromium")]


# the tip of the first link lane's first busy span, as hovering it shows
HOVER_LINK = """(() => {
    const tl = state.timeline, g = tl._geometry(), li = tl.lanes.findIndex((l) => l.kind === "link");
    const lane = tl.lanes[li], b = lane.kinds.indexOf("b"), at = (lane.t[b] + lane.t[b + 1]) / 2;
    return tl.describe(tl.labelW + (at - tl.v0) * g.scale, g.axisH + li * g.laneH + 2);
})()"""


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "runs"
    make_run(root, "diloco-h5", steps=6)
    make_run(root, "diloco-h10", steps=4, strategy="FedAvgStrategy")
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(), toy.make_classification(64, seed=1))
    trainer.fit(AsyncDiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=4), 3, max_steps=12, batch_size=8,
                val_size=16, val_interval=6, network=Network(bandwidth="100Mbps", latency="10ms"),
                node_speeds=[1.0, 0.5, 0.25], logger=CSVLogger(root, "async"), progress=False, device="cpu")
    (root / "sweep-h").mkdir()
    (root / "sweep-h" / "sweep.json").write_text("{}")
    (root / "sweep-h" / "results.csv").write_text("H,status,objective,payload_bytes_per_node\n5,completed,0.5,100\n"
                                                  "10,completed,0.6,50\n")
    return root


def test_runs_compare_timeline_live_and_token(root):
    with served(root) as (base, token), headless_page() as page:
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        # the runs list
        page.goto(f"{base}/?token={token}#runs")
        page.wait_for_function("document.body.dataset.runsLoaded === '3'")
        assert page.locator("#runs-table tbody tr").count() == 3
        page.fill("#filter", "fedavg")
        assert page.locator("#runs-table tbody tr").count() == 1
        page.fill("#filter", "")
        page.click("#runs-table th[data-key=steps]")  # ascending steps: 4, 6, 12
        assert page.locator("#runs-table tbody tr").first.get_attribute("data-run") == "diloco-h10"

        # two runs compared on one chart, their settings' differences in a table
        page.goto(f"{base}/?token={token}#compare?run=diloco-h5&run=diloco-h10")
        page.wait_for_function("document.body.dataset.comparePoints === '10'")
        assert page.locator("#compare-chart .scatterlayer .trace").count() == 2
        assert "FedAvgStrategy" in page.inner_text("#config-diff")

        # the timeline: a lane per node, the server and each shared link busy in its own way (server down, server
        # up); hovering a node's lane names its span, hovering a link's busy span says how many flows shared it
        page.goto(f"{base}/?token={token}#timeline?run=async")
        page.wait_for_function("document.body.dataset.timelineDrawnAt || document.body.dataset.timelineError")
        assert page.evaluate("document.body.dataset.timelineLanes") == "6"
        assert page.evaluate("state.timeline.describe(200, 22 + 5)").startswith("node 0: ")
        link = page.evaluate(HOVER_LINK)
        assert link.startswith("server down: busy, at most ") and "flow(s) at once" in link
        # a synchronous run: its all-reduce keeps the six ports busy alike, one lane for them all, named in its tip
        Trainer(toy.TinyMLP(), toy.make_classification()).fit(
            DiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=4), 3, max_steps=8, batch_size=8,
            network=Network(bandwidth="100Mbps", latency="10ms"), node_speeds=[1.0, 0.5, 0.25],
            logger=CSVLogger(root, "sync"), progress=False, device="cpu")
        page.goto(f"{base}/?token={token}#timeline?run=sync")  # (the same page: only its hash changes)
        page.wait_for_function("document.body.dataset.timelineLanes === '4'")  # three nodes, one link lane
        ports = page.evaluate(HOVER_LINK)
        assert ports.startswith("port 0 down +5: busy, at most 1 flow(s) at once")
        assert ports.endswith("6 links alike: port 0 down, port 0 up, port 1 down, port 1 up, ...")
        page.goto(f"{base}/?token={token}#timeline?run=async")
        page.wait_for_function("document.body.dataset.timelineLanes === '6'")
        box = page.locator("#timeline-canvas").bounding_box()
        page.mouse.move(box["x"] + 200, box["y"] + 22 + 5)
        assert page.inner_text("#timeline-tip").startswith("node 0: ")
        page.mouse.wheel(0, -500)  # zoom in around the pointer
        assert page.evaluate("state.timeline.v1 - state.timeline.v0") < page.evaluate("state.timeline.data.end_s")

        # a run in progress: its curve grows as rows are written, without reloading the page
        live = make_run(root, "live", status="running", steps=2)
        page.goto(f"{base}/?token={token}#compare?run=live")
        page.wait_for_function("document.body.dataset.comparePoints === '2'")
        with open(live / "train.csv", "a") as f:
            f.write("3,0.3,24,300,1.5\n4,0.25,32,400,2.0\n")
        page.wait_for_function("document.body.dataset.comparePoints === '4'", timeout=15000)
        assert errors == []

        # a sweep: its table, its frontier and the command for Optuna's dashboard
        page.goto(f"{base}/?token={token}#sweeps?sweep=sweep-h")
        page.wait_for_selector("#sweep-frontier .scatterlayer")
        assert page.locator("#sweep-detail table tr").count() == 3
        assert "exogym sweep dashboard runs/sweep-h" in page.inner_text("#sweep-detail")
        assert errors == []

        # without the token: refused
        response = page.goto(f"{base}/#runs")
        assert response.status == 403 and "token" in page.inner_text("body")
        assert page.goto(f"{base}/api/runs?token=wrong-{token}").status == 403
