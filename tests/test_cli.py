"""``aurora`` command line (aurora_store/cli.py) on a ``file://`` store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from codec_helpers import assert_bit_identical, fuse
from safetensors.torch import load_file, save_file

from aurora_store.codec.extract import plan_of
from aurora_tools.cli import main
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, Qwen3Shape, make_weights

STEPS = 3


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("AURORA_"):
            monkeypatch.delenv(k)


@pytest.fixture
def run(tmp_path: Path):
    """Weights files w0..w3 (successive Adam steps) and a store URL."""
    w = make_weights(QWEN3_TINY, seed=0)
    master = MasterWeights(w, seed=0)
    weights = [w] + [master.step(lr=1e-6) for _ in range(STEPS)]
    files = []
    for i, t in enumerate(weights):
        p = tmp_path / f"w{i}.safetensors"
        save_file(t, str(p))
        files.append(str(p))
    return {
        "url": f"file://{tmp_path / 'store'}",
        "files": files,
        "weights": weights,
        "tmp": tmp_path,
    }


def ok(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "aurora: error" not in err
    return err


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc != 0
    lines = err.rstrip("\n").split("\n")
    assert lines[-1].startswith("aurora: error: "), err
    assert sum(line.startswith("aurora:") for line in lines) == 1, err
    return lines[-1]


def publish_chain(run, capsys, extra: list[str] | None = None) -> None:
    url, files = run["url"], run["files"]
    out = ok(["snapshot", "create", files[0], "--version", "0", "--store", url], capsys)
    assert "snapshot 0" in out
    for v in range(1, STEPS + 1):
        out = ok(
            [
                "delta",
                "create",
                files[v - 1],
                files[v],
                "--version",
                str(v),
                "--store",
                url,
                "--segment-mib",
                "0.004",
                "--streams",
                "2",
                *(extra or []),
            ],
            capsys,
        )
        assert f"delta {v}:" in out


@pytest.mark.parametrize("extra", [[], ["--paper"], ["--no-zstd", "--values", "new"], ["--encodings", "bitmask,u32"]])
def test_snapshot_deltas_apply(run, capsys, extra: list[str]) -> None:
    publish_chain(run, capsys, extra)
    plan = plan_of(run["weights"][0], tied=False)
    for v in (STEPS, 1):
        out = run["tmp"] / f"v{v}.safetensors"
        ok(
            ["delta", "apply", "--version", str(v), "--out", str(out), "--store", run["url"]],
            capsys,
        )
        got = load_file(str(out))
        assert_bit_identical(got, fuse(plan, run["weights"][v]))
        assert not (run["tmp"] / f"v{v}.safetensors.partial").exists()
    # segments really are split at the requested size
    seg_dir = Path(run["url"][len("file://") :]) / "deltas" / "v0000000001"
    assert len(list(seg_dir.glob("*/seg-*.safetensors"))) > 1


def test_missing_base_version(run, capsys) -> None:
    publish_chain(run, capsys)
    msg = fails(
        [
            "delta",
            "create",
            run["files"][0],
            run["files"][1],
            "--version",
            "5",
            "--store",
            run["url"],
        ],
        capsys,
    )
    assert "delta 5" in msg and "base version 4 is not committed" in msg


def test_delta_without_any_base(run, capsys) -> None:
    msg = fails(
        [
            "delta",
            "create",
            run["files"][0],
            run["files"][1],
            "--version",
            "1",
            "--store",
            run["url"],
        ],
        capsys,
    )
    assert "base version 0 is not committed" in msg


def test_missing_input_file(run, capsys) -> None:
    missing = str(run["tmp"] / "nope.safetensors")
    msg = fails(["snapshot", "create", missing, "--version", "0", "--store", run["url"]], capsys)
    assert missing in msg and "no such file" in msg
    ok(["snapshot", "create", run["files"][0], "--version", "0", "--store", run["url"]], capsys)
    msg = fails(
        ["delta", "create", run["files"][0], missing, "--version", "1", "--store", run["url"]],
        capsys,
    )
    assert missing in msg


def test_not_a_safetensors_file(run, capsys) -> None:
    junk = run["tmp"] / "junk.safetensors"
    junk.write_bytes(b"\x00" * 7)
    msg = fails(["snapshot", "create", str(junk), "--version", "0", "--store", run["url"]], capsys)
    assert str(junk) in msg and "not a readable safetensors file" in msg


def other_model_files(tmp: Path) -> tuple[Path, Path]:
    other = Qwen3Shape(vocab=512, hidden=32, layers=2, intermediate=96, heads=2, kv_heads=1, head_dim=16)
    w = make_weights(other, seed=1)
    a, b = tmp / "o0.safetensors", tmp / "o1.safetensors"
    save_file(w, str(a))
    save_file(MasterWeights(w).step(), str(b))
    return a, b


def test_wrong_model_shape_of_new_file(run, capsys) -> None:
    publish_chain(run, capsys)
    _, b = other_model_files(run["tmp"])
    msg = fails(
        ["delta", "create", run["files"][3], str(b), "--version", "4", "--store", run["url"]],
        capsys,
    )
    assert "new weights are" in msg and "model.embed_tokens.weight" in msg
    assert not (Path(run["url"][7:]) / "deltas" / "v0000000004" / "manifest.json").exists()


def test_wrong_model_shape_of_base_file(run, capsys) -> None:
    publish_chain(run, capsys)
    a, b = other_model_files(run["tmp"])
    msg = fails(["delta", "create", str(a), str(b), "--version", "4", "--store", run["url"]], capsys)
    assert "delta 4" in msg and "does not describe the run's model" in msg


def test_wrong_model_names_of_base_file(run, capsys) -> None:
    """A base file whose parameter *names* differ (no equal names to compare specs of)."""
    publish_chain(run, capsys)
    w = {f"other.{n}": t for n, t in run["weights"][3].items()}
    a = run["tmp"] / "renamed.safetensors"
    save_file(w, str(a))
    msg = fails(["delta", "create", str(a), str(a), "--version", "4", "--store", run["url"]], capsys)
    assert "delta 4" in msg and "does not describe the run's model" in msg


def test_apply_of_missing_version(run, capsys) -> None:
    publish_chain(run, capsys)
    out = run["tmp"] / "v9.safetensors"
    msg = fails(["delta", "apply", "--version", "9", "--out", str(out), "--store", run["url"]], capsys)
    assert "version 9 is not committed" in msg
    assert not out.exists()


def test_apply_on_empty_store(run, capsys) -> None:
    out = run["tmp"] / "v0.safetensors"
    msg = fails(["delta", "apply", "--version", "0", "--out", str(out), "--store", run["url"]], capsys)
    assert "version 0 is not committed" in msg


def test_corrupted_segment(run, capsys) -> None:
    publish_chain(run, capsys)
    seg = sorted((Path(run["url"][7:]) / "deltas" / "v0000000002").glob("*/seg-00000.safetensors"))[0]
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0x10
    os.chmod(seg, 0o644)
    seg.write_bytes(bytes(data))
    out = run["tmp"] / "v3.safetensors"
    msg = fails(["delta", "apply", "--version", "3", "--out", str(out), "--store", run["url"]], capsys)
    assert "sha256 does not match" in msg and seg.name in msg and "v0000000002" in msg
    assert not out.exists() and not Path(str(out) + ".partial").exists()
    # the version before the corruption still materializes
    ok(["delta", "apply", "--version", "1", "--out", str(out), "--store", run["url"]], capsys)


def test_republishing_a_committed_version_conflicts(run, capsys) -> None:
    publish_chain(run, capsys)
    manifest = Path(run["url"][7:]) / "deltas" / "v0000000002" / "manifest.json"
    before = manifest.read_bytes()
    msg = fails(
        [
            "delta",
            "create",
            run["files"][1],
            run["files"][3],
            "--version",
            "2",
            "--store",
            run["url"],
        ],
        capsys,
    )
    assert "manifest.json" in msg and "already exists" in msg
    assert manifest.read_bytes() == before


def test_bad_encoder_option_is_one_line(run, capsys) -> None:
    ok(["snapshot", "create", run["files"][0], "--version", "0", "--store", run["url"]], capsys)
    msg = fails(
        [
            "delta",
            "create",
            run["files"][0],
            run["files"][1],
            "--version",
            "1",
            "--store",
            run["url"],
            "--encodings",
            "rle",
        ],
        capsys,
    )
    assert "unknown index encoding 'rle'" in msg


def test_snapshot_of_unreached_version_refused(run, capsys) -> None:
    publish_chain(run, capsys)
    msg = fails(["snapshot", "create", run["files"][0], "--version", "7", "--store", run["url"]], capsys)
    assert "snapshot 7" in msg


def test_snapshot_of_delta_version_carries_its_state(run, capsys) -> None:
    from aurora_store.lineage.fetch import read_manifest
    from aurora_store.lineage.materialize import materialize
    from aurora_store.storage import open_store

    publish_chain(run, capsys)
    ok(["snapshot", "create", run["files"][2], "--version", "2", "--store", run["url"]], capsys)
    store = open_store(run["url"])
    assert read_manifest(store, "snapshot", 2).state == read_manifest(store, "delta", 2).state
    tensors, state = materialize(store, 3)
    assert state == read_manifest(store, "delta", 3).state
    plan = plan_of(run["weights"][0], tied=False)
    assert_bit_identical(tensors, fuse(plan, run["weights"][3]))


def test_a_bug_in_a_command_is_one_line_and_its_traceback_only_at_debug_level(
    run, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An error that is neither a fault nor a bad input (a bug) ends the command with one line, exit 1."""
    from aurora_tools.cli import store_cmds

    def buggy(args: object) -> int:
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    monkeypatch.setattr(store_cmds, "cmd_lineage", buggy)
    with caplog.at_level("DEBUG", logger="aurora"):
        line = fails(["lineage", run["url"]], capsys)
    assert line.startswith("aurora: error: unexpected TypeError: unsupported operand"), line
    assert "Traceback" not in capsys.readouterr().err
    logged = [r for r in caplog.records if r.levelname == "DEBUG" and r.exc_info is not None]
    assert logged and isinstance(logged[0].exc_info[1], TypeError), "the traceback is kept at debug level"
