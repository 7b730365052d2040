"""The arithmetic task and its tokenizer: pure functions, no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.task import (
    DIFFICULTIES,
    Problem,
    TaskDataError,
    gsm8k_reward,
    load_gsm8k_jsonl,
    make_problems,
    max_solution_chars,
    parse_final_answer,
    reward,
)
from workers.tokenizer import (
    ASCII_ALPHABET,
    DEFAULT_ALPHABET,
    CharTokenizer,
    TokenizerError,
)

# ---------------------------------------------------------------------------
# tokenizer


def test_round_trip_and_special_ids() -> None:
    tok = CharTokenizer()
    text = "Q: 23+58=? A: 23+58=81\n#### 81"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id == 1 and ids[-1] == tok.eos_id == 2 and tok.pad_id == 0
    assert len(ids) == len(text) + 2
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=False) == "<bos>" + text + "<eos>"
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.vocab_size == 4 + len(DEFAULT_ALPHABET)


def test_ids_are_fixed() -> None:
    # Trainer and Actors agree on ids without exchanging anything: pin a few.
    tok = CharTokenizer()
    assert tok.encode("0") == [4] and tok.encode("#") == [4 + DEFAULT_ALPHABET.index("#")]
    wide = CharTokenizer(ASCII_ALPHABET)
    # The wide alphabet extends the default one: default ids keep their meaning.
    assert wide.encode("Q: 1+2=?") == tok.encode("Q: 1+2=?")
    text = "Natalia sold 48/2 = 24 clips!"
    assert wide.decode(wide.encode(text)) == text


def test_unknown_characters() -> None:
    with pytest.raises(TokenizerError, match=r"'x' at position 3"):
        CharTokenizer().encode("Q: x")
    lax = CharTokenizer(strict=False)
    assert lax.encode("1x") == [lax.encode("1")[0], lax.unk_id]
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        lax.decode([lax.vocab_size])
    with pytest.raises(TokenizerError, match="repeats"):
        CharTokenizer("aba")


def test_save_load(tmp_path: Path) -> None:
    tok = CharTokenizer(ASCII_ALPHABET, strict=False)
    tok.save(tmp_path)
    back = CharTokenizer.load(tmp_path / "tokenizer.json")
    assert back == tok and back.encode("Hi 42!") == tok.encode("Hi 42!")
    (tmp_path / "bad.json").write_text('{"format": "something-else"}')
    with pytest.raises(TokenizerError, match="bad.json"):
        CharTokenizer.load(tmp_path / "bad.json")


# ---------------------------------------------------------------------------
# problems


@pytest.mark.parametrize("difficulty", sorted(DIFFICULTIES))
def test_problems_are_deterministic_and_solved(difficulty: int) -> None:
    a = make_problems(50, seed=3, difficulty=difficulty)
    assert a == make_problems(50, seed=3, difficulty=difficulty)
    assert a != make_problems(50, seed=4, difficulty=difficulty)
    assert len({p.id for p in a}) == 50
    tok = CharTokenizer()
    for p in a:
        assert p.prompt_text.startswith("Q: ") and p.prompt_text.endswith("=? A:")
        expr = p.prompt_text[3:-5]
        assert eval(expr) == p.answer  # noqa: S307 (digits and one operator)
        assert reward(p.solution, p.answer) == 1.0
        assert tok.decode(tok.encode(p.prompt_text + p.solution)) == p.prompt_text + p.solution
    assert max_solution_chars(a) <= 20


def test_make_problems_rejects() -> None:
    with pytest.raises(ValueError, match="difficulty"):
        make_problems(1, 0, difficulty=9)
    with pytest.raises(ValueError):
        make_problems(-1, 0)


# ---------------------------------------------------------------------------
# rewards


@pytest.mark.parametrize(
    ("text", "answer", "want"),
    [
        (" 23+58=81\n#### 81", 81, 1.0),
        (" 23+58=81\n#### 80", 81, 0.0),  # wrong
        (" 23+58=81", 81, 0.0),  # no marker
        ("", 81, 0.0),
        ("#### 81", 81, 1.0),
        ("####81", 81, 1.0),
        ("#### 1,234", 1234, 1.0),  # commas
        ("#### 1,234.", 1234, 1.0),  # a closing period
        ("####   81 \n\n", 81, 1.0),  # whitespace
        ("#### -7", -7, 1.0),
        ("#### 81\n#### 82", 81, 0.0),  # the last marker counts
        ("#### 82\n#### 81", 81, 1.0),
        ("#### 81 apples", 81, 0.0),  # not an integer answer
        ("#### 8.5", 8, 0.0),
        ("#### ", 0, 0.0),
        ("#### " + "9" * 5000, 0, 0.0),  # absurd length, refused without int()
    ],
)
def test_reward(text: str, answer: int, want: float) -> None:
    assert reward(text, answer) == want


def test_parse_final_answer() -> None:
    assert parse_final_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == 72
    assert parse_final_answer("no answer") is None


def test_gsm8k_reward() -> None:
    ref = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = <<48+24=72>>72\n#### 72"
    assert gsm8k_reward("She sold 72 in all.\n#### 72", ref) == 1.0
    assert gsm8k_reward("#### 7,2", ref) == 1.0  # commas are dropped, as in the reference
    assert gsm8k_reward("#### 71", ref) == 0.0
    assert gsm8k_reward("72", ref) == 0.0
    with pytest.raises(TaskDataError, match="no final"):
        gsm8k_reward("#### 72", "the answer is 72")


# ---------------------------------------------------------------------------
# GSM8K JSONL


def test_load_gsm8k_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    rows = [
        {"question": "What is 2+3?", "answer": "2+3=<<2+3=5>>5\n#### 5"},
        {"question": " Big? ", "answer": "It is big.\n#### 1,000", "id": "q-big"},
    ]
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    got = load_gsm8k_jsonl(path)
    assert got == [
        Problem("train.jsonl:1", "Q: What is 2+3? A:", 5, " 2+3=5\n#### 5"),
        Problem("q-big", "Q: Big? A:", 1000, " It is big.\n#### 1,000"),
    ]
    assert reward(got[1].solution, got[1].answer) == 1.0
    assert len(load_gsm8k_jsonl(path, limit=1)) == 1


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"answer": "#### 1"}', "field 'question' is missing"),
        ('{"question": "q", "answer": 5}', "field 'answer' must be a string, got int"),
        ('{"question": "q", "answer": "five"}', "no final '#### <int>'"),
    ],
)
def test_bad_jsonl_line_is_named(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "data.jsonl"
    good = json.dumps({"question": "q", "answer": "#### 1"})
    path.write_text(f"{good}\n{good}\n{line}\n{good}\n")
    with pytest.raises(TaskDataError, match=match) as info:
        load_gsm8k_jsonl(path)
    assert f"{path}:3:" in str(info.value)
    assert isinstance(info.value, ValueError)
