"""``jaxrlvr bench update --lengths r1zero``: heavy-tailed response lengths, the same rollouts
packed for jaxrlvr and padded (as TRL pads) for the PyTorch reference."""

import json
import subprocess
import sys

import numpy as np
import pytest

from jaxrlvr.bench import update


def test_r1zero_lengths_and_both_layouts_hold_the_same_rollouts():
    shape = update.Shape(**update.SHAPES["reference"])
    lengths = update.r1zero_lengths(shape)
    assert lengths.min() >= 8 and lengths.max() <= shape.response
    assert 0.5 * shape.response / 4 < np.median(lengths) < 2 * shape.response / 4
    padded = update.make_r1zero_batch(shape, 8192, packed=False)
    packed = update.make_r1zero_batch(shape, 8192, packed=True)
    # TRL-style padding: one rollout per row, right-padded to the longest of the batch.
    assert padded["input_ids"].shape == (shape.batch, shape.prompt + lengths.max())
    assert padded["num_microbatches"] == shape.microbatches
    # Same real tokens and loss tokens; packed rows of the reference's row length, microbatches
    # of at most the reference's rows.
    for key in ("attention_mask", "loss_mask"):
        assert padded[key].sum() == packed[key].sum()
    rows, t = packed["input_ids"].shape
    assert t == shape.seq and rows < shape.batch
    assert rows % packed["num_microbatches"] == 0
    assert rows // packed["num_microbatches"] <= shape.batch // shape.microbatches
    # Each packed segment holds exactly the tokens of one padded row.
    seqs_padded = sorted(
        tuple(r[m.astype(bool)]) for r, m in zip(padded["input_ids"], padded["attention_mask"])
    )
    seqs_packed = sorted(
        tuple(r[s == k])
        for r, s in zip(packed["input_ids"], packed["segment_ids"])
        for k in range(1, s.max() + 1)
    )
    assert seqs_packed == seqs_padded


@pytest.mark.slow  # a worker process compiling a tiny packed update
def test_bench_update_r1zero_tiny_runs(tmp_path):
    out = tmp_path / "update.json"
    cmd = [sys.executable, "-m", "jaxrlvr.bench.update", "--tiny", "--lengths", "r1zero"]
    cmd += ["--systems", "jaxrlvr", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (rec,) = json.loads(out.read_text())
    assert rec["lengths"] == "r1zero" and rec["tokens_per_s"] > 0
    assert rec["tokens_per_step"] <= rec["computed_tokens_per_step"]
