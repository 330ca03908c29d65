"""The S3 server of the bucket benchmarks: the tests' SeaweedFS ``weed mini`` (tests/s3_server.py) started in a
folder of the benchmark's own, with a bucket made and the AWS environment pointing at it, as a user's job reaches a
bucket (the code measured reads the environment, never an argument); and a relay in front of it that paces the
link (tests/s3_relay.py)."""

from __future__ import annotations

from offline import REPO  # tests/ on the import path, offline hub variables

# isort: split

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from s3_server import S3Server, weed_binary

__all__ = ["paced_relay", "s3_bench_server"]

_RELAY = """
import sys, time
sys.path.insert(0, {tests!r})
from s3_relay import S3Relay
relay = S3Relay({upstream}, **{pace!r})
print(relay.port, flush=True)
while True:
    time.sleep(3600)
"""


@contextmanager
def s3_bench_server(directory: Path, bucket: str = "bench") -> Iterator[S3Server]:
    """A started server keeping its data under ``directory``, with ``bucket`` made and its AWS variables set in
    ``os.environ`` for the block (a benchmark may point ``AWS_ENDPOINT_URL`` elsewhere inside it, e.g. at a relay);
    on the way out the server is stopped and the variables are as they were. pf-trl's cached filesystems are
    forgotten on both sides, so none keeps another endpoint's credentials.

    Raises:
        SystemExit: no ``weed`` binary on this machine (one line naming the install script).
    """
    from pf_trl.storage.filesystem import forget_filesystems

    weed = weed_binary()
    if weed is None:
        raise SystemExit("no `weed` binary (SeaweedFS) for the benchmark's S3 server; run `bash scripts/seaweedfs.sh`")
    server = S3Server(weed, Path(directory)).start()
    before = {name: os.environ.get(name) for name in server.env()}
    try:
        server.make_bucket(bucket)
        os.environ.update(server.env())
        forget_filesystems()
        yield server
    finally:
        server.stop()
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        forget_filesystems()


@contextmanager
def paced_relay(upstream_port: int, **pace: float) -> Iterator[int]:
    """The port of a relay to the server on ``upstream_port``, paced by ``pace`` (S3Relay's ``bytes_per_s`` for
    downloads, ``upload_bytes_per_s`` for uploads); killed on the way out. A process of its own, so its copying does
    not hold the measured process's interpreter."""
    code = _RELAY.format(tests=str(REPO / "tests"), upstream=upstream_port, pace=pace)
    relay = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        yield int(relay.stdout.readline())
    finally:
        relay.kill()
        relay.wait()
