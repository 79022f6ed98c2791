"""A real Slurm cluster on loopback for tests: munged, one slurmctld and one slurmd (Debian's
``slurm-wlm`` and ``munge``), in a temporary folder, on ephemeral ports.

The slurmd serves the machine's own host name. The other node names in slurm.conf
(``NodeAddr=127.0.0.1``) are answered by the same slurmd, so slurmctld sees them respond;
the drain, resume and reboot state that tierwatch reads and changes is slurmctld's own, as on
a real cluster. Everything is stopped by :meth:`SlurmCluster.stop`.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from executables import REQUIRE_ENV, require_executable
from procs import wait_for

from tierwatch.agent.netutil import free_port
from tierwatch.server.actions.slurm_state import SlurmNode, parse_show_node

START_TIMEOUT_S = 30.0


def require_slurm() -> dict[str, str]:
    """The executables (``slurmctld``, ``slurmd``, ``scontrol``, ``munged``); skips (or fails
    under ``TIERWATCH_REQUIRE_SERVERS=1``) when one is missing or the tests are not root (slurmd
    must run as root)."""
    found = {
        name: require_executable(name, "slurm-wlm munge")
        for name in ("slurmctld", "slurmd", "scontrol", "munged")
    }
    if os.geteuid() != 0:
        message = "a real slurmd needs root"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return found


@dataclass
class SlurmCluster:
    """A running cluster.

    Attributes:
        root: its folder (config, state, logs, munge socket).
        conf: the slurm.conf path; scontrol finds it through ``SLURM_CONF`` (:attr:`env`).
        host: the node served by the real slurmd (this machine's short host name).
        nodes: every NodeName in slurm.conf, ``host`` first.
        munge_socket: munged's socket (slurm.conf's ``AuthInfo=socket=``).
    """

    root: Path
    conf: Path
    host: str
    nodes: list[str]
    munge_socket: Path
    bins: dict[str, str]
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """The environment for scontrol (and a tierwatch server) to reach this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def scontrol(self, *args: str, check: bool = True) -> str:
        """Run scontrol against this cluster; returns stdout+stderr."""
        out = subprocess.run(
            [self.bins["scontrol"], *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        text = out.stdout + out.stderr
        if check and out.returncode != 0:
            raise AssertionError(f"scontrol {' '.join(args)} exited {out.returncode}: {text}")
        return text

    def node(self, name: str) -> SlurmNode:
        """The node's state, read with ``scontrol -o show node``."""
        return parse_show_node(self.scontrol("-o", "show", "node", name))

    def drain(self, name: str, reason: str) -> None:
        """Drain as an admin would."""
        self.scontrol("update", f"nodename={name}", "state=drain", f"reason={reason}")

    def resume(self, name: str) -> None:
        """Resume as an admin would (ignores 'already in that state')."""
        self.scontrol("update", f"nodename={name}", "state=resume", check=False)

    def log(self, which: str = "slurmctld") -> str:
        path = self.root / "log" / f"{which}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld"):
            proc = self.procs.pop(name, None)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        pidfile = self.root / "munge" / "munged.pid"
        if pidfile.exists():
            try:
                os.kill(int(pidfile.read_text().strip()), 15)
            except (ValueError, ProcessLookupError):
                pass
        shutil.rmtree(self.root, ignore_errors=True)


def _wait(what: str, check: Callable[[], bool], cluster: SlurmCluster, timeout_s: float) -> None:
    def holds() -> bool:
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited {proc.returncode}:\n{cluster.log(name)}")
        return check()

    try:
        wait_for(holds, timeout=timeout_s, what=what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{cluster.log()[-3000:]}") from exc


def start_slurm(nodes: list[str]) -> SlurmCluster:
    """Start munged, slurmctld and slurmd serving ``nodes`` plus this host; waits until
    slurmctld answers and every node is IDLE (a few seconds: slurmctld's first pings)."""
    bins = require_slurm()
    host = socket.gethostname().split(".")[0]
    # munged (as the munge user) must reach its socket folder: a world-searchable folder of
    # our own, not pytest's 0700 tmp tree.
    root = Path(tempfile.mkdtemp(prefix="tw-slurm-"))
    root.chmod(0o755)
    munge_dir = root / "munge"
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir()
    munge_dir.mkdir(mode=0o755)
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge_user = pwd.getpwnam("munge")
    for path in (munge_dir, key):
        os.chown(path, munge_user.pw_uid, munge_user.pw_gid)
    sock = munge_dir / "munge.sock"
    all_nodes = [host, *[n for n in nodes if n != host]]
    ctld_port, slurmd_port = free_port(), free_port()
    conf = root / "slurm.conf"
    reboot = root / "reboot.sh"
    reboot.write_text("#!/bin/sh\nexit 0\n")  # never reboots this machine
    reboot.chmod(0o755)
    others = ",".join(all_nodes[1:])
    conf.write_text(
        "\n".join(
            [
                "ClusterName=tierwatch-test",
                f"SlurmctldHost={host}(127.0.0.1)",
                f"SlurmctldPort={ctld_port}",
                f"SlurmdPort={slurmd_port}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                f"AuthInfo=socket={sock}",
                "CredType=cred/munge",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool'}",
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd.pid'}",
                f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
                f"RebootProgram={reboot}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SwitchType=switch/none",
                "MpiDefault=none",
                "ReturnToService=2",
                "SlurmdTimeout=0",
                "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres",
                "JobCompType=jobcomp/none",
                "AccountingStorageType=accounting_storage/none",
                f"NodeName={host} NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN",
                *([f"NodeName={others} NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN"] if others else []),
                "PartitionName=main Nodes=ALL Default=YES State=UP",
                "",
            ]
        )
    )
    cluster = SlurmCluster(root, conf, host, all_nodes, sock, bins)
    try:
        subprocess.run(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                bins["munged"],
                f"--key-file={key}",
                f"--socket={sock}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={munge_dir / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
                "--force",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        _wait("munged did not create its socket", sock.exists, cluster, START_TIMEOUT_S)
        for name, args in (
            ("slurmctld", [bins["slurmctld"], "-D", "-c", "-f", str(conf)]),
            ("slurmd", [bins["slurmd"], "-D", "-f", str(conf)]),
        ):
            cluster.procs[name] = subprocess.Popen(
                args,
                env=cluster.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            if name == "slurmctld":
                _wait(
                    "slurmctld did not answer",
                    lambda: "is UP" in cluster.scontrol("ping", check=False),
                    cluster,
                    START_TIMEOUT_S,
                )
        _wait(
            "the nodes did not come up IDLE",
            lambda: all(cluster.node(n).base == "IDLE" for n in all_nodes),
            cluster,
            START_TIMEOUT_S,
        )
    except BaseException:
        cluster.stop()
        raise
    return cluster
