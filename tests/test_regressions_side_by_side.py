"""The side-by-side regression runner: trees, the import check, headlines and the table (no benchmark is run)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from aurora_tools.bench import side_by_side as sbs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_headline_takes_the_contract_keys_only() -> None:
    out = sbs.headline("transfer", {"speedup_streams": 1.4, "pipeline_over_raw": 1.2, "delta": {}})
    assert out == {"speedup_streams": 1.4, "pipeline_over_raw": 1.2}
    assert sbs.headline("wan", {"full_vs_ideal": 0.1}) == {"delta_vs_ideal": None}


def test_table_shows_every_run_and_the_median() -> None:
    runs = [{"delta_vs_ideal": x, "load": [1.0, 1.0], "wall_s": 40.0} for x in (0.5, 0.9, 0.7)]
    result = {
        "rounds": 3,
        "benches": ["wan"],
        "extra": {"wan": []},
        "cpus": 2,
        "trees": [{"label": "old", "runs": {"wan": runs}}, {"label": "new", "runs": {"wan": [{"error": "boom", "load": [1, 1]}]}}],
    }
    text = sbs.format_table(result)
    assert "0.500, " not in text  # one key: no separator
    assert "0.500 @1" in text and "0.900 @1" in text
    old = next(line for line in text.splitlines() if line.strip().startswith("old"))
    assert old.rstrip().endswith("0.700")  # the median of the three
    new = next(line for line in text.splitlines() if line.strip().startswith("new"))
    assert "boom" in new and new.rstrip().endswith("-")


def test_a_commit_is_extracted_and_its_own_package_is_imported() -> None:
    if subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    with sbs.trees(["HEAD", REPO], REPO) as ts:
        extracted, folder = ts
        assert os.path.isfile(os.path.join(extracted.path, "aurora_store", "__init__.py"))
        assert extracted.path != REPO and folder.path == REPO
        sbs.check_imports(extracted)  # its aurora_store, not the editable install's
        path = extracted.path
    assert not os.path.exists(path)  # removed with the context


def test_a_tree_importing_another_package_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # An empty folder: aurora_store comes from the installed project, not from the tree.
    with pytest.raises(SystemExit, match="imports aurora_store from"):
        sbs.check_imports(sbs.Tree("empty", str(tmp_path)))


def test_fewer_than_two_trees_is_a_usage_error() -> None:
    p = subprocess.run([sys.executable, "-m", "aurora_tools.bench.side_by_side", "--tree", "HEAD"], capture_output=True, text=True)
    assert p.returncode == 2 and "at least two" in p.stderr
