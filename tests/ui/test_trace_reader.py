"""The Chrome trace file read by a real reader of the format: speedscope (its release build, from npm), in headless
chromium, imports it as one profile per node and per shared link, with each node's span named by its kind and step.

Perfetto's trace processor would be the first choice, but its Python package downloads its binary at run time,
which this machine cannot. The test runs where speedscope is installed: `npm install --prefix DIR speedscope@1.25.0`,
then `EXOGYM_SPEEDSCOPE=DIR/node_modules/speedscope`; elsewhere it skips, saying so.
"""

import functools
import http.server
import json
import os
import shutil
import threading
from pathlib import Path

import pytest

import toy
from exogym import Trainer
from exogym.strategy import AsyncDiLoCoStrategy, OptimSpec

SPEEDSCOPE = Path(os.environ.get("EXOGYM_SPEEDSCOPE", "node_modules/speedscope")) / "dist" / "release"

pytestmark = [pytest.mark.spawns,
              pytest.mark.skipif(not (SPEEDSCOPE / "index.html").is_file(),
                                 reason="speedscope is not installed: npm install --prefix DIR speedscope@1.25.0 and "
                                        "set EXOGYM_SPEEDSCOPE=DIR/node_modules/speedscope")]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no line per file served
        pass


def test_speedscope_reads_every_node_of_the_trace(tmp_path):
    pytest.importorskip("playwright")
    from exogym.ui.browser import chromium_path, headless_page
    if chromium_path() is None:
        pytest.skip("no chromium: apt-get install -y chromium")
    trainer = Trainer(toy.TinyMLP(), toy.make_classification())
    trainer.fit(AsyncDiLoCoStrategy(OptimSpec.from_string("sgd", lr=0.1), H=4), 3, max_steps=12, batch_size=8,
                network="low", node_speeds=[1.0, 0.5, 0.25], logger=False, progress=False, device="cpu")
    site = tmp_path / "speedscope"
    shutil.copytree(SPEEDSCOPE, site)
    trainer.record.export_trace(site / "trace.json")
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with headless_page() as page:
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/index.html#profileURL=trace.json")
            page.wait_for_function("document.title.startsWith('trace.json')", timeout=30_000)
            with open(site / "trace.json") as f:  # a profile per thread with spans: the nodes and the links
                events = json.load(f)["traceEvents"]
            profiles = len({e["tid"] for e in events if e["ph"] == "X"})
            assert profiles == 3 + sum(lane["kind"] == "link" for lane in trainer.record.timeline["lanes"])
            page.wait_for_function(f"document.body.innerText.includes('node 0 (tid 0) (1/{profiles})')",
                                   timeout=30_000)
            lane, kinds = trainer.record.timeline["lanes"][0], trainer.record.timeline["kinds"]
            labels = sorted({f'{kinds[k]} {{"step":{s}}}' for k, s in zip(lane["kinds"], lane["steps"])})
            page.click("text=Sandwich")  # its table lists every frame (span) of the profile by name
            page.wait_for_function("labels => labels.every(l => document.body.innerText.includes(l))", arg=labels,
                                   timeout=30_000)
            assert errors == []
    finally:
        server.shutdown()
