"""The demo's Prometheus (``DEMO_PROMETHEUS=1``): Debian's ``prometheus`` on a loopback
ephemeral port, scraping each demo agent's ``/metrics`` every second, so the server's node
charts read from it (``TIERWATCH_PROMETHEUS_URL``) as they would in a cluster.

The agents serve ``/metrics`` on their local API (127.0.0.1, no credential needed for it), so
the scrape targets are the agents' ports, known before the agents start; Prometheus marks a
target that is down (a node whose host the demo "lost") and its series go stale, which the
charts show as a gap. The TSDB lives under the demo's state dir and keeps a day.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from demo.cluster import detach, end_child, wait_http
from tierwatch.agent.exporter import dcgm_relabel_configs
from tierwatch.agent.netutil import free_port

#: Where Debian's package installs it (``apt-get install prometheus``).
DEFAULT_EXECUTABLE = "/usr/bin/prometheus"
SCRAPE_INTERVAL = "1s"


def find_executable(exe: str | None = None) -> str:
    """The Prometheus executable: ``exe``, else ``prometheus`` on ``PATH``, else
    :data:`DEFAULT_EXECUTABLE`.

    Raises:
        RuntimeError: none of them exists (the message says how to install it).
    """
    for candidate in (exe, shutil.which("prometheus"), DEFAULT_EXECUTABLE):
        if candidate and Path(candidate).is_file():
            return candidate
    raise RuntimeError(
        "DEMO_PROMETHEUS=1 needs Prometheus: install it (Debian/Ubuntu: `apt-get install "
        "prometheus`), or run the demo without DEMO_PROMETHEUS"
    )


def scrape_config(targets: list[str]) -> dict:
    """The Prometheus configuration: one ``tierwatch`` job scraping ``targets``
    (``host:port``) at :data:`SCRAPE_INTERVAL`, as a cluster's dcgm-exporter job would, with
    the relabel rules that store dcgm-exporter's names (``modelName``,
    ``DCGM_FI_DEV_PCIE_REPLAY_COUNTER``)."""
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "scrape_timeout": SCRAPE_INTERVAL},
        "scrape_configs": [
            {
                "job_name": "tierwatch",
                "static_configs": [{"targets": targets}],
                # stores the agents' lines under dcgm-exporter's names (docs/operations.md)
                "metric_relabel_configs": dcgm_relabel_configs(),
            }
        ],
    }


@dataclass
class DemoPrometheus:
    """A Prometheus process for the demo.

    Attributes:
        root: Its folder (configuration, TSDB, log).
        targets: The agents' ``host:port``.
        executable: The binary (:func:`find_executable`).
        port: Its port on 127.0.0.1 (0: an ephemeral one, picked at :meth:`start`).
    """

    root: Path
    targets: list[str]
    executable: str = field(default_factory=find_executable)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        """Write the configuration, start Prometheus on a fresh TSDB and wait until it is
        ready.

        Raises:
            RuntimeError: it exited or was not ready within ``timeout`` seconds (its log is
                named).
        """
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        config = self.root / "prometheus.yml"
        config.write_text(json.dumps(scrape_config(self.targets), indent=2))  # JSON is YAML
        self.port = self.port or free_port()
        log_path = self.root / "prometheus.log"
        self.log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            [
                self.executable,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.root / 'data'}",
                "--storage.tsdb.retention.time=1d",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=detach,
        )
        proc = self.proc
        if not wait_http(f"{self.url}/-/ready", timeout, alive=lambda: proc.poll() is None):
            self.stop()
            raise RuntimeError(f"Prometheus did not start; see {log_path}")

    def stop(self, timeout: float = 15.0) -> None:
        """Stop Prometheus (SIGKILL after ``timeout`` seconds)."""
        end_child(self.proc, signal.SIGTERM, timeout)
        if self.log is not None:
            self.log.close()
            self.log = None
