"""`nitsum bench engine --device cpu --size tiny` (the dry run of the GPU benchmark) runs end to end: rows for
every concurrency, tokens/s of both sides, and in fp32 on the CPU the greedy streams equal transformers'."""

import json

from nitsum.cli import main


def test_bench_engine_device_dry_run_writes_rows(tmp_path, capsys):
    code = main(
        [
            "bench",
            "engine",
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--concurrency",
            "1,3",
            "--prompt-len",
            "8",
            "--max-tokens",
            "4",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "bench_engine_cpu.json").read_text())
    assert [r["concurrency"] for r in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["nitsum_tok_s"] > 0 and row["hf_batched_tok_s"] > 0
        assert row["same_streams"] == row["num_streams"]  # fp32 on the CPU: no bf16 near-ties
    assert report["machine"]["dtype"] == "float32" and report["machine"]["decode_attention"] == "gather"
    table = (tmp_path / "bench_engine_cpu.md").read_text()
    assert "| 3 |" in table and "--device cpu" in table
    assert "tok/s" in capsys.readouterr().out
