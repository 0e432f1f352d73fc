"""The report pages in a real headless Chromium: `python -m olmo_jax.report` writes a run
page (pipe=1) and a plan page (pipe=2, 1F1B, the planner's compiled step on 4 fake
devices); each loads without console errors or network requests, every section draws
what its data says (device boxes, token cells and receive slots, schedule cells, curve
points, heatmap cells, memory and collective bars), hovering shows the documented
details, and a full-page screenshot is saved (under the test's tmp dir and copied to
.artifacts/)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.report.fixtures import BLOCKS, EXPERTS, STEPS, write_run

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / ".artifacts"
# A pipelined plan with tiny shapes (its step compiles in ~10 s): 2 stages x 2 expert ranks,
# 1F1B over 4 microbatches.
PLAN_ARGS = ["--config=configs/tiny.py", "--config.parallel.pipe=2", "--config.parallel.data=1",
             "--config.parallel.expert=2", "--config.parallel.microbatches=4",
             "--config.trainer.global_batch_size=8", "--config.trainer.seq_len=32"]

SECTIONS_JS = """
return [...document.querySelectorAll('section.card')].map(sec => ({
  id: sec.id, state: sec.dataset.state, text: sec.querySelector('.body').textContent.trim(),
  shapes: sec.querySelectorAll('svg rect, svg path, svg polyline, svg circle, svg line').length,
  svgs: sec.querySelectorAll('svg').length}));
"""


def report_cli(*args) -> Path:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the CLI sizes its own mesh
    r = subprocess.run([sys.executable, "-m", "olmo_jax.report", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    out = Path(r.stdout.strip().splitlines()[-1])
    assert out.is_file(), r.stdout
    return out


def load(browser, html: Path, shot: str, tmp_path: Path) -> dict:
    browser.console()  # drop entries of earlier pages
    browser.open(html.resolve().as_uri())
    status = browser.run("return window.__report")
    errors = [e for e in browser.console() if e["level"] in ("SEVERE", "WARNING")]
    assert not errors, errors
    assert status["failed"] == [], status
    assert browser.run("return performance.getEntriesByType('resource').map(e => e.name)") == []
    png = browser.screenshot(tmp_path / shot)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(png, ARTIFACTS / shot)
    sections = {s["id"]: s for s in browser.run(SECTIONS_JS)}
    for sid, sec in sections.items():
        assert sec["state"] == "rendered" and sec["text"], sec
        assert sid in ("summary", "sizes") or sec["shapes"] > 0, sec  # those two are tables
    return sections


def tip_after_hover(browser, selector: str, index: int = 0) -> str:
    el = browser.run(f"return document.querySelectorAll({selector!r})[{index}]")
    browser.hover(el)
    return browser.run("const t = document.getElementById('tip');"
                       "return t.style.display === 'block' ? t.textContent : ''")


def check_mesh_and_route(browser):
    assert browser.run("return document.querySelectorAll('#mesh g.device').length") == 8
    # pick the routed experts' w_up: device (data d, expert x) stores block d, experts 2x..2x+1
    rows = browser.run("return [...document.querySelectorAll('#mesh tbody tr.pick')]"
                       ".filter(tr => tr.cells[0].textContent === 'params/moe_blocks/ffn/experts/w_up')")
    assert len(rows) == 1
    browser.click(rows[0])
    texts = browser.run("return [...document.querySelectorAll('#mesh g.device')]"
                        ".map(g => g.querySelectorAll('text')[2].textContent)")
    assert texts == [f"[{d}:{d + 1}, {2 * x}:{2 * x + 2}, :, :]" for d in range(2) for x in range(4)]
    assert "device 5  pipe 0 data 1 expert 1" in tip_after_hover(browser, "#mesh g.device", 5)
    # route: 4 senders x 8 tokens; receive buffers 4 ranks x [2 experts, 4 senders, C=3]
    assert browser.run("return document.querySelectorAll('#route g.token').length") == 32
    assert browser.run("return document.querySelectorAll('#route rect.slot').length") == 4 * 2 * 4 * 3
    info = browser.run("return document.querySelector('#route .route-info').textContent")
    assert "receive row" in info and "DROPPED" in info, info  # the first token with a drop
    token = browser.run("return document.querySelectorAll('#route g.token')[9]")  # rank 1, token 1
    browser.click(token)
    info = browser.run("return document.querySelector('#route .route-info').textContent")
    assert info.startswith("rank 1, token 1:"), info
    kept = info.count("receive row")
    assert browser.run("return document.querySelectorAll('#route path.route').length") == 3 * kept
    filled = browser.run("return [...document.querySelectorAll('#route rect.slot')]"
                         ".findIndex(r => r.getAttribute('fill') !== '#eceef2')")
    tip = tip_after_hover(browser, "#route rect.slot", filled)
    assert "receive row" in tip and "token" in tip, tip


def test_run_report_in_chromium(browser, tmp_path):
    run_dir = write_run(tmp_path / "run")
    html = report_cli(str(run_dir))
    assert html == run_dir / "report.html"
    sections = load(browser, html, "report.png", tmp_path)
    assert list(sections) == ["summary", "mesh", "route", "pipeline", "curves", "balance"]
    check_mesh_and_route(browser)
    # pipeline: none (pipe=1): one stage, the forward then the backward of the one microbatch
    assert "No pipeline (parallel.pipe=1)" in sections["pipeline"]["text"]
    assert browser.run("return [...document.querySelectorAll('#pipeline rect.op')]"
                       ".map(r => r.dataset.kind)") == ["F", "B"]
    # curves: loss has a gap at the nan step (two polylines), tokens/s and MFU one each
    lines = browser.run("return [...document.querySelectorAll('#curves svg')].map(s => "
                        "[...s.querySelectorAll('polyline')].map(p => p.getAttribute('points').split(' ').length))")
    assert lines[0][-2:] == [4, 7] and lines[1] == [STEPS] and lines[2] == [STEPS], lines
    assert "train @ step" in tip_after_hover(browser, "#curves .hover-area")
    # heatmap: one panel per MoE block, a cell per (logged step, expert)
    cells = browser.run("return document.querySelectorAll('#balance rect.cell').length")
    assert cells == len(BLOCKS) * (STEPS // 2) * EXPERTS
    assert tip_after_hover(browser, "#balance rect.cell").startswith(f"block {BLOCKS[0]}, step 2, expert 0")
    charts = browser.run("return document.querySelectorAll('#balance .chart').length")
    assert charts == 4  # expert imbalance, local, rank imbalance, dropped fraction


def test_pipelined_run_report_in_chromium(browser, tmp_path):
    """A run folder trained with pipe=2 (1F1B, M=2) shows its schedule."""
    html = report_cli(str(write_run(tmp_path / "run", pipelined=True)))
    sections = load(browser, html, "report-pipelined-run.png", tmp_path)
    assert "1f1b: P=2 stages, M=2 microbatches" in sections["pipeline"]["text"]
    cells = browser.run("return [...document.querySelectorAll('#pipeline rect.op')].map(r => r.dataset.kind)")
    assert sorted(cells) == ["B"] * 4 + ["F"] * 4
    tip = tip_after_hover(browser, "#pipeline rect.op", cells.index("F"))
    assert tip.startswith("stage 0, tick 0") and "forward of microbatch 0" in tip and "block 1" in tip, tip


def test_plan_report_in_chromium(browser, tmp_path):
    html = report_cli(*PLAN_ARGS, f"--out={tmp_path / 'plan.html'}")
    sections = load(browser, html, "report-plan.png", tmp_path)
    assert list(sections) == ["summary", "mesh", "route", "pipeline", "sizes", "memory", "collectives"]
    assert browser.run("return document.querySelectorAll('#sizes tbody tr').length") == 1  # one batch size
    assert "One batch size" in sections["sizes"]["text"]
    assert browser.run("return document.querySelectorAll('#mesh g.device').length") == 4
    assert browser.run("return document.querySelectorAll('#route g.token').length") == 16
    # pipeline: 1F1B, P=2, M=4: every stage runs F and B of every microbatch; 20% bubble
    page = browser.run("return DATA.sections.find(s => s.id === 'pipeline').data")
    assert (page["schedule"], page["stages"], page["microbatches"]) == ("1f1b", 2, 4)
    kinds = browser.run("return [...document.querySelectorAll('#pipeline rect.op')].map(r => r.dataset.kind)")
    assert sorted(kinds) == ["B"] * 8 + ["F"] * 8
    assert "Bubble fraction 20.0%" in sections["pipeline"]["text"]
    tip = tip_after_hover(browser, "#pipeline rect.op", kinds.index("B"))
    assert tip.startswith("stage ") and "backward of microbatch 0" in tip and "virtual stage 0" in tip, tip
    # memory: the planner's per-device bars (arguments, compiled, live at the peak)
    mem = browser.run("return DATA.sections.find(s => s.id === 'memory').data")
    assert [b["name"] for b in mem["bars"]] == ["arguments", "compiled", "live at the peak"]
    bars = browser.run("return document.querySelectorAll('#memory rect.bar').length")
    assert bars == sum(len(b["parts"]) for b in mem["bars"]) and bars >= 6
    assert {"params", "opt_state", "batch"} <= {p["label"] for p in mem["bars"][0]["parts"]}
    tip = tip_after_hover(browser, "#memory rect.bar")
    assert tip.startswith("arguments") and "params:" in tip and "B (" in tip, tip
    # collectives: one bar per compiled collective row, and the total; the pipeline's sends
    col = browser.run("return DATA.sections.find(s => s.id === 'collectives').data")
    purposes = {r["label"].split()[1] for r in col["rows"]}
    assert {"pipe_send", "pipe_gather", "moe_rowwise"} <= purposes, purposes
    assert sum(r["bytes"] for r in col["rows"]) == col["total"] > 0
    assert browser.run("return document.querySelectorAll('#collectives rect.bar').length") == len(col["rows"]) + 1
    tip = tip_after_hover(browser, "#collectives rect.bar")
    assert "per device per step" in tip and "run(s) per step" in tip, tip
