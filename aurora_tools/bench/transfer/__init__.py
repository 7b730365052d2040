"""``aurora bench transfer``: publish-to-staged time over 1 and S connections, against raw S3.

What is timed, against an S3-protocol server (moto) started by this program
on 127.0.0.1 and stopped when it ends:

- *delta* (the realistic payload): a Qwen3-shaped bf16 model takes one
  Adam-sized step (:class:`~aurora_tools.synthetic.shapes.MasterWeights`); the
  changed elements are extracted once, then ``publish_delta`` (encode, upload
  segments while encoding, commit the manifest) followed by ``fetch_delta``
  (fetch, verify sha256, decode and validate) is the *publish-to-staged* time;
- *full*: the same model's full weights, ``publish_snapshot`` followed by
  ``fetch_snapshot``;
- *raw*: the same bytes (same number of objects, same sizes: segments or
  shards first, then the manifest; the manifest first on the way back) put and
  got with the same client stack (s3fs) from a thread pool, with nothing else
  around it. ``pipeline_over_raw`` is pipeline time over raw time at the same
  number of connections.

Each is measured over 1 connection and over ``--streams`` connections. The
staged delta is applied to a copy of the base and must give the new weights
bit for bit (``lossless``); the fetched snapshot must equal them too.

On loopback nothing waits on the network: client and server burn CPU, and on a
small machine the cores are the limit, which is why client and server CPU
seconds are reported next to the wall times.

The parts: :mod:`.options` (its options and sizes), :mod:`.timing` (a store
that records when each request ran, wall and CPU seconds), :mod:`.server`
(the S3 server, optionally behind the WAN proxy), :mod:`.runs` (one pipeline
or raw-transfer run), :mod:`.benchmark` (every run, summarized),
:mod:`.report` (the table and ``main``).
"""

from __future__ import annotations

from aurora_tools.bench.transfer.benchmark import run_benchmark
from aurora_tools.bench.transfer.options import add_arguments
from aurora_tools.bench.transfer.report import main
from aurora_tools.bench.transfer.timing import TimedStore

__all__ = ["add_arguments", "main", "TimedStore", "run_benchmark"]
