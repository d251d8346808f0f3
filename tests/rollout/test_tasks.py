"""The shipped task suite: well-formed, split, and every verifier proven by a known-good solution."""
from __future__ import annotations

import asyncio

import pytest

from services.rollout.tasks import TaskError, load_split, select
from services.rollout.verify import answer_matches, normalize
from services.rollout.tasks import AnswerCheck
from tests.rollout.fakes import LocalSandbox
from tests.rollout.solutions import replay

SEED = {"sha256_nano_miles", "numbers_file_lines", "kernel_name_lower", "python_product"}


def test_splits_are_disjoint_and_large_enough():
    train, held_out = load_split("train"), load_split("eval")
    assert SEED <= {t.id for t in train}
    assert len(train) + len(held_out) >= 34
    assert len(held_out) >= 8
    assert not {t.id for t in train} & {t.id for t in held_out}
    assert not {t.instruction for t in train} & {t.instruction for t in held_out}
    assert {t.difficulty for t in train} >= {1, 2, 3}
    cats = {t.category for t in train + held_out}
    assert {"files", "text", "pipes", "permissions", "archives", "processes", "environment", "python",
            "multi-step"} <= cats
    assert all(t.solution for t in train + held_out)


def test_select_and_bad_files(tmp_path, monkeypatch):
    assert [t.id for t in select("train", ["python_product", "sha256_nano_miles"])] == \
        ["python_product", "sha256_nano_miles"]
    with pytest.raises(TaskError, match="nope"):
        select("train", ["nope"])
    with pytest.raises(TaskError, match="known splits"):
        load_split("no_such_split")
    (tmp_path / "mine.jsonl").write_text('{"id": "a", "instruction": "x", "verify": [{"type": "answer"}]}\n')
    monkeypatch.setenv("RLYARD_TASKS_DIR", str(tmp_path))
    with pytest.raises(TaskError, match="exactly one of"):
        load_split("mine")
    (tmp_path / "mine.jsonl").write_text(
        '{"id": "a", "instruction": "x", "verify": [{"type": "answer", "expected": "1"}]}\n')
    assert load_split("mine")[0].id == "a"


def test_answer_matching():
    exact = AnswerCheck(type="answer", expected="apple", normalize=["strip", "lower", "strip_quotes"])
    assert answer_matches(' "Apple" ', exact, "apple")
    assert not answer_matches("apples", exact, "apple")
    assert not answer_matches(None, exact, "apple")
    rx = AnswerCheck(type="answer", match="regex", expected=r"16(\.0+)?")
    assert answer_matches("16.0", rx, r"16(\.0+)?") and not answer_matches("160", rx, r"16(\.0+)?")
    contains = AnswerCheck(type="answer", match="contains", expected="linux")
    assert answer_matches("the kernel is linux", contains, "linux")
    assert normalize("  a \n  b. ", ["collapse_ws", "strip_period"]) == "a b"


@pytest.mark.parametrize("split", ["train", "eval"])
async def test_every_verifier_passes_its_solution_and_fails_without_it(split):
    """Replayed in a local bash home; tests/rollout/test_real_sandbox.py repeats it in the real sandbox."""
    async def one(task):
        good, bad = LocalSandbox(), LocalSandbox()
        try:
            ok = await replay(task, good, True)
            ko = await replay(task, bad, False)
        finally:
            good.close()
            bad.close()
        return task.id, ok, ko

    results = await asyncio.gather(*(one(t) for t in load_split(split)))
    for task_id, ok, ko in results:
        assert ok.passed, f"{task_id}: solution rejected: {ok.notes}"
        assert not ko.passed, f"{task_id}: passes without doing anything"
