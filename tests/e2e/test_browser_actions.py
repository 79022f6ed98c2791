"""The operator's actions in a real browser against real processes: a server (SQLite, the
node-local ``command`` isolation driver), two agents, and examples/train_gpt.py on two
ranks. An operator isolates a node from its page (the agent runs the configured command,
the audit log shows it), releases it, and rolls the running job back to an older committed
step from the job page, watching both ranks' phases turn to ``loaded`` live. A viewer sees
the same pages without the forms and gets 403 from the API.

Headless Chromium from the system (``/usr/bin/chromium``); skipped without it, except with
``TIERWATCH_REQUIRE_BROWSER=1`` (CI).
"""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import pytest
from procs import wait_for
from training import (
    TINY_GPT,
    Gate,
    committed_steps,
    read_log,
    run_in_thread,
    runs_of,
    start_cluster,
)

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.slow]

SMALL = [*TINY_GPT, "--keep-memory", "40", "--persist-every", "5", "--latency-every", "0"]
JOB = "browser-rollback"


def recorder(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "isolation-calls.txt"
    exe = tmp_path / "isolate-node.sh"
    exe.write_text(
        f'#!/bin/sh\necho "$TIERWATCH_ACTION $TIERWATCH_NODE: $TIERWATCH_REASON" '
        f'>> {log}\necho "cordoned $TIERWATCH_NODE"\n'
    )
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe, log


@pytest.fixture
def cluster(tmp_path: Path):
    exe, log = recorder(tmp_path)
    c = start_cluster(
        tmp_path / "cluster",
        with_server=True,
        server_env={
            "TIERWATCH_ISOLATION__DRIVER": "command",
            "TIERWATCH_DASHBOARD_REFRESH_S": "0.5",
        },
    )
    for name in ("node-a", "node-b"):
        c.add_node(name, extra_args=["--isolation-command", str(exe)])
    c.isolation_log = log  # type: ignore[attr-defined]
    yield c
    c.stop()


def sign_in(browser, url: str, token: str):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(20_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{url}/login")
    page.fill("#token", token)
    page.click("main form button[type=submit]")
    page.wait_for_url(f"{url}/")
    return page, errors


def test_operator_isolates_releases_and_rolls_back_from_the_dashboard(browser, cluster, tmp_path):
    from playwright.sync_api import expect

    server = cluster.server
    url = server.url
    log_dir = tmp_path / "run"
    gate = Gate(tmp_path / "gate")
    gate.open(6)  # steps 0 … 5 run; the job then waits at the gate while the operator acts
    procs = cluster.launch(
        [
            "--job-id",
            JOB,
            "--steps",
            "40",
            "--log-dir",
            str(log_dir),
            "--gate",
            str(gate.path),
            *SMALL,
        ],
        placement=["node-a", "node-b"],
        log_dir=log_dir,
    )
    page, errors = sign_in(browser, url, server.token("operator"))

    # Isolate node-a: confirm step, required reason; the agent runs the configured command.
    page.goto(f"{url}/nodes/node-a")
    page.click('details[data-action="isolate"] summary')
    page.fill('details[data-action="isolate"] input[name="reason"]', "XID 79 <b>twice</b>")
    page.click('details[data-action="isolate"] button[type=submit]')
    expect(page.locator(".flash")).to_contain_text("node-a isolated")
    expect(page.locator("p.isolation q.reason")).to_have_text("XID 79 <b>twice</b>")
    run = page.locator("table.commands tr[data-command]").first
    expect(run).to_have_attribute("data-state", "succeeded", timeout=30_000)
    expect(run).to_contain_text("cordoned node-a")
    assert cluster.isolation_log.read_text() == "isolate node-a: XID 79 <b>twice</b>\n"
    page.goto(f"{url}/audit?target=node-a")
    expect(page.locator('tr[data-action="isolate"]')).to_contain_text("XID 79 <b>twice</b>")
    expect(page.locator('tr[data-action="command"]')).to_contain_text("succeeded")

    # Release it again.
    page.goto(f"{url}/nodes/node-a")
    page.click('details[data-action="release"] summary')
    page.fill('details[data-action="release"] input[name="reason"]', "GPU reseated")
    page.click('details[data-action="release"] button[type=submit]')
    expect(page.locator(".flash")).to_contain_text("node-a released")
    expect(page.locator("p.isolation")).to_have_count(0)
    wait_for(
        lambda: cluster.isolation_log.read_text().count("\n") == 2,
        timeout=30,
        what="release ran on the agent",
    )

    # Roll the running job back to an older committed step.
    wait_for(
        lambda: len(committed_steps(cluster.nodes["node-b"], JOB, 1)) >= 3,
        timeout=180,
        what="three committed steps",
    )
    page.goto(f"{url}/jobs/{JOB}")
    options = page.locator('details[data-action="restore"] select[name="step"] option')

    def three_restorable() -> bool:
        page.reload()
        return options.count() >= 4  # "newest" + three steps

    wait_for(three_restorable, timeout=30, what="three restorable steps on the job page")
    target = int(options.nth(3).get_attribute("value"))  # the third-newest committed step
    page.click('details[data-action="restore"] summary')
    page.select_option('details[data-action="restore"] select[name="step"]', str(target))
    page.fill('details[data-action="restore"] input[name="reason"]', "loss spike: suspected SDC")
    page.click('details[data-action="restore"] button[type=submit]')
    expect(page.locator(".flash")).to_contain_text(f"to step {target} requested")
    # The job runs on, one step at a time, until its ranks roll back at a step boundary.
    stepping = run_in_thread(
        lambda: gate.step_until(7, 40, lambda: len(runs_of(read_log(log_dir))) > 1, log_dir=log_dir)
    )
    request = page.locator(".restore-request").first
    # Watch it live (the page refreshes its live block; no reload).
    seen: set[str] = set()

    def both_loaded() -> bool:
        phases = request.locator("tr[data-rank]").evaluate_all(
            "rows => rows.map(r => r.dataset.phase)"
        )
        seen.update(phases)
        return phases == ["loaded", "loaded"]

    wait_for(both_loaded, timeout=120, interval=0.2, what="both ranks loaded on the page")
    assert seen & {"pending", "staging"}, seen  # the progress was watched, not just the end
    expect(request).to_have_attribute("data-state", "succeeded")
    expect(request.locator('tr[data-rank="0"]')).to_contain_text(str(target))
    stepping.join()
    gate.open(40)
    assert cluster.wait_ranks(procs, 240) == [0, 0]
    for rank in (0, 1):
        steps = [x["step"] for x in read_log(log_dir, rank)]
        back = [b for a, b in zip(steps, steps[1:], strict=False) if b <= a]
        assert back == [target + 1], steps
    assert errors == []

    # A viewer sees the same pages without the forms, and the API refuses it.
    viewer_token = server.token("viewer")
    vpage, verrors = sign_in(browser, url, viewer_token)
    vpage.goto(f"{url}/nodes/node-a")
    expect(vpage.locator(".node-head h1")).to_have_text("node-a")
    expect(vpage.locator("#node-actions")).to_have_count(0)
    vpage.goto(f"{url}/jobs/{JOB}")
    expect(vpage.locator(".restore-request").first).to_be_visible()
    expect(vpage.locator("#job-actions")).to_have_count(0)
    headers = {"Authorization": f"Bearer {viewer_token}"}
    r = httpx.post(
        f"{url}/api/v1/nodes/node-a/isolate", json={"reason": "x"}, headers=headers, timeout=10
    )
    assert r.status_code == 403
    r = httpx.post(
        f"{url}/api/v1/jobs/{JOB}/restore", json={"reason": "x"}, headers=headers, timeout=10
    )
    assert r.status_code == 403
    assert verrors == []
