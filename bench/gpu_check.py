"""GPU check: TieredCheckpointer and the NVML collector on a real CUDA device, in one command.

Run ``make gpu-check`` (or ``.venv/bin/python bench/gpu_check.py``) on a machine with a CUDA
GPU; it takes under 5 minutes on one H200. Without CUDA it exits with code 2 and
``no CUDA device: ...``. ``--dry-run-cpu`` runs the same flow on CPU tensors with tiny sizes
(gloo, no pinned memory, no NVML), to check the script itself on a machine without a GPU.

What it does, all on 127.0.0.1 (one ``tierwatch-agent run`` process, memory folder on
/dev/shm, simulated collector, no server):

1. **FSDP2 at world size 1** (``fully_shard`` per layer and at the root, NCCL bound to
   ``cuda:0`` with ``device_id``, plus gloo for CPU tensors): ``--check-steps`` AdamW steps,
   each saved through ``TieredCheckpointer.save``. Right before every ``save()`` the rank
   takes a synchronous ``.cpu()`` copy of the local shards of the same state
   (``get_model_state_dict`` / ``get_optimizer_state_dict``). After the last commit, every
   committed step (``commit-<r>.json`` in the memory folder) is loaded with plain
   ``torch.distributed.checkpoint.load`` and compared bit for bit (bytes, dtype, shape)
   with its copy.
2. **FSDP2 with 2 processes sharing the one GPU**: the same, on a gloo group with CUDA
   tensors (NCCL refuses two ranks on one GPU: "Duplicate GPU detected").
3. **Latency probe**: ``CheckpointCollectives.latency_ms()`` on each run's training group
   (NCCL at world size 1: CUDA-event timing on the group's bound device).
4. **NVML collector** against the real GPU: ``NvmlCollector.start``, two ``collect()``;
   every field of ``GpuSample`` (``GPU_METRICS``) is read or reported unsupported (None),
   ``nvml_field_error`` events are listed, and no call may raise.
5. **Blocking time and step overhead** at world size 1 with CUDA tensors, every
   ``--interval`` steps, same model and destination folder type (/dev/shm):
   TieredCheckpointer against ``dcp.async_save`` with a pinned-memory ``DefaultStager``
   (``StagingOptions(use_pinned_memory=True, use_shared_memory=False,
   use_async_staging=True, use_non_blocking_copy=True)``, one stager reused for every save,
   torch 2.13 ``torch/distributed/checkpoint/staging.py``; shared memory is for the
   process-based checkpointer only). ``async_save`` returns an ``AsyncSaveResponse``: its
   ``staging_completion`` is waited for before the next ``optimizer.step()`` (the copy must
   finish before the weights change) and its ``upload_completion`` before the next save
   (at most one save in flight, as TieredCheckpointer). Blocking per save = time in the
   save call (with that wait) + the extra host time of the next ``optimizer.step()`` (the
   wait for the copy: TieredCheckpointer's pre-hook, or ``staging_completion``) over the
   median ``optimizer.step()`` without checkpointing. Step time = wall time of the step,
   ending with ``loss.item()`` (the host sync a logging loop has); overhead against steps
   without checkpointing measured in blocks between the methods, in the same process.

The table goes to stdout and replaces the "GPU check (bench/gpu_check.py)" section of
docs/benchmarks.md (``--doc``; the dry run writes only with an explicit ``--doc``). Exit code
0 when every check passed, 1 when one failed, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
SECTION = "## GPU check (bench/gpu_check.py)"
NO_CUDA_EXIT = 2


# -- configuration -------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    """Model and loop sizes of one mode.

    Attributes:
        width, layers, batch: the checked model (``layers`` square Linear + ReLU of ``width``,
            batch ``batch``).
        check_steps: steps saved (each one) and verified per run.
        timing_width, timing_layers, timing_batch: the timed model.
        interval: steps between two saves in the timing part.
        saves: saves per timed method.
        baseline_steps: steps without checkpointing per block between the methods.
    """

    width: int
    layers: int
    batch: int
    check_steps: int
    timing_width: int
    timing_layers: int
    timing_batch: int
    interval: int
    saves: int
    baseline_steps: int


#: On the GPU: a 1 GiB+ timed state (4096² × 6 Linear + AdamW: 1.2 GiB), a small checked one.
CUDA_SIZES = Sizes(1024, 4, 64, 8, 4096, 6, 1024, 10, 6, 20)
#: ``--dry-run-cpu``: tiny, so the whole flow runs in well under 90 s on 2 cores.
CPU_SIZES = Sizes(64, 2, 8, 3, 256, 2, 16, 2, 2, 3)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (``--worker`` is the script's own rank mode).

    Raises:
        SystemExit: bad arguments (argparse, code 2).
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="the same flow on CPU tensors with tiny sizes (no GPU, no NVML)",
    )
    p.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="write the section into this file (default docs/benchmarks.md; the dry run "
        "writes only when given)",
    )
    p.add_argument("--no-doc", action="store_true", help="print only")
    p.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.doc is None and not args.dry_run_cpu and not args.no_doc:
        args.doc = DOC
    if args.no_doc:
        args.doc = None
    return args


def cuda_problem() -> str | None:
    """Why this machine cannot run the GPU check (None when it can)."""
    import torch

    if not torch.cuda.is_available():
        version = torch.version.cuda or "none (a CPU-only wheel)"
        return (
            f"no CUDA device: torch {torch.__version__} (CUDA {version}) sees no GPU; run on "
            "a GPU machine, or pass --dry-run-cpu to check the script on CPU tensors"
        )
    return None


def stager_options(cuda: bool) -> dict[str, bool]:
    """``StagingOptions`` for the ``dcp.async_save`` peer.

    On CUDA the pinned-memory configuration (pinned buffers, staging on a background thread
    and stream, non-blocking copies). Without an accelerator torch refuses pinned memory
    and non-blocking copies (``DefaultStager.__init__`` raises), so only the background
    staging thread stays.
    """
    return {
        "use_pinned_memory": cuda,
        "use_shared_memory": False,
        "use_async_staging": True,
        "use_non_blocking_copy": cuda,
    }


# -- comparison ----------------------------------------------------------------------------
def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b.0": leaf}`` for a nested dict/list state dict (keys joined with ``.``)."""
    out: dict[str, Any] = {}
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            out.update(flatten(v, f"{prefix}{i}."))
    else:
        out[prefix.rstrip(".")] = tree
    return out


def local_cpu(t: Any) -> Any:
    """A synchronous CPU copy of a tensor's local data (a DTensor's shard); other leaves as
    they are."""
    import torch

    if not isinstance(t, torch.Tensor):
        return t
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.detach().cpu().clone()


def compare(reference: Mapping[str, Any], loaded: Mapping[str, Any]) -> list[str]:
    """Differences between two flat state dicts; empty when bit-equal.

    Tensors must match in shape, dtype and every byte (so NaNs and -0.0 count); other
    leaves by ``==``. A key missing on either side is a difference.

    Returns:
        One line per difference, e.g. ``"model.0.weight: 3 of 4096 bytes differ"``.
    """
    import torch

    out = []
    for key in sorted(set(reference) | set(loaded)):
        if key not in loaded:
            out.append(f"{key}: not loaded")
            continue
        if key not in reference:
            out.append(f"{key}: not in the reference")
            continue
        a, b = reference[key], loaded[key]
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            out.append(f"{key}: {type(a).__name__} vs {type(b).__name__}")
        elif isinstance(a, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                out.append(f"{key}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
                continue
            ab = a.contiguous().view(-1).view(torch.uint8)
            bb = b.contiguous().view(-1).view(torch.uint8)
            bad = int((ab != bb).sum())
            if bad:
                out.append(f"{key}: {bad} of {ab.numel()} bytes differ")
        elif a != b:
            out.append(f"{key}: {a!r} vs {b!r}")
    return out


def nvml_verdict(
    samples: list[dict[str, Any]], events: list[dict[str, str]], metrics: Iterable[str]
) -> dict[str, Any]:
    """Summarise NVML samples: every metric read or unsupported, and the field errors.

    Args:
        samples: ``GpuSample.model_dump()`` of each collection (GPU 0's).
        events: the collector's events (``kind``, ``message``).
        metrics: the metric names (``GPU_METRICS``).

    Returns:
        ``{"ok", "read": [name], "unsupported": [name], "errors": [message], "missing": [name]}``:
        ``ok`` when there is a sample, no metric is missing from it and no
        ``nvml_field_error`` / ``nvml_gpu_error`` event came.
    """
    names = list(metrics)
    last = samples[-1] if samples else {}
    read = [n for n in names if last.get(n) is not None]
    unsupported = [n for n in names if n in last and last[n] is None]
    missing = [n for n in names if n not in last]
    errors = [
        f"{e['kind']}: {e['message']}"
        for e in events
        if e["kind"] in ("nvml_field_error", "nvml_gpu_error")
    ]
    return {
        "ok": bool(samples) and not missing and not errors,
        "read": read,
        "unsupported": unsupported,
        "errors": errors,
        "missing": missing,
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def blocking_per_save(
    save_s: list[float], next_opt_s: list[float], baseline_opt_s: list[float]
) -> list[float]:
    """Blocking of each save: time in the save call + the next ``optimizer.step()``'s host
    time over the median without checkpointing (never below 0), seconds."""
    base = median(baseline_opt_s)
    return [s + max(0.0, o - base) for s, o in zip(save_s, next_opt_s, strict=True)]


def timing_summary(timing: Mapping[str, Any]) -> dict[str, Any]:
    """Medians, overheads and ratios of the timing part (seconds, fractions).

    ``timing`` has ``baseline`` (``step_s``, ``opt_s``) and one entry per method
    (``save_s``, ``next_opt_s``, ``step_s``).
    """
    base = timing["baseline"]
    base_step = mean(base["step_s"])
    out: dict[str, Any] = {"baseline_step_s": base_step, "methods": {}}
    for name, m in timing.items():
        if name == "baseline" or not isinstance(m, Mapping) or "save_s" not in m:
            continue
        blocks = blocking_per_save(m["save_s"], m["next_opt_s"], base["opt_s"])
        step = mean(m["step_s"])
        out["methods"][name] = {
            "blocking_s": median(blocks),
            "save_call_s": median(m["save_s"]),
            "step_s": step,
            "overhead": step / base_step - 1 if base_step else float("nan"),
            "saves": len(blocks),
        }
    ms = out["methods"]
    if TIERED in ms and ASYNC in ms:
        a, t = ms[ASYNC], ms[TIERED]
        out["blocking_ratio"] = t["blocking_s"] / a["blocking_s"] if a["blocking_s"] else None
        oa, ot = a["step_s"] - base_step, t["step_s"] - base_step
        out["overhead_ratio"] = ot / oa if oa > 0 else None
    return out


TIERED = "TieredCheckpointer"
ASYNC = "dcp.async_save + DefaultStager"


# -- report --------------------------------------------------------------------------------
def fmt_ms(s: float | None) -> str:
    if s is None or s != s:
        return "–"
    return f"{s * 1000:.1f} ms" if s < 10 else f"{s:.1f} s"


def fmt_ratio(x: float | None) -> str:
    return "–" if x is None else f"×{x:.2f}"


def check_rows(results: Mapping[str, Any]) -> list[tuple[str, bool, str]]:
    """``(check, passed, detail)`` for every check in ``results`` (see :func:`render`)."""
    rows = []
    for key, label in (("ws1", "FSDP2, world size 1"), ("ws2", "FSDP2, 2 processes, one GPU")):
        run = results.get(key)
        if run is None:
            continue
        if run.get("error"):
            rows.append((f"{label}: train + save", False, run["error"]))
            continue
        committed, saved = run["committed"], run["saved"]
        bad = run["mismatches"]
        detail = (
            f"{run['backend']}, {run['device']}; {len(committed)}/{len(saved)} saves committed, "
            f"{run['compared']} state-dict entries × {len(committed)} steps compared"
        )
        if bad:
            detail += "; " + "; ".join(bad[:3])
        rows.append(
            (
                f"{label}: committed steps bit-equal to .cpu()",
                not bad and committed == saved,
                detail,
            )
        )
        lat = run.get("latency")
        if lat is not None:
            ok = lat.get("error") is None
            rows.append(
                (
                    f"{label}: latency probe",
                    ok,
                    lat.get("error") or f"{lat['ms']:.3f} ms on {lat['device']}",
                )
            )
    nv = results.get("nvml")
    if nv is not None:
        if nv.get("skipped"):
            rows.append(("NVML collector", True, f"skipped: {nv['skipped']}"))
        elif nv.get("error"):
            rows.append(("NVML collector", False, nv["error"]))
        else:
            unsupported = ", ".join(nv["unsupported"]) or "none"
            detail = f"{len(nv['read'])} fields read; unsupported (None): {unsupported}"
            if nv["errors"] or nv["missing"]:
                detail += f"; errors: {'; '.join(nv['errors'][:3])}; missing: {nv['missing']}"
            rows.append(("NVML collector", nv["ok"], detail))
    return rows


def render(results: Mapping[str, Any]) -> str:
    """The markdown block of one run: facts, the checks table and the timing table."""
    sizes = results["sizes"]
    lines = [
        f"- date: {results['date']}",
        f"- machine: {results['machine']}",
        f"- command: `{results['command']}`",
        f"- wall time: {results['wall_s']:.0f} s",
        "",
        "| check | result | detail |",
        "|---|---|---|",
    ]
    for name, ok, detail in check_rows(results):
        lines.append(f"| {name} | {'ok' if ok else '**FAILED**'} | {detail} |")
    t = results.get("timing")
    if t and "methods" in t:
        state = t.get("state_bytes", 0)
        lines += [
            "",
            f"Timed at world size 1: {sizes['timing_layers']} × Linear "
            f"{sizes['timing_width']}² + AdamW ({state / 2**30:.2f} GiB), batch "
            f"{sizes['timing_batch']}, a save every {sizes['interval']} steps, "
            f"{sizes['saves']} saves per method, to /dev/shm. async_save's stager: "
            f"`StagingOptions({', '.join(f'{k}={v}' for k, v in t.get('stager', {}).items())})`.",
            "",
            "| method | blocking per save (median) | in the save call (median) | mean step time "
            "| step overhead vs no checkpoint |",
            "|---|---|---|---|---|",
            f"| no checkpoint | – | – | {fmt_ms(t['baseline_step_s'])} | |",
        ]
        for name, m in t["methods"].items():
            lines.append(
                f"| {name} | {fmt_ms(m['blocking_s'])} | {fmt_ms(m['save_call_s'])} | "
                f"{fmt_ms(m['step_s'])} | {100 * m['overhead']:+.1f} % |"
            )
        lines.append(
            f"| ratio {TIERED} / async_save | {fmt_ratio(t.get('blocking_ratio'))} | | | "
            f"{fmt_ratio(t.get('overhead_ratio'))} (of the added step time) |"
        )
    elif t and t.get("error"):
        lines += ["", f"Timing: **FAILED**: {t['error']}"]
    if "--dry-run-cpu" in results["command"]:
        lines += [
            "",
            "This block is a `--dry-run-cpu` run: CPU tensors, gloo, tiny sizes, no NVML. It"
            " shows that the script runs end to end; its figures say nothing about a GPU.",
        ]
    return "\n".join(lines)


INTRO = """\
`make gpu-check` on a machine with a CUDA GPU (it builds `.venv` as `make setup` does, then
runs `.venv/bin/python bench/gpu_check.py`; meant to take under 5 minutes on one H200). It
trains FSDP2 at world size 1 (NCCL) and with 2 processes sharing the GPU (gloo with CUDA
tensors), saving every step through TieredCheckpointer, and checks each committed step bit-
equal (loaded with plain DCP from the memory tier) to a synchronous `.cpu()` copy taken at
`save()`; runs the latency probe and the NVML collector against the real GPU; and times
TieredCheckpointer against `dcp.async_save` with a pinned-memory `DefaultStager` (same
model, interval and /dev/shm destination). The module docstring says how each figure is
measured.

Assumptions about the machine: Python 3.11 and a CUDA build of torch. `make gpu-check`
builds `.venv` from the locks when it is missing or older than them (pip only, no npm);
`torch==2.13.0` from PyPI is the CUDA build on Linux x86_64, so the package registry must be
reachable from the machine. Do not carry this repository's `.venv` to a GPU machine: it
holds the CPU wheel (`2.13.0+cpu`), and the check would exit 2. A device machine that copies
the working tree gets no `.venv`, so it builds one. Also a writable /dev/shm with room for
about 3 GiB; nothing else: the agent, the ranks and their rendezvous listen on 127.0.0.1
only, and no server is needed.

Without CUDA the command exits with code 2 (`no CUDA device: ...`);
`bench/gpu_check.py --dry-run-cpu` runs the same flow on CPU tensors with tiny sizes (a
check of the script, not a GPU result)."""


def write_doc(text: str, block: str) -> str:
    """``text`` (a benchmarks page) with its GPU-check section replaced by ``block``, or the
    section appended; every other section is kept as it is."""
    section = f"{SECTION}\n\n{INTRO}\n\n{block.rstrip()}\n"
    start = text.find(SECTION)
    if start < 0:
        return text.rstrip() + "\n\n" + section
    nxt = text.find("\n## ", start + len(SECTION))
    rest = "" if nxt < 0 else text[nxt + 1 :]
    head = text[:start].rstrip() + "\n\n"
    return head + section + ("\n" + rest if rest else "")


# -- the node agent ------------------------------------------------------------------------
NODE_TOKEN = "gpu-check-no-server"


def authority_seed() -> str:
    """The seed of this run's credential authority (random per run; workers inherit it)."""
    import secrets

    return os.environ.setdefault("GPU_CHECK_AUTHORITY_SEED", secrets.token_hex(32))


def authority():  # noqa: ANN201 - a LocalAuthority (imported lazily with tierwatch)
    """The agent runs without a server: this run signs the job credentials it checks."""
    from tierwatch.agent.credentials import LocalAuthority

    return LocalAuthority(kid="gpu-check", seed=bytes.fromhex(authority_seed()))


class Agent:
    """A ``tierwatch-agent run`` process on loopback (simulated collector, no server).

    Args:
        root: folder for its log and spool.
        memory_dir: the memory tier (on /dev/shm).
    """

    def __init__(self, root: Path, memory_dir: Path) -> None:
        from tierwatch.agent.netutil import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.memory_dir = memory_dir
        self.log = root / "agent.log"
        self.args = [
            str(Path(sys.executable).parent / "tierwatch-agent"),
            "run",
            "--node",
            "gpu-check",
            "--server",
            "http://127.0.0.1:9",
            "--token",
            NODE_TOKEN,
            "--credential-keys-file",
            authority().write_keys(root / "credential-keys.json"),
            "--collector",
            "simulated",
            "--sim-gpus",
            "1",
            "--interval",
            "5",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--spool-dir",
            str(root / "spool"),
            "--memory-dir",
            str(memory_dir),
            "--persistent-url",
            f"file://{root / 'persistent'}",
            "--ckpt-scan-interval",
            "0.5",
            "--log-level",
            "WARNING",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Agent:
        """Start it and wait (30 s at most) until ``GET /v1/ckpt/info`` answers.

        Raises:
            RuntimeError: it exited or did not answer in time (its log's tail says why).
        """
        import httpx

        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                r = httpx.get(
                    f"{self.url}/v1/ckpt/info",
                    headers={"Authorization": f"Bearer {NODE_TOKEN}"},
                    timeout=1,
                )
                if r.status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"tierwatch-agent did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- one rank ------------------------------------------------------------------------------
def _build(width: int, layers: int, device: Any, world: int) -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*mods).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _state(model: Any, optim: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optim)}


def _step(model: Any, optim: Any, batch: int, width: int, device: Any) -> tuple[float, float]:
    """One forward/backward/AdamW step; (step seconds, optimizer.step host seconds)."""
    import torch

    t0 = time.perf_counter()
    x = torch.randn(batch, width, device=device)
    loss = model(x).pow(2).mean()
    optim.zero_grad(set_to_none=True)
    loss.backward()
    t1 = time.perf_counter()
    optim.step()
    opt = time.perf_counter() - t1
    loss.item()  # the host sync of a loop that logs its loss
    return time.perf_counter() - t0, opt


def _check_run(sizes: Sizes, device: Any, world: int, rank: int, job: str) -> dict[str, Any]:
    """Train + save every step + verify every committed step (see the module docs)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from tierwatch import TieredCheckpointer
    from tierwatch.agent.checkpoint.format.layout import commit_name, step_dirname
    from tierwatch.agent.checkpoint.training.collectives import CheckpointCollectives

    model, optim = _build(sizes.width, sizes.layers, device, world)
    state = {"model": model, "optim": optim}
    ckpt = TieredCheckpointer(
        job,
        persist_every=10**6,
        keep_memory=sizes.check_steps + 1,
        latency_every=0,
        job_credential=authority().job_credential(job),
    )
    refs: dict[int, dict[str, Any]] = {}
    try:
        for step in range(sizes.check_steps):
            _step(model, optim, sizes.batch, sizes.width, device)
            refs[step] = {k: local_cpu(v) for k, v in flatten(_state(model, optim)).items()}
            ckpt.save(step, state)
        ckpt.wait()
        job_dir = Path(ckpt.job_dir)
    finally:
        ckpt.close()
    dist.barrier()
    committed = [s for s in refs if (job_dir / step_dirname(s) / commit_name(rank)).exists()]
    mismatches: list[str] = []
    compared = 0
    for s in committed:
        template = _state(model, optim)
        dcp.load(template, checkpoint_id=str(job_dir / step_dirname(s)))
        loaded = {k: local_cpu(v) for k, v in flatten(template).items()}
        compared = len(loaded)
        mismatches += [f"step {s}: {d}" for d in compare(refs[s], loaded)]
    latency: dict[str, Any]
    try:
        probe = CheckpointCollectives(timeout_s=60)
        latency = {"ms": probe.latency_ms(), "device": str(probe.latency_device())}
    except Exception as exc:  # noqa: BLE001 - reported in the table
        latency = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "backend": str(dist.get_backend()),
        "device": str(device),
        "saved": sorted(refs),
        "committed": committed,
        "compared": compared,
        "mismatches": mismatches,
        "latency": latency,
    }


def _timing_run(sizes: Sizes, device: Any, job: str, shm: Path) -> dict[str, Any]:
    """Baseline, TieredCheckpointer and dcp.async_save steps at world size 1 (module docs)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from tierwatch import TieredCheckpointer

    w, b = sizes.timing_width, sizes.timing_batch
    model, optim = _build(w, sizes.timing_layers, device, 1)
    for _ in range(3):  # warm-up: AdamW state exists, kernels are loaded
        _step(model, optim, b, w, device)
    state_bytes = sum(
        t.numel() * t.element_size()
        for t in flatten(_state(model, optim)).values()
        if isinstance(t, torch.Tensor)
    )
    options = stager_options(device.type == "cuda")
    out: dict[str, Any] = {
        "baseline": {"step_s": [], "opt_s": []},
        "state_bytes": state_bytes,
        "stager": options,
    }

    def baseline() -> None:
        for _ in range(sizes.baseline_steps):
            s, o = _step(model, optim, b, w, device)
            out["baseline"]["step_s"].append(s)
            out["baseline"]["opt_s"].append(o)

    def method(name: str, save: Callable[[int], None], before_opt: Callable[[], None]) -> None:
        rec: dict[str, list[float]] = {"save_s": [], "next_opt_s": [], "step_s": []}
        n = sizes.interval * sizes.saves
        after_save = False
        real_step = optim.step

        def step_with_wait(*a: Any, **kw: Any) -> Any:
            before_opt()
            return real_step(*a, **kw)

        optim.step = step_with_wait  # the wait for staging counts in optimizer.step's time
        try:
            for i in range(n + 1):  # one more step: the last save's next optimizer.step
                s, o = _step(model, optim, b, w, device)
                if after_save:
                    rec["next_opt_s"].append(o)
                    after_save = False
                if i == n:
                    break
                t0 = time.perf_counter()
                if (i + 1) % sizes.interval == 0:
                    save(i)
                    rec["save_s"].append(time.perf_counter() - t0)
                    after_save = True
                rec["step_s"].append(s + time.perf_counter() - t0)
        finally:
            optim.step = real_step
        out[name] = rec

    baseline()
    ckpt = TieredCheckpointer(
        job,
        persist_every=10**6,
        keep_memory=2,
        latency_every=0,
        job_credential=authority().job_credential(job),
    )
    try:
        method(TIERED, lambda i: ckpt.save(i, {"model": model, "optim": optim}), lambda: None)
        ckpt.wait()
    finally:
        ckpt.close()
    baseline()
    stager = DefaultStager(StagingOptions(**options))
    pending: dict[str, Any] = {"staging": None, "upload": None}

    def async_save(i: int) -> None:
        if pending["upload"] is not None:
            pending["upload"].result()
        resp = dcp.async_save(
            _state(model, optim),
            checkpoint_id=str(shm / "async" / f"step-{i % 2}"),
            async_stager=stager,
        )
        pending["staging"], pending["upload"] = resp.staging_completion, resp.upload_completion

    def wait_staging() -> None:
        if pending["staging"] is not None:
            pending["staging"].result()
            pending["staging"] = None

    try:
        method(ASYNC, async_save, wait_staging)
        if pending["upload"] is not None:
            pending["upload"].result()
    finally:
        stager.close()
    baseline()
    return out


def worker(out_path: Path, dry_run: bool, role: str) -> int:
    """One rank (``RANK``/``WORLD_SIZE``/``MASTER_*`` and ``TIERWATCH_AGENT_URL`` set by
    :func:`run_ranks`): ``role`` is ``ws1`` (check + timing) or ``ws2`` (check)."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sizes = CPU_SIZES if dry_run else CUDA_SIZES
    torch.set_num_threads(1 if dry_run else 4)
    if dry_run:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    elif world == 1:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:  # two ranks on one GPU: NCCL refuses it, gloo moves CUDA tensors through the host
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("gloo")
    result: dict[str, Any]
    try:
        result = _check_run(sizes, device, world, rank, f"gpu-check-{role}")
    except Exception as exc:  # noqa: BLE001 - reported in the table
        result = {"error": f"{type(exc).__name__}: {exc}"}
    if role == "ws1":
        try:
            shm = Path(os.environ["GPU_CHECK_SHM"])
            result["timing"] = _timing_run(sizes, device, f"gpu-check-{role}-timing", shm)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            result["timing"] = {"error": f"{type(exc).__name__}: {exc}"}
    out_path.with_name(f"{out_path.name}-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_ranks(
    world: int, role: str, agent: Agent, root: Path, shm: Path, dry_run: bool, timeout_s: float
) -> dict[str, Any]:
    """Start ``world`` worker processes of this script; rank 0's result (or why none)."""
    from tierwatch.agent.netutil import free_port

    port = free_port()
    out = root / role
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TIERWATCH_AGENT_URL=agent.url,
            GPU_CHECK_SHM=str(shm),
            GPU_CHECK_AUTHORITY_SEED=authority_seed(),
        )
        cmd = [sys.executable, __file__, "--worker", str(out), "--role", role]
        if dry_run:
            cmd.append("--dry-run-cpu")
        log = open(root / f"{role}-{rank}.log", "wb")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
        log.close()
    path = out.with_name(f"{out.name}-0.json")
    if path.exists():
        return json.loads(path.read_text())
    tail = (root / f"{role}-0.log").read_text(errors="replace")[-1500:].replace("\n", " ")
    return {"error": f"rank 0 exited with {codes[0]} and no result: {tail}"}


def nvml_check(dry_run: bool) -> dict[str, Any]:
    """The NVML collector against this machine's GPUs (GPU 0's samples, see
    :func:`nvml_verdict`); in the dry run only when NVML loads."""
    from tierwatch.agent.collectors.nvml import NvmlCollector
    from tierwatch.agent.protocol import GPU_METRICS

    c = NvmlCollector()
    if not c.is_available():
        if dry_run:
            return {"skipped": f"dry run, {c.init_error or 'NVML unavailable'}"}
        return {"error": f"NVML unavailable: {c.init_error}"}
    try:
        c.start(lambda _event: None)
        samples = []
        for _ in range(2):
            samples += [s.model_dump(mode="json") for s in c.collect() if s.index == 0]
            time.sleep(0.2)
        events = [{"kind": e.kind, "message": e.message} for e in c.drain_events()]
    except Exception as exc:  # noqa: BLE001 - the check is that nothing raises
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        c.shutdown()
    return nvml_verdict(samples, events, GPU_METRICS)


def machine(dry_run: bool) -> str:
    import torch

    cpus = f"{os.cpu_count()} CPUs, {platform.machine()}, torch {torch.__version__}"
    if dry_run or not torch.cuda.is_available():
        return f"{cpus}, no GPU (--dry-run-cpu: CPU tensors, not a GPU result)"
    p = torch.cuda.get_device_properties(0)
    return f"{cpus}, CUDA {torch.version.cuda}, {p.name} ({p.total_memory / 2**30:.0f} GiB)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:  # a rank: --worker OUT --role ROLE [--dry-run-cpu]
        i = argv.index("--worker")
        role = argv[argv.index("--role") + 1]
        return worker(Path(argv[i + 1]), "--dry-run-cpu" in argv, role)
    args = parse_args(argv)
    if not args.dry_run_cpu and (problem := cuda_problem()):
        print(problem, file=sys.stderr)
        return NO_CUDA_EXIT
    t0 = time.monotonic()
    sizes = CPU_SIZES if args.dry_run_cpu else CUDA_SIZES
    root = Path(tempfile.mkdtemp(prefix="tw-gpu-check-"))
    shm = Path("/dev/shm") / f"tw-gpu-check-{os.getpid()}"
    results: dict[str, Any] = {
        "date": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        "machine": machine(args.dry_run_cpu),
        "command": "bench/gpu_check.py" + (" --dry-run-cpu" if args.dry_run_cpu else ""),
        "sizes": asdict(sizes),
    }
    agent = Agent(root, shm / "memory").start()
    try:
        ws1 = run_ranks(1, "ws1", agent, root, shm, args.dry_run_cpu, 200)
        results["timing"] = ws1.pop("timing", None)
        results["ws1"] = ws1
        results["ws2"] = run_ranks(2, "ws2", agent, root, shm, args.dry_run_cpu, 120)
    finally:
        agent.stop()
        shutil.rmtree(shm, ignore_errors=True)
    results["nvml"] = nvml_check(args.dry_run_cpu)
    (root / "raw.json").write_text(json.dumps(results, default=str))
    if results["timing"] and "baseline" in results["timing"]:
        raw = results["timing"]
        results["timing"] = {
            **timing_summary(raw),
            "state_bytes": raw["state_bytes"],
            "stager": raw["stager"],
        }
    results["wall_s"] = time.monotonic() - t0
    block = render(results)
    print(block)
    if args.json:
        args.json.write_text(json.dumps(results, default=str, indent=1))
    if args.doc:
        args.doc.write_text(write_doc(args.doc.read_text() if args.doc.exists() else "", block))
        print(f"\nwritten to {args.doc}")
    print(f"logs: {root}")
    failed = [name for name, ok, _ in check_rows(results) if not ok]
    if results["timing"] is None or "error" in (results["timing"] or {}):
        failed.append("timing")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
