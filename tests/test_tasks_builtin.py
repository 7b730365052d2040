"""The built-in tasks (arithmetic, gsm8k, math), their data loading and the reward runner.

Real files (JSON lines and Parquet written here), a real S3-protocol server
for ``s3://`` URLs, and real child processes for the runner; no hub.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from task_helpers import ScriptedTask

from aurora_store.errors import ConfigError, TaskDataError
from aurora_store.testing.servers import S3Server
from aurora_tools.demo.system import DemoConfig
from workers.task import (
    ArithmeticTask,
    Gsm8kTask,
    MathTask,
    Problem,
    RewardRunner,
    extract_final_answer,
    load_rows,
    make_problems,
    make_task,
    math_equal,
)
from workers.task.arithmetic import all_problems
from workers.trainer.config import TrainerConfig


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def gsm8k_rows(n: int) -> list[dict[str, str]]:
    return [
        {
            "question": f"Tom has {i} apples and buys {i + 1} more. How many?",
            "answer": f"{i}+{i + 1}=<<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1}\n#### {2 * i + 1}",
        }
        for i in range(n)
    ]


def math_rows(n: int) -> list[dict[str, str]]:
    """Half with an ``answer`` field, half with only a boxed ``solution``; both question keys."""
    rows: list[dict[str, str]] = []
    for i in range(n):
        if i % 2:
            rows.append({"problem": f"What is {i}/{2 * i}?", "answer": "\\frac{1}{2}"})
        else:
            rows.append({"question": f"What is {i} + 1?", "solution": f"We add: {i} + 1 = \\boxed{{{i + 1}}}."})
    return rows


# ---------------------------------------------------------------------------
# arithmetic


def test_arithmetic_batches_walk_shuffled_passes_over_every_problem() -> None:
    task = make_task("arithmetic", difficulty=1)
    assert isinstance(task, ArithmeticTask)
    # Difficulty 1 has 100 sums: five batches of 20 are each of them once, and the next five again.
    first = [p for s in range(5) for p in task.train_problems(s, 20, seed=5)]
    second = [p for s in range(5, 10) for p in task.train_problems(s, 20, seed=5)]
    assert sorted(p.id for p in first) == sorted(p.id for p in second) == sorted(p.id for p in all_problems(1))
    assert [p.id for p in first] != [p.id for p in second]  # reshuffled each pass
    assert task.train_problems(3, 20, seed=5) == make_task("arithmetic").train_problems(3, 20, seed=5)  # deterministic
    assert task.train_problems(0, 20, seed=6) != first[:20]  # the seed matters
    assert all(task.reward(p.solution, p) == 1.0 and p.answer == sum(map(int, p.prompt_text[3:-5].split("+"))) for p in first)
    assert len({p.id for p in task.train_problems(0, 150, seed=5)}) == 150  # a repeat gets its own id
    assert {p.answer >= 0 for p in all_problems(4)} == {True} and len(all_problems(2)) == 900
    # The demo's reward_first and reward_last (five steps each) are each one whole pass.
    assert 5 * DemoConfig().batch == len(all_problems(TrainerConfig().difficulty))
    task = make_task("arithmetic", difficulty=2)
    assert task.warm_start_problems(10, seed=6) == make_problems(10, seed=6, difficulty=2)
    ev = task.eval_problems(20)
    assert ev == task.eval_problems(20) and ev[:5] == task.eval_problems(5)
    train_ids = {p.id for s in range(50) for p in task.train_problems(s, 16, seed=0)}
    assert not train_ids & {p.id for p in ev}
    p = ev[0]
    assert task.reward(p.solution, p) == 1.0 and task.reward("#### -99999", p) == 0.0
    with pytest.raises(ConfigError, match="--difficulty"):
        make_task("arithmetic", difficulty=7)
    with pytest.raises(ConfigError, match="--data"):
        make_task("arithmetic", data="x.jsonl")


# ---------------------------------------------------------------------------
# gsm8k


def test_gsm8k_task_from_jsonl(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "gsm.jsonl", gsm8k_rows(40))
    task = make_task("gsm8k", str(path), holdout=8)
    assert isinstance(task, Gsm8kTask) and task.name == "gsm8k"
    ev = task.eval_problems(100)
    assert len(ev) == 8 and task.eval_problems(3) == ev[:3]
    p = ev[0]
    assert p.prompt_text.endswith("How many?\nGive the final answer after '####'.")
    assert isinstance(p.answer, int) and p.solution.endswith(f"#### {p.answer}") and "<<" not in p.solution
    assert task.reward(f"Some reasoning.\n#### {p.answer}", p) == 1.0
    assert task.reward(f"#### {p.answer + 1}", p) == 0.0
    assert task.reward(str(p.answer), p) == 0.0  # no marker
    assert {q.id for q in task.warm_start_problems(100, 0)} == {q.id for q in task.train_problems(0, 32, 0)}


def test_train_walk_is_seeded_disjoint_and_epochal(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "gsm.jsonl", gsm8k_rows(30))
    task = make_task("gsm8k", str(path), holdout=6)
    again = make_task("gsm8k", str(path), holdout=6)
    held = {p.id for p in task.eval_problems(6)}
    assert len(held) == 6
    # 24 training rows, batches of 8: one epoch is 3 batches, each row exactly once.
    epoch0 = [task.train_problems(s, 8, seed=1) for s in range(3)]
    ids0 = [p.id for b in epoch0 for p in b]
    assert len(ids0) == len(set(ids0)) == 24 and not set(ids0) & held
    assert epoch0 == [again.train_problems(s, 8, seed=1) for s in range(3)]  # deterministic
    epoch1 = [p.id for s in range(3, 6) for p in task.train_problems(s, 8, seed=1)]
    assert sorted(epoch1) == sorted(ids0) and epoch1 != ids0  # reshuffled
    assert [p.id for p in task.train_problems(0, 8, seed=2)] != ids0[:8]  # the seed matters
    # The held-out rows do not depend on the run seed, and eval never sees a training row.
    assert {p.id for p in make_task("gsm8k", str(path), seed=9, holdout=6).eval_problems(6)} == held
    # A batch that crosses an epoch boundary or outgrows the data keeps its ids unique.
    big = task.train_problems(1, 50, seed=1)
    assert len({p.id for p in big}) == 50


def test_eval_file_is_the_held_out_set(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(10))
    test = write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(4))
    task = make_task("gsm8k", str(train), str(test))
    assert [p.id for p in task.eval_problems(10)] == [f"eval/test.jsonl:{i}" for i in range(1, 5)]
    assert len({p.id for s in range(3) for p in task.train_problems(s, 10, 0)}) == 10  # all rows train
    same_ids = write_jsonl(tmp_path / "dup.jsonl", [dict(r, id=f"q{i}") for i, r in enumerate(gsm8k_rows(3))])
    with pytest.raises(TaskDataError, match="also in"):
        make_task("gsm8k", str(same_ids), str(same_ids))


# ---------------------------------------------------------------------------
# math


@pytest.mark.parametrize(
    ("completion", "reference", "want"),
    [
        ("So the result is \\boxed{\\frac12}.", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("#### 1/2", "\\frac{1}{2}", 1.0),  # plain, after the marker
        ("The answer is $\\frac{1}{2}$.", "\\dfrac{1}{2}", 1.0),
        ("First \\boxed{3}, no wait: \\boxed{4}", "4", 1.0),  # the last box counts
        ("First \\boxed{4}, no wait: \\boxed{3}", "4", 0.0),
        ("\\boxed{\\frac{2}{3}}", "\\frac{1}{2}", 0.0),  # wrong
        ("The answer is 0.6", "0.5", 0.0),
        ("I think it is one half.", "0.5", 0.0),  # no final answer
        ("", "0.5", 0.0),
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
        ("\\boxed{" + "9" * 1000 + "}", "9", 0.0),  # absurd, not parsed
    ],
)
def test_math_reward(completion: str, reference: str, want: float) -> None:
    task = MathTask.__new__(MathTask)  # the reward needs no data
    assert task.reward(completion, Problem("p", "q", reference)) == want


def test_extract_final_answer() -> None:
    assert extract_final_answer("work\n#### \\frac{3}{4}\nthanks") == "\\frac{3}{4}"
    assert extract_final_answer("\\boxed{\\frac{a}{\\sqrt{b}}} done") == "\\frac{a}{\\sqrt{b}}"
    assert extract_final_answer("Thus the answer is: $42$.") == "42"
    assert extract_final_answer("\\boxed{unclosed") is None
    assert math_equal("\\frac12", "0.5") and not math_equal("\\frac12", "")


def test_math_task_from_jsonl_and_parquet(tmp_path: Path) -> None:
    rows = math_rows(12)
    jl = write_jsonl(tmp_path / "math.jsonl", rows)
    pqt = tmp_path / "math.parquet"
    cols = {k: [r.get(k) for r in rows] for k in ("problem", "question", "answer", "solution")}
    pq.write_table(pa.table(cols), pqt)
    assert load_rows(str(pqt))[1] == {"problem": "What is 1/2?", "question": None, "answer": "\\frac{1}{2}", "solution": None}
    for path in (jl, pqt):
        task = make_task("math", str(path), holdout=4)
        assert isinstance(task, MathTask)
        everything = task.eval_problems(4) + [p for s in range(2) for p in task.train_problems(s, 4, 0)]
        assert len({p.id for p in everything}) == 12
        for p in everything:
            assert p.prompt_text.endswith("\nPut the final answer in \\boxed{}.")
            assert task.reward(p.solution, p) == 1.0, p
            assert task.reward("\\boxed{1000}", p) == 0.0
        half = next(p for p in everything if p.answer == "\\frac{1}{2}")
        assert task.reward("#### 0.5", half) == 1.0 and task.reward("The answer is 1/2.", half) == 1.0
        assert "\\boxed{\\frac{1}{2}}" in half.solution  # synthesized: the row had no solution


# ---------------------------------------------------------------------------
# data errors and make_task errors


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"question": "q", "answer": "#### 1"}\n{not json\n', r"bad\.jsonl:2: not valid JSON"),
        ('{"question": "q", "answer": "#### 1"}\n[1, 2]\n', r"line 2: expected a JSON object, got list"),
        ('{"question": "q", "answer": "#### 1"}\n{"question": "q", "answer": 5}\n', r"row 2: field 'answer' must be a string, got int"),
        ('{"question": "q", "answer": "#### 1"}\n{"answer": "#### 1"}\n', r"row 2: field 'question' is missing"),
        ('{"question": "q", "answer": 5}\n', r"row 1: field 'answer' must be a string, got int"),
        ('{"question": "q", "answer": "five"}\n', r"row 1: field 'answer' has no final '#### <int>'"),
        ("", r"bad\.jsonl: the file is empty"),
    ],
)
def test_bad_data_is_one_line_naming_the_file(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TaskDataError, match=match) as info:
        make_task("gsm8k", str(path))
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_load_rows_refuses(tmp_path: Path) -> None:
    with pytest.raises(TaskDataError, match="no such file"):
        load_rows(str(tmp_path / "missing.jsonl"))
    (tmp_path / "rows.csv").write_text("a,b\n1,2\n")
    with pytest.raises(TaskDataError, match="unknown file type"):
        load_rows(str(tmp_path / "rows.csv"))
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(TaskDataError, match=r"broken\.parquet: cannot be read as parquet"):
        load_rows(str(tmp_path / "broken.parquet"))
    (tmp_path / "mixed.jsonl").write_text('{"a": 1}\n\n{"a": "x"}\n')  # Arrow cannot type the column
    with pytest.raises(TaskDataError, match=r"mixed\.jsonl: line 3: field 'a' is str, but int on line 1"):
        load_rows(str(tmp_path / "mixed.jsonl"))
    (tmp_path / "one.json").write_text('[{"a": 1}, {"a": 2}]')
    assert load_rows(str(tmp_path / "one.json")) == [{"a": 1}, {"a": 2}]
    (tmp_path / "math.jsonl").write_text('{"problem": "p", "solution": "no box"}\n{"problem": "p", "answer": "1"}\n')
    with pytest.raises(TaskDataError, match=r"row 1: no 'answer' field and no \\boxed"):
        make_task("math", str(tmp_path / "math.jsonl"))
    write_jsonl(tmp_path / "one_row.jsonl", gsm8k_rows(1))
    with pytest.raises(TaskDataError, match="at least 2 rows"):
        make_task("gsm8k", str(tmp_path / "one_row.jsonl"))


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("nonsense", "unknown task 'nonsense': use one of arithmetic, gsm8k, math"),
        ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
        ("task_helpers:missing", "has no attribute 'missing'"),
        ("task_helpers:NOT_CALLABLE", "is not callable"),
        ("task_helpers:not_a_task", "lacks train_problems, eval_problems, reward, warm_start_problems"),
        ("task_helpers:wrong_signature", "must accept data=, eval_data=, seed="),
        (":make", "expected package.module:factory"),
    ],
)
def test_make_task_errors(name: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make_task(name)


def test_make_task_custom_and_data_required() -> None:
    task = make_task("task_helpers:scripted_task", seed=4)
    assert isinstance(task, ScriptedTask) and task.seed == 4
    for name in ("gsm8k", "math"):
        with pytest.raises(ConfigError, match=f"task '{name}' needs --data"):
            make_task(name)


@pytest.mark.server
def test_load_by_s3_url(s3_server: S3Server, tmp_path: Path) -> None:
    import fsspec

    bucket = s3_server.new_bucket()
    opts = s3_server.storage_options()
    with fsspec.open(f"s3://{bucket}/data/gsm.jsonl", "wb", **opts) as f:
        f.write(write_jsonl(tmp_path / "gsm.jsonl", gsm8k_rows(6)).read_bytes())
    task = make_task("gsm8k", f"s3://{bucket}/data/gsm.jsonl", storage_options=opts, holdout=2)
    assert [p.id for p in task.eval_problems(2)] and all(p.id.startswith("gsm.jsonl:") for p in task.eval_problems(2))
    assert len(load_rows(f"s3://{bucket}/data/gsm.jsonl", opts)) == 6
    with pytest.raises(TaskDataError, match="no such file"):
        load_rows(f"s3://{bucket}/data/missing.jsonl", opts)


# ---------------------------------------------------------------------------
# the reward runner


def scripted(*answers: str) -> list[tuple[str, Problem]]:
    return [("completion", Problem(f"p{i}", "q", a)) for i, a in enumerate(answers)]


def test_runner_timeout_from_a_worker_thread(caplog: pytest.LogCaptureFixture) -> None:
    pairs = scripted("1", "0.25", "sleep:30:1", "0.5", "1", "sleep:0.01:0.75")
    out: dict[str, Any] = {}
    with RewardRunner(make_task("task_helpers:scripted_task"), timeout_s=1.0) as runner:

        def step() -> None:
            try:
                out["scores"] = runner.score(pairs)
            except BaseException as e:  # surfaced below, not lost in the thread
                out["error"] = e

        with caplog.at_level(logging.WARNING, logger="workers.task.runner"):
            t = threading.Thread(target=step, name="trainer-step")
            t.start()
            t.join(120)
        assert not t.is_alive() and "error" not in out, out
        assert out["scores"] == [1.0, 0.25, 0.0, 0.5, 1.0, 0.75]
        assert runner.stats["timeouts"] == 1 and runner.stats["restarts"] == 1
        assert [r.getMessage() for r in caplog.records if "took longer than 1s" in r.getMessage() and "'p2'" in r.getMessage()]
        assert runner.score(scripted("0.5", "1")) == [0.5, 1.0]  # the fresh child serves on


def test_runner_faults_score_zero_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with RewardRunner(ScriptedTask(), timeout_s=30.0, workers=2, chunk=2) as runner, caplog.at_level(logging.WARNING):
        got = runner.score(scripted("raise", "0.5", "raise", "nan", "str", "2.5", "1"))
    assert got == [0.0, 0.5, 0.0, 0.0, 0.0, 2.5, 1.0]  # finite numbers are not clamped
    msgs = [r.getMessage() for r in caplog.records if r.name == "workers.task.runner"]
    assert sum("raised ZeroDivisionError: scripted failure" in m for m in msgs) == 1  # once per reason
    assert sum("non-finite nan" in m for m in msgs) == 1 and sum("a str, not a number" in m for m in msgs) == 1
    assert not any("Traceback" in m for m in msgs)
    assert runner.stats["errors"] == 2 and runner.stats["invalid"] == 2


def test_runner_scores_builtins_and_refuses_what_cannot_travel(tmp_path: Path) -> None:
    task = make_task("math", str(write_jsonl(tmp_path / "m.jsonl", math_rows(6))), holdout=2)
    probs = task.eval_problems(2)
    with RewardRunner(task, timeout_s=30.0) as runner:
        assert runner.score([(p.solution, p) for p in probs] + [("\\boxed{-1}", probs[0])]) == [1.0, 1.0, 0.0]
        assert runner.score([]) == []
    with pytest.raises(ValueError, match="after close"):
        runner.score([(probs[0].solution, probs[0])])

    class Local(ScriptedTask):  # a class inside a function cannot be pickled
        pass

    with pytest.raises(ConfigError, match="cannot be pickled"):
        RewardRunner(Local(), timeout_s=1.0)
    with pytest.raises(ConfigError, match="timeout_s"):
        RewardRunner(ScriptedTask(), timeout_s=0)


def test_runner_survives_a_dying_child() -> None:
    with RewardRunner(ScriptedTask(), timeout_s=30.0) as runner:
        assert runner.score(scripted("0.5", "exit", "1")) == [0.5, 0.0, 1.0]
        assert runner.stats["died"] == 1
        runner._children[0].proc.kill()  # dies between calls: found when the next chunk is sent
        runner._children[0].proc.join(10)
        assert runner.score(scripted("0.25")) == [0.25]
        assert runner.stats["died"] == 2 and runner.stats["restarts"] == 2
