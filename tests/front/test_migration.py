"""Where a request goes when its engine is lost, and how often it may move."""

from __future__ import annotations

from python_backends.front.migration import MigrationBudget, MigrationReason, next_engine

DIED, UNAVAILABLE = MigrationReason.ENGINE_DIED, MigrationReason.ENGINE_UNAVAILABLE


def test_after_a_death_the_same_model_is_preferred_while_it_has_a_live_instance() -> None:
    live = {"worker": True, "decode": True}
    assert next_engine("worker", ["decode"], DIED, live.__getitem__) == "worker"
    live["worker"] = False
    assert next_engine("worker", ["decode"], DIED, live.__getitem__) == "decode"
    live["decode"] = False
    assert next_engine("worker", ["decode"], DIED, live.__getitem__) is None


def test_after_a_broken_engine_the_other_path_is_preferred() -> None:
    live = {"worker": True, "decode": True}
    assert next_engine("worker", ["decode"], UNAVAILABLE, live.__getitem__) == "decode"
    assert next_engine("decode", ["worker"], MigrationReason.INSTANCE_DOWN,
                       live.__getitem__) == "worker"
    live["decode"] = False  # the only live engine is the one that failed: try it again
    assert next_engine("worker", ["decode"], UNAVAILABLE, live.__getitem__) == "worker"


def test_disabled_paths_are_skipped() -> None:
    assert next_engine("worker", [""], DIED, lambda m: m != "worker") is None


def test_the_budget_allows_limit_moves() -> None:
    budget = MigrationBudget(2)
    assert budget.spend() and budget.spend() and not budget.spend()
    assert budget.moves == 2
