"""Upload throughput to S3: the persistent tier's parallel multipart upload against a plain
s3fs ``put`` of the same bytes.

Starts ``moto_server`` (PyPI's ``moto[server]``, a real S3 API in one Python process) on
127.0.0.1 and a free port, writes one file of random bytes, and uploads it, interleaved
``REPEATS`` times per method:

- ``s3fs put_file``: ``S3FileSystem.put_file`` with s3fs's defaults (50 MiB parts, 10 at a
  time in waves: each wave waits for its slowest part);
- ``s3fs open("wb")``: a streamed write through ``S3File`` (what the persistent tier did
  before: one part at a time);
- ``PersistentTier.put_file``: tierwatch's upload (``--s3-part-size`` parts,
  ``--s3-upload-concurrency`` in flight, a sliding window; the bytes are hashed with xxh3 and
  checked against the manifest entry in the same pass, before the object is completed).

Two links: loopback straight to moto, and moto behind a TCP proxy that limits every
connection to ``--link-mib-s`` (a stand-in for the per-connection bandwidth to a real
object store, which is what parts in flight are for). Every object is deleted after its
upload, so the server holds at most one. The median time per method and link, its
throughput and its ratio to ``s3fs put_file`` go into a table, printed and written to
docs/benchmarks.md ("S3 upload (bench/s3_upload.py)"; other sections stay).

Nothing leaves the machine: the endpoint is the loopback moto server, the credentials are
dummies, and instance-metadata lookups are off. moto runs on the same cores as the client,
so absolute numbers say little about a real S3; the ratio within one run is the result.

Usage::

    .venv/bin/python bench/s3_upload.py [--mib 128] [--repeats 3] [--link-mib-s 16] [--no-doc]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from docs_section import replace_section

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "benchmarks.md"
HEAD = "## S3 upload (bench/s3_upload.py)"
MiB = 1024**2
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}


def start_moto(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``moto_server`` on 127.0.0.1 and a free port; (process, endpoint URL)."""
    import httpx

    from tierwatch.agent.netutil import free_port

    port = free_port()
    out = open(log, "wb")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=out,
        stderr=subprocess.STDOUT,
        env={**os.environ, **AWS_ENV},
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/moto-api/", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"moto_server did not start on port {port}; see {log}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=128, help="file size, MiB")
    p.add_argument("--repeats", type=int, default=3, help="uploads per method and link")
    p.add_argument(
        "--link-mib-s", type=float, default=16, help="per-connection limit of the proxy, MiB/s"
    )
    p.add_argument("--part-mib", type=int, default=16, help="tierwatch part size, MiB")
    p.add_argument("--concurrency", type=int, default=8, help="tierwatch parts in flight")
    p.add_argument("--no-doc", action="store_true", help="print only")
    args = p.parse_args(argv)
    os.environ.update(AWS_ENV)

    import fsspec
    import s3fs

    from tierwatch.agent.checkpoint.format.manifest import FileEntry, xxh3_file
    from tierwatch.agent.checkpoint.tierstore.persister import PersistentTier

    work = Path(tempfile.mkdtemp(prefix="tw-bench-s3-"))
    proc, endpoint = start_moto(work / "moto.log")
    try:
        bucket = "bench"
        direct = {"endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}}
        admin = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **direct)
        admin.call_s3("create_bucket", Bucket=bucket)
        src = work / "shard.distcp"
        with open(src, "wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(MiB))
        size, digest = xxh3_file(src)
        entry = FileEntry(name=src.name, size=size, xxh3=digest)
        sys.path.insert(0, str(REPO / "tests" / "helpers"))
        from s3_server import ThrottledProxy  # the tests' proxy (a dev tool, as this is)

        proxy = ThrottledProxy(int(endpoint.rsplit(":", 1)[1]), rate=args.link_mib_s * MiB).start()
        links = {
            "loopback": endpoint,
            f"{args.link_mib_s:g} MiB/s per connection": proxy.url,
        }
        times: dict[tuple[str, str], list[float]] = {}
        for link, url in links.items():
            options = {**direct, "endpoint_url": url}
            fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **options)
            tier = PersistentTier(
                f"s3://{bucket}/tw",
                options,
                part_size=args.part_mib * MiB,
                upload_concurrency=args.concurrency,
            )

            def plain_put(fs: s3fs.S3FileSystem = fs) -> None:
                fs.put_file(str(src), f"{bucket}/plain/shard.distcp")
                admin.rm(f"{bucket}/plain/shard.distcp")

            def streamed(fs: s3fs.S3FileSystem = fs) -> None:
                with open(src, "rb") as f, fs.open(f"{bucket}/stream/shard.distcp", "wb") as out:
                    while chunk := f.read(8 * MiB):
                        out.write(chunk)
                admin.rm(f"{bucket}/stream/shard.distcp")

            def tierwatch(tier: PersistentTier = tier) -> None:
                tier.put_file(src, "job", 1, src.name, expect=entry)
                admin.rm(f"{bucket}/tw/job/step-1/{src.name}")

            methods: dict[str, Callable[[], None]] = {
                "s3fs put_file (defaults: 50 MiB parts, 10 per wave)": plain_put,
                's3fs open("wb") streamed (the tier before)': streamed,
                f"PersistentTier.put_file ({args.part_mib} MiB parts, {args.concurrency} in "
                "flight, xxh3-verified)": tierwatch,
            }
            for _ in range(args.repeats):  # interleaved, so drift hits every method alike
                for name, fn in methods.items():
                    t0 = time.monotonic()
                    fn()
                    times.setdefault((link, name), []).append(time.monotonic() - t0)
        proxy.stop()
    finally:
        proc.terminate()
        proc.wait(10)
    rows = [
        "| link | method | bytes | median s | throughput | vs s3fs put_file |",
        "|---|---|---|---|---|---|",
    ]
    for link in links:
        mine = {name: ts for (lk, name), ts in times.items() if lk == link}
        base = statistics.median(next(iter(mine.values())))
        for name, ts in mine.items():
            med = statistics.median(ts)
            rows.append(
                f"| {link} | {name} | {size} | {med:.2f} | {size / MiB / med:.0f} MiB/s "
                f"| ×{base / med:.2f} |"
            )
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0]
    block = "\n".join(
        [
            f"- date: {now}",
            f"- machine: {os.cpu_count()} CPUs, {platform.machine()}, load average "
            f"{load:.1f} at the end; moto {_version('moto')}, s3fs {s3fs.__version__}, "
            f"fsspec {fsspec.__version__}, aiobotocore {_version('aiobotocore')}",
            f"- one {args.mib} MiB file of random bytes, {args.repeats} uploads per method and "
            "link, interleaved; each object deleted after its upload",
            "",
            *rows,
            "",
            "Notes:",
            "",
            "- The server is moto_server, one Python process on the same cores as the client: "
            "on loopback it, not the link, bounds throughput (every request body is parsed "
            "in Python, and a multipart upload is copied once more when it completes), so "
            "parts in flight help little there. Behind the per-connection limit the link "
            "bounds each connection, as on a real object store, and the parts in flight are "
            "the difference. Only ratios within one run mean anything.",
            "- `s3fs put_file` uploads without any check; the tier's upload also hashes every "
            "byte (xxh3) and refuses to complete an object that differs from its manifest "
            "entry, so it does more work for its time.",
        ]
    )
    print(block)
    if not args.no_doc:
        write_doc(block)
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def write_doc(block: str) -> None:
    """Replace this benchmark's section of docs/benchmarks.md (the others stay)."""
    replace_section(DOC, HEAD, ".venv/bin/python bench/s3_upload.py", block)


if __name__ == "__main__":
    sys.exit(main())
