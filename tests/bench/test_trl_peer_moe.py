"""The TRL peer on a Qwen3-MoE runs without the router's auxiliary loss: TRL 1.16 trains it
whenever the coefficient is non-zero (the model config's 0.001 unless the trainer's config says
otherwise), which jaxrlvr's MoE demo does not; ``trl_peer.assert_no_aux_loss`` checks it. The
peer's record names an experts kernel for a MoE model only."""

import pytest

from jaxrlvr.bench import trl_peer
from tests.model.helpers import make_torch_model


@pytest.mark.slow  # imports TRL and builds two trainers: 40 s at load ~20
def test_aux_loss_is_off_in_the_peers_grpo_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    import datasets
    import transformers

    from jaxrlvr import builders
    from jaxrlvr import config as config_lib

    cfg = config_lib.load_config("configs/demo_moe.yaml", [])
    tokenizer = builders.build_tokenizer(cfg.model)
    model = make_torch_model(tie=True, family="qwen3_moe", vocab_size=len(tokenizer))
    assert isinstance(model, transformers.Qwen3MoeForCausalLM)
    assert model.config.router_aux_loss_coef > 0  # the architecture's own default

    def trainer(**kw):
        args = trl.GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=4,
            use_cpu=True,
            report_to=[],
            **kw,
        )
        data = datasets.Dataset.from_list([{"prompt": "1+1="}, {"prompt": "2+2="}])
        return trl.GRPOTrainer(
            model=model,
            reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
        )

    with pytest.raises(RuntimeError, match="router aux loss"):
        trl_peer.assert_no_aux_loss(trainer())  # TRL's default: on for a MoE
    trl_peer.assert_no_aux_loss(trainer(router_aux_loss_coef=0.0))  # the peer's setting


def test_experts_kernel_is_named_for_a_moe_model_only():
    pytest.importorskip("transformers")
    moe = make_torch_model(tie=True, family="qwen3_moe", vocab_size=32)
    dense = make_torch_model(tie=True, vocab_size=32)
    assert trl_peer.experts_implementation(moe.config) == "grouped_mm"  # transformers' default
    assert getattr(dense.config, "_experts_implementation", None) is not None  # what misled it
    assert trl_peer.experts_implementation(dense.config) is None
