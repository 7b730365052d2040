"""Format 2 is what every writer writes unless asked for format 1 (FORMAT.md §3.1).

The Trainer (``--format``, ``AURORA_FORMAT``), the Publisher (``format=``,
``AURORA_FORMAT``) and ``aurora delta create`` (``--format``,
``AURORA_FORMAT``) write segments marked ``"2"`` by default, and ``1`` when
asked, which a format-1 reader (``formats=("1",)``) reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from api_helpers import tiny_lm, train_step
from safetensors.torch import save_file

from aurora_store.api import Publisher
from aurora_store.codec.entries import AUTO_V1, EncodeOptions
from aurora_store.errors import ConfigError
from aurora_store.format.segment import decode_segment, parse_safetensors
from aurora_tools.cli import main
from aurora_tools.synthetic.shapes import QWEN3_TINY, MasterWeights, make_weights


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("AURORA_"):
            monkeypatch.delenv(k)


def segment_formats(root: Path) -> list[tuple[str, set[tuple[str, str]]]]:
    """(aurora.format, {(encoding, val_codec)}) of every delta segment under a file:// run root;
    each also read as a format-1 reader would when it is marked 1."""
    out = []
    for p in sorted(root.glob("deltas/*/*/seg-*.safetensors")):
        data = p.read_bytes()
        meta, _ = parse_safetensors(data, p.name)
        kinds = {(e["encoding"], e.get("val_codec", "none")) for e in json.loads(meta["aurora.entries"])}
        if meta["aurora.format"] == "1":
            decode_segment(data, p.name, formats=("1",))
        out.append((meta["aurora.format"], kinds))
    assert out, f"no delta segment under {root}"
    return out


def only(formats: list[tuple[str, set[tuple[str, str]]]], fmt: str) -> bool:
    if any(f != fmt for f, _ in formats):
        return False
    kinds = set().union(*(k for _, k in formats))
    uses_v2 = any(e == "rice" or c == "planes" for e, c in kinds)
    return uses_v2 if fmt == "2" else not uses_v2


def test_encode_options_default_to_format_2_and_format_1_leaves_its_additions_out() -> None:
    assert EncodeOptions().format == 2
    assert "rice" in EncodeOptions().index_choices and "planes" in EncodeOptions().codec_choices
    v1 = EncodeOptions(format=1)
    assert v1 == AUTO_V1 and "rice" not in v1.index_choices and "planes" not in v1.codec_choices
    with pytest.raises(ConfigError, match="format 1 leaves no codec"):
        EncodeOptions(codecs=("planes",), format=1)
    with pytest.raises(ConfigError, match="format must be 1 or 2"):
        EncodeOptions(format=3)


# -- aurora delta create --------------------------------------------------------------------


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    w = make_weights(QWEN3_TINY, seed=1)
    master = MasterWeights(w, seed=1)
    out = []
    for i, t in enumerate([w, master.step(lr=1e-6)]):
        p = tmp_path / f"w{i}.safetensors"
        save_file(t, str(p))
        out.append(str(p))
    return out


@pytest.mark.parametrize(
    ("flags", "env", "fmt"),
    [([], {}, "2"), (["--format", "1"], {}, "1"), ([], {"AURORA_FORMAT": "1"}, "1"), (["--format", "2"], {"AURORA_FORMAT": "1"}, "2")],
    ids=["default", "flag", "env", "flag-over-env"],
)
def test_delta_create_writes_format_2_unless_asked(
    tmp_path: Path, files: list[str], flags: list[str], env: dict[str, str], fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    url = f"file://{tmp_path / 'store'}"
    assert main(["snapshot", "create", files[0], "--version", "0", "--store", url]) == 0
    assert main(["delta", "create", files[0], files[1], "--version", "1", "--store", url, *flags]) == 0
    assert only(segment_formats(tmp_path / "store"), fmt)
    out = tmp_path / "v1.safetensors"
    assert main(["delta", "apply", "--version", "1", "--out", str(out), "--store", url]) == 0


def test_delta_create_refuses_a_third_format(tmp_path: Path, files: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["delta", "create", files[0], files[1], "--version", "1", "--store", f"file://{tmp_path}", "--format", "3"])
    assert "--format" in capsys.readouterr().err


# -- the Publisher ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "env", "fmt"), [({}, {}, "2"), ({"format": 1}, {}, "1"), ({}, {"AURORA_FORMAT": "1"}, "1")], ids=["default", "option", "env"]
)
def test_publisher_writes_format_2_unless_asked(
    tmp_path: Path, kw: dict, env: dict[str, str], fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    model = tiny_lm()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with Publisher(f"file://{tmp_path}/run", **kw) as pub:
        pub.publish(model)
        train_step(model, opt, 1)
        p = pub.publish(model)
    assert p is not None and p.kind == "delta"
    assert only(segment_formats(tmp_path / "run"), fmt)


# -- the Trainer's option ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "env", "fmt"),
    [([], {}, 2), (["--format", "1"], {}, 1), ([], {"AURORA_FORMAT": "1"}, 1), (["--format", "2"], {"AURORA_FORMAT": "1"}, 2)],
    ids=["default", "flag", "env", "flag-over-env"],
)
def test_trainer_publishes_format_2_unless_asked(flags: list[str], env: dict[str, str], fmt: int) -> None:
    from aurora_tools.cli import config_file, run_cmds
    from aurora_tools.cli.main import build_parser
    from workers.trainer.cli import config_from_args

    argv = ["trainer", "--store", "file:///tmp/r", "--redis", "redis://127.0.0.1:1/0", "--run", "r", *flags]
    args = config_file.parse_worker_args(build_parser(argv), argv, {"trainer": run_cmds.add_trainer_arguments})
    cfg = config_from_args(args, env)
    assert cfg.format == fmt and cfg.publish_config().options.format == fmt
    # The encoder's other variables still apply, in either format.
    cfg = config_from_args(args, {**env, "AURORA_CODECS": "none,planes"})
    assert cfg.publish_config().options.codec_choices == (("none", "planes") if fmt == 2 else ("none",))


def test_trainer_refuses_a_third_format_in_one_line() -> None:
    from aurora_tools.cli import config_file, run_cmds
    from aurora_tools.cli.main import build_parser
    from workers.trainer.cli import config_from_args

    argv = ["trainer", "--store", "file:///tmp/r", "--redis", "redis://127.0.0.1:1/0", "--run", "r", "--format", "3"]
    args = config_file.parse_worker_args(build_parser(argv), argv, {"trainer": run_cmds.add_trainer_arguments})
    with pytest.raises(ConfigError, match=r"format must be 1 or 2 \(--format, AURORA_FORMAT\), got 3"):
        config_from_args(args, {}).publish_config()
