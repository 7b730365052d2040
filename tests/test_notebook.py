"""notebooks/lineage.ipynb executes against a run the test creates.

The run: snapshot v0, deltas v1..v7 (some with frozen layers, so the heat
maps are not uniform), a second snapshot at v4 and the segment of a publish
of v8 that never committed (an orphan).
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from aurora_store.apply.sink import weights_digest
from aurora_store.codec.extract import extract, fuse_weights, spec_of
from aurora_store.codec.fusion import FusionPlan
from aurora_store.format.manifest import new_attempt_id, version_dir
from aurora_store.lineage.publish import PublishConfig, publish_delta, publish_snapshot
from aurora_store.storage import open_store
from aurora_tools.synthetic.shapes import MasterWeights, Qwen3Shape, make_weights

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "lineage.ipynb"
SHAPE = Qwen3Shape(vocab=1024, hidden=64, layers=4, intermediate=128, heads=4, kv_heads=2, head_dim=16)
DELTAS = 7
SNAPSHOT_AT = 4


def _fused(plan: FusionPlan, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face weights -> fused weights (as ``aurora_tools.demo.codec`` does)."""
    return fuse_weights(w, plan)


def make_run(url: str) -> None:
    store = open_store(url)
    cfg = PublishConfig(streams=2, segment_bytes=64 << 10)
    weights = make_weights(SHAPE, seed=0)
    plan = FusionPlan.from_specs({n: spec_of(t, n) for n, t in weights.items()})
    state = publish_snapshot(store, "nb", 0, _fused(plan, weights), None, cfg).state
    master = MasterWeights(weights, seed=0)
    current = weights
    for v in range(1, DELTAS + 1):
        # Vary the step size, and freeze some layers, so sizes and heat maps differ.
        frozen: tuple[str, ...] = ()
        if v in (3, 4):
            frozen = tuple(n for n in weights if ".layers.0." in n or ".layers.1." in n)
        elif v == 6:
            frozen = ("model.embed_tokens.weight",)
        new = master.step(lr=(1 + v % 3) * 2e-7, frozen=frozen)
        m = publish_delta(store, "nb", v, extract(plan, current, new), state, cfg, weights_digest=weights_digest(new, plan))
        state, current = m.state, new
        if v == SNAPSHOT_AT:
            publish_snapshot(store, "nb", v, _fused(plan, current), state, cfg)
    # Held-out accuracy at v0, v3 and v6 as the Trainer's evaluation writes it, and one forged entry.
    from aurora_store.coordination.evals import eval_key

    for v, acc in ((0, 0.125), (3, 0.25), (6, 0.375)):
        store.put(eval_key(v), json.dumps({"version": v, "accuracy": acc, "problems": 8}).encode())
    store.put(eval_key(5), b'{"accuracy": 7}')  # out of range: skipped
    # A publish of the next version killed before its manifest: one orphan segment.
    store.put(f"{version_dir('delta', DELTAS + 1)}/{new_attempt_id()}/seg-00000.safetensors", b"x" * 1000)


@pytest.mark.slow
def test_lineage_notebook_executes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    run.mkdir()
    make_run(run.as_uri())

    monkeypatch.setenv("AURORA_RUN_URL", run.as_uri())
    monkeypatch.setenv("AURORA_STORAGE_OPTIONS", "{}")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # The kernel must be this interpreter (the venv), with aurora_store importable.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))

    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert nb.cells[1].metadata.get("tags") == ["parameters"]
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit the notebook without outputs"
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print('KERNEL', sys.executable)"))

    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    texts: list[str] = []
    pngs: list[bytes] = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            assert out.output_type != "error", out
            if out.output_type == "stream":
                texts.append(out.text)
            data = out.get("data", {})
            if "text/plain" in data:
                texts.append(data["text/plain"])
            if "image/png" in data:
                pngs.append(base64.b64decode(data["image/png"]))
    text = "".join(texts)

    assert f"KERNEL {sys.executable}" in text
    assert len(pngs) >= 4, f"expected at least 4 plots, got {len(pngs)}"
    assert "eval v0: accuracy 0.125" in text and "eval v6: accuracy 0.375" in text and "eval v5" not in text
    assert all(p.startswith(b"\x89PNG") and len(p) > 5000 for p in pngs)
    assert run.as_uri() in text
    # The table: every version, both kinds.
    for v in range(1, DELTAS + 1):  # kind, version, base
        assert re.search(rf"^delta\s+{v}\s+{v - 1}\s", text, re.M), f"no table row for delta v{v}"
    for v in (0, SNAPSHOT_AT):
        assert re.search(rf"^snapshot\s+{v}\s", text, re.M), f"no table row for snapshot v{v}"
    assert f"{DELTAS} deltas (v1..v{DELTAS}), 2 snapshots (v0, v{SNAPSHOT_AT}); latest version v{DELTAS}" in text
    assert f"chain: {DELTAS} of {DELTAS} deltas apply" in text
    assert "1 orphan object(s)" in text and f"deltas/v{DELTAS + 1:010d}: 1 object(s), never committed" in text
    assert "0 gap(s)" in text

    if os.environ.get("AURORA_NOTEBOOK_OUT"):  # keep the rendered plots for a look
        out = Path(os.environ["AURORA_NOTEBOOK_OUT"])
        out.mkdir(parents=True, exist_ok=True)
        for i, p in enumerate(pngs):
            (out / f"plot-{i}.png").write_bytes(p)
        nbformat.write(nb, out / "lineage.executed.ipynb")
