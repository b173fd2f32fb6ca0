"""The MoE cases of the benchmarks: ``common.moe_ref`` (the update reference shape as a
Qwen3-MoE of the same active size) and the flags that select them (no benchmark is run)."""

import pytest

from jaxrlvr.bench import common, memory, update


def test_moe_ref_matches_update_ref_active_size():
    moe, dense = common.moe_ref(), common.update_ref()
    assert moe.is_moe and moe.num_experts == 16 and moe.num_experts_per_tok == 4
    # A token's MLP is 4 experts x 352 = update_ref's 1,408; QK-norm adds 2 x 64 per layer.
    assert moe.num_experts_per_tok * moe.moe_intermediate_size == dense.intermediate_size
    assert abs(moe.num_params(active=True) / dense.num_params() - 1) < 0.005
    assert moe.num_params() > 2.5 * moe.num_params(active=True)


def test_update_shapes_are_exclusive(capsys):
    with pytest.raises(SystemExit) as info:
        update.main(["--tiny", "--moe"])
    assert info.value.code == 2
    assert "--tiny, --demo, --demo-moe and --moe are shapes: choose one" in capsys.readouterr().err


def test_memory_model_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        memory.main(["--model", "qwen3-8b"])
    assert "--model: 'qwen3-8b' is not one of qwen2.5-math-1.5b, qwen3-1.7b, qwen3-30b-a3b" in (
        capsys.readouterr().err
    )
    cfg = memory.real_model("qwen3-30b-a3b")
    assert cfg.moe_impl == "ragged_dot" and cfg.num_experts == 128 and not cfg.tie_word_embeddings
    assert memory.real_model("qwen3-1.7b").tie_word_embeddings
