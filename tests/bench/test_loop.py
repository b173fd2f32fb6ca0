"""``jaxrlvr bench loop`` end to end in short mode: both systems (jaxrlvr train and TRL's
GRPOTrainer) from one warm start, the table and the JSON records, and bad rows refused."""

import json
import os

import pytest
import runs

from jaxrlvr.bench import loop

# The subprocess runs' tiny model (1 layer, hidden 32): the loop's plumbing is under test, not
# the demo model's speed, and at the demo's size both systems' compiles dominate CI time.
TINY = [
    *(f"--set={o}" for o in runs.TINY_MODEL),
    "--set=sft.steps=8",
    "--set=rl.prompts_per_step=4",
    "--set=eval.max_problems=8",
    "--set=eval.samples_per_problem=2",
]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
    """``jaxrlvr bench loop --whole-run`` (three fresh processes, one after another) started in
    the background when the first test that needs it starts, so that it runs alongside the
    short loop: each process is mostly one core's work and CI has two. Yields (out dir,
    process)."""
    pytest.importorskip("trl")
    out = tmp_path_factory.mktemp("loop") / "whole"
    sets = [*TINY, "--set=rl.steps=2", "--set=eval.every=1", "--set=checkpoint.every=2"]
    proc = runs.launch("bench", "loop", "--whole-run", "--out", str(out), *sets, pipe=False)
    yield out, proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.mark.slow
def test_short_loop_runs_both_systems(whole_run, tmp_path):  # whole_run goes on alongside
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
    # Private on purpose: the --row parser alone, without starting the runs ``main`` would.
    import argparse

    row = loop._parse_row(argparse.ArgumentParser(), "k1:rl.max_staleness=1,sampler.kind=jax")
    assert row == loop.Row("k1", "jaxrlvr", ("rl.max_staleness=1", "sampler.kind=jax"))
    row = loop._parse_row(argparse.ArgumentParser(), "t:trl,rl.group_size=4")
    assert row.system == "trl" and row.overrides == ("rl.group_size=4",)


@pytest.mark.slow
def test_whole_run_three_fresh_processes(whole_run):
    """--whole-run: jaxrlvr with an empty compile cache, TRL's SFT + GRPO + evaluations, jaxrlvr
    again: the second jaxrlvr process compiles nothing (every program it compiled the first time
    is loaded from the cache) and reaches the same accuracy (same programs, same seeds)."""
    out, proc = whole_run
    runs.wait(proc)  # exit status 0
    result = json.loads((out / "whole_run.json").read_text())
    first, trl, second = result["records"]
    assert [first["label"], trl["label"], second["label"]] == [
        "jaxrlvr_first",
        "trl",
        "jaxrlvr_second",
    ]
    assert first["compile"]["compiles"] > 0 and first["compile"]["cache_hits"] == 0
    assert second["compile"]["compiles"] == 0
    assert second["compile"]["cache_hits"] == first["compile"]["compiles"]
    assert second["eval_final"] == first["eval_final"]
    assert second["eval_after_sft"] == first["eval_after_sft"]
    for r in (first, trl, second):
        assert r["wall_s"] > 0 and r["sft_s"] > 0 and r["grpo_s"] > 0
        assert 0.0 <= r["eval_final"] <= 1.0 and 0.0 <= r["eval_after_sft"] <= 1.0
    # TRL evaluated after SFT and after each of its 2 GRPO steps (eval.every=1), as jaxrlvr does.
    own = json.loads((out / "trl" / "record.json").read_text())["own_evals"]
    assert [(e["phase"], e["step"]) for e in own] == [("sft", 8), ("rl", 1), ("rl", 2)]
    ratios = result["meta"]["ratios"]
    assert ratios["trl_over_first_wall"] == pytest.approx(trl["wall_s"] / first["wall_s"])
    assert set(result["meta"]["matmul_gflops"]) == {"jax", "torch"}
    assert "Whole run, TRL / jaxrlvr" in (out / "whole_run.md").read_text()


def test_init_weights_are_the_runs_random_init(tmp_path):
    """The TRL row's initial weights (the folder init_weights writes) are the ones jaxrlvr train
    builds from run.seed: loaded back, every parameter equal (exact: a float32 round trip)."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxrlvr import builders
    from jaxrlvr import config as config_lib
    from jaxrlvr import model as model_lib

    path = loop.init_weights("configs/demo.yaml", [], str(tmp_path))
    cfg = config_lib.load_config("configs/demo.yaml", [])
    tok = builders.build_tokenizer(cfg.model)
    mesh = model_lib.make_mesh(None, jax.devices()[:1])
    ours = nnx.state(builders.build_model(cfg.model, tok, mesh, seed=cfg.run.seed), nnx.Param)
    loaded = nnx.state(model_lib.load_hf(path, mesh=mesh), nnx.Param)
    a, b = jax.tree.leaves(ours), jax.tree.leaves(loaded)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_whole_markdown_tables_and_ratios():
    """The whole-run table: one line per row in both tables, the ratios as computed."""

    def rec(label, system, wall, step, compile_=None):
        return {
            "label": label,
            "system": system,
            "wall_s": wall,
            "sft_s": 10.0,
            "grpo_s": 50.0,
            "eval_s": None,
            "step_median_s": step,
            "first_grpo_step_s": 5.0,
            "compile": compile_,
            "eval_after_sft": 0.3,
            "eval_final": 0.5,
            "phase_median_s": {k: 0.01 for k in loop.PHASES},
        }

    c = {"compiles": 29, "compile_s": 13.0, "cache_hits": 0, "cache_load_s": 0.0}
    records = [
        rec("jaxrlvr_first", "jaxrlvr", 100.0, 0.2, c),
        rec("trl", "trl", 150.0, 0.45),
        rec("jaxrlvr_second", "jaxrlvr", 80.0, 0.2, dict(c, compiles=0, cache_hits=29)),
    ]
    meta = {
        "ratios": {
            "trl_over_first_wall": 1.5,
            "trl_over_second_wall": 1.875,
            "first_over_second_wall": 1.25,
            "trl_over_first_median_step": 2.25,
            "trl_over_second_median_step": 2.25,
            "accuracy_first_minus_trl": 0.0,
            "accuracy_second_minus_trl": 0.0,
        },
        "matmul_gflops": {"jax": 180.0, "torch": 240.0},
        "config": "configs/demo.yaml",
        "sets": [],
        "machine": "x86_64, 2 cores",
        "load_before": "0.1",
        "load_after": "0.2",
    }
    table = loop.whole_markdown(records, meta)
    for label in ("jaxrlvr_first", "trl", "jaxrlvr_second"):
        assert table.count(f"| {label} |") == 2  # the run table and the phase table
    assert "| 29 / 13.0 | 0 / 0.0 |" in table and "| 0 / 13.0 | 29 / 0.0 |" in table
    assert "1.50x (first run), 1.88x (second run)" in table
    assert "jax 180 GFLOP/s, torch 240 GFLOP/s" in table
