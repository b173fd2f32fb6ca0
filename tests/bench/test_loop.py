"""``jaxrlvr bench loop`` end to end in short mode: both systems (jaxrlvr train and TRL's
GRPOTrainer) from one warm start, the table and the JSON records, and bad rows refused."""

import json
import os

import pytest

from jaxrlvr.bench import loop

TINY = [
    "--set=sft.steps=8",
    "--set=rl.prompts_per_step=4",
    "--set=eval.max_problems=8",
    "--set=eval.samples_per_problem=2",
]


@pytest.mark.slow
def test_short_loop_runs_both_systems(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "loop"
    assert loop.main(["--steps", "2", "--out", str(out), *TINY]) == 0
    result = json.loads((out / "loop.json").read_text())
    records = {r["label"]: r for r in result["records"]}
    assert set(records) == {"jaxrlvr", "trl"}
    for r in records.values():
        assert len(r["steps"]) == 2  # one record per GRPO step
        s = r["summary"]
        assert s["steps_per_s"] > 0 and s["rollout_tokens"] > 0
        assert 0.0 <= r["eval_final"] <= 1.0
        assert r["eval_start"] == records["jaxrlvr"]["eval_start"]  # one warm start
        for phase in ("sample", "reward", "update"):
            assert s["median_s"][phase] > 0
    # 4 prompts x 8 per step: the token counts are completions' lengths (1..12 tokens).
    for r in records.values():
        for n in r["response_tokens"]:
            assert 32 <= n <= 32 * 12
    table = (out / "loop.md").read_text()
    assert "| jaxrlvr |" in table and "| trl |" in table and "jaxrlvr / trl" in table
    assert os.path.isdir(out / "warm_start_hf")


def test_bad_rows_and_overrides_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        loop.main(["--row", "k1", "--out", str(tmp_path)])
    assert "expected LABEL:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        loop.main(["--row", "x:nosuch,rl.steps=1", "--out", str(tmp_path)])
    assert "is not one of" in capsys.readouterr().err
    with pytest.raises(Exception, match="no_such_key"):
        loop.main(["--set", "rl.no_such_key=1", "--out", str(tmp_path)])


def test_rows_take_their_overrides():
    import argparse

    row = loop._parse_row(argparse.ArgumentParser(), "k1:rl.max_staleness=1,sampler.kind=jax")
    assert row == loop.Row("k1", "jaxrlvr", ("rl.max_staleness=1", "sampler.kind=jax"))
    row = loop._parse_row(argparse.ArgumentParser(), "t:trl,rl.group_size=4")
    assert row.system == "trl" and row.overrides == ("rl.group_size=4",)
