"""scripts/data/chat-prompts.jsonl, the chat workload of scripts/bench_sweep.py: varied prompts
of every kind, each a row vLLM's custom dataset reads (a `prompt`), follow-ups with the whole
conversation beside it."""

from __future__ import annotations

import json
from collections import Counter

from python_backends.config import PROJECT_ROOT

DATASET = PROJECT_ROOT / "scripts" / "data" / "chat-prompts.jsonl"
KINDS = {"question", "instruction", "code", "summary", "followup"}


def test_the_chat_dataset_is_varied_and_well_formed() -> None:
    rows = [json.loads(line) for line in DATASET.read_text().splitlines()]
    assert len(rows) >= 200
    kinds = Counter(r["kind"] for r in rows)
    assert set(kinds) == KINDS and min(kinds.values()) >= 20
    prompts = [r["prompt"] for r in rows]
    assert len(set(prompts)) == len(prompts) and all(p.strip() for p in prompts)
    for r in rows:
        if r["kind"] == "followup":
            turns = r["messages"]
            assert [m["role"] for m in turns] == ["user", "assistant", "user"]
            assert all(m["content"] in r["prompt"] for m in turns)
