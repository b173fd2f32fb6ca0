"""The training run's configuration: one frozen dataclass per concern, composed by ``TrainConfig``.

YAML files in configs/ fill these classes (through ``configlib``); ``key=value`` overrides on the
command line use the same dotted paths (``rl.group_size=8``). Sections reuse the library's own
config classes where one exists (``PolicyLossConfig``, ``AdvantageConfig``, ``OptimizerConfig``,
``MeshConfig``, ``DistributedConfig``) rather than re-declaring their fields.

The sections are plain records: a ``__post_init__`` here only normalises a value's type or
spelling. Their checks, and those of the sections against each other, are one function at the
end of this module (``check_config``, in ``TrainConfig``'s field order), which ``TrainConfig``
runs when it is made; what the config needs of the world (files, the hub, servers, the mesh) is
``preflight``'s. The library's classes keep their own invariants (they are used without a run).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from jaxrlvr import configlib
from jaxrlvr.algos import loss_config, registry, routing
from jaxrlvr.algos.optim import OptimizerConfig
from jaxrlvr.data.multiplication import MultiplicationConfig
from jaxrlvr.data.scratchpad import ScratchpadConfig
from jaxrlvr.data.synthetic import SyntheticConfig
from jaxrlvr.data.synthetic_code import SyntheticCodeConfig
from jaxrlvr.distributed import DistributedConfig
from jaxrlvr.model.config import MoEImpl, dtype_name
from jaxrlvr.model.lora import LoRAConfig
from jaxrlvr.model.sharding import MeshConfig
from jaxrlvr.rewards.code import CodeRewardConfig
from jaxrlvr.rewards.language import LanguageRewardConfig
from jaxrlvr.sandbox.host import SandboxKind


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where the run writes, and its seed. ``compile_cache``: JAX's persistent compilation cache
    (``compile_cache``): "auto" (``$JAXRLVR_COMPILE_CACHE``, else ~/.cache/jaxrlvr/jax-compile),
    "off", or a directory; a second run of the same config then loads its programs instead of
    compiling them. ``compile_ahead``: after the run's first step, the JAX sampler's later
    programs (the evaluation's, the RL phase's rollouts) and the next phase's first-step
    programs are compiled on a background thread while the first phase trains; a first step
    that samples nothing runs beside their lowering (``phases.ahead``)."""

    out_dir: str = "runs/run"
    seed: int = 0
    tensorboard: bool = True
    progress: bool = True
    compile_cache: str | bool = "auto"  # YAML's off/false read as False: the same as "off"
    compile_ahead: bool = True

    def __post_init__(self):
        if isinstance(self.compile_cache, bool):
            object.__setattr__(self, "compile_cache", "auto" if self.compile_cache else "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
    """The policy: a Hugging Face checkpoint (``path``) or a random Qwen2 of the given shape.

    ``tokenizer``: a tokenizer directory, or "char" for jaxrlvr's local character tokenizer
    (the demo's); defaults to ``path``. ``remat`` and ``scan_layers``: the layer-loop choices of
    ``model.ModelConfig`` (scan: compile time independent of depth; unrolled: a faster step).
    """

    path: str | None = None
    tokenizer: str | None = None
    dtype: str = "float32"  # any spelling model.dtype_name accepts ("bf16", "bfloat16", ...)
    param_dtype: str = "float32"
    # The lm_head's product dtype (``model.ModelConfig.lm_head_dtype``): "float32" with a
    # bfloat16 ``dtype`` is the FP32 LM head of ScaleRL / MiniMax-M1; null: ``dtype``.
    lm_head_dtype: str | None = None
    remat: bool = False
    scan_layers: bool = True
    # Attention over blocks of this many query positions, one at a time (memory-efficient
    # attention for long rows, ``model.ModelConfig.attention_query_chunk``); null: all at once.
    attention_query_chunk: int | None = None
    # The MoE block's kernel (``model.ModelConfig.moe_impl``: auto, block_loop, sorted_blocks,
    # dense, ragged_dot); auto picks by backend, and on the CPU by shape (docs/moe.md).
    moe_impl: MoEImpl = "auto"
    # Low-rank adapters (``model.lora.LoRAConfig``: rank, alpha, dropout, targets, use_rslora):
    # every phase then trains only the adapters of a frozen base (docs/lora.md); null: full.
    lora: LoRAConfig | None = None
    # Shape of a randomly initialised model (used when ``path`` is None).
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    # The random model's family (``model.ModelConfig``): "qwen2", "qwen3" or "qwen3_moe" (then
    # ``num_experts`` experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` of them
    # per token; layer i is sparse iff i is not in ``mlp_only_layers`` and (i + 1) %
    # ``decoder_sparse_step`` == 0, else a dense MLP of width intermediate_size); ``head_dim``:
    # null is hidden_size / num_attention_heads. A checkpoint's come from its config.json.
    model_type: str = "qwen2"
    head_dim: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # MoE checkpoints: add router_aux_loss_coef x the load-balancing loss to every update
    # (``model.ModelConfig.router_aux_loss``); off by default, as RL stacks run it.
    router_aux_loss: bool = False

    def __post_init__(self):
        # Normalised once, at construction (the frozen instance is never changed afterwards).
        object.__setattr__(self, "dtype", dtype_name(self.dtype, argument="model.dtype"))
        object.__setattr__(
            self, "param_dtype", dtype_name(self.param_dtype, argument="model.param_dtype")
        )
        if self.lm_head_dtype is not None:
            name = dtype_name(self.lm_head_dtype, argument="model.lm_head_dtype")
            object.__setattr__(self, "lm_head_dtype", name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataSection:
    """Problems with checkable answers.

    ``train`` / ``eval``: "synthetic" (the seeded arithmetic task), "scratchpad" (the seeded
    arithmetic task with written work, ``data.scratchpad``), "multiplication" (3-4 digit
    products, solved with the Python tool: ``data.multiplication``, ``env.tools``), a local
    jsonl/parquet file, or a hub dataset name; the generated tasks' sizes are
    ``synthetic_train_size`` and ``synthetic_eval_size``; with a generated ``train``, a file in
    ``eval`` replaces the task's own held-out split. ``template``: the prompt template.
    ``gold_format``: the completion an
    SFT warm start ("gold" data) learns for a problem, ``{answer}`` replaced by its answer and
    ``{solution}`` by its worked solution (``Problem.solution``). ``shards``: the training items
    are split by the seed into this many data shards, each process reading only its own
    (``data.shards``; None: one per process row block, i.e. the process count when the batch
    axes span the processes); a step takes ``rl.prompts_per_step / shards`` prompts from each.

    ``domain``: the domain of these problems (``Problem.domain``) where a data file's ``domain``
    column gives none; on-policy distillation's ``rl.distill.teachers`` routes by it (None: the
    "default" teacher). ``mixture``: several tasks in one run (``DataMixtureSource``: a domain,
    its own ``data`` and ``reward`` sections); every problem of a source has the source's domain,
    is graded by its reward and warm-started with its ``gold_format``; the training and held-out
    problems are the sources' concatenated (the top-level ``train``, ``eval`` and ``reward.fn``
    are then unused; ``template`` applies to all).
    """

    train: str = "synthetic"
    eval: str | None = None
    split: str = "train"
    eval_split: str = "test"
    question_field: str = "problem"
    answer_field: str | None = "answer"
    solution_field: str | None = "solution"
    on_bad_row: Literal["skip", "raise"] = "skip"
    template: Literal["r1_zero", "question_only", "chat"] = "r1_zero"
    synthetic: SyntheticConfig = dataclasses.field(default_factory=SyntheticConfig)
    scratchpad: ScratchpadConfig = dataclasses.field(default_factory=ScratchpadConfig)
    multiplication: MultiplicationConfig = dataclasses.field(default_factory=MultiplicationConfig)
    # Code problems: "synthetic_code" (``train``) draws ``synthetic_code``; ``code_layout``
    # ("mbpp" | "humaneval") reads ``train``/``eval`` as jsonl files of that layout.
    synthetic_code: SyntheticCodeConfig = dataclasses.field(default_factory=SyntheticCodeConfig)
    code_layout: Literal["mbpp", "humaneval"] | None = None
    synthetic_train_size: int = 2000
    synthetic_eval_size: int = 200
    gold_format: str = " <answer>{answer}</answer>"
    shards: int | None = None
    domain: str | None = None
    mixture: tuple[DataMixtureSource, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSection:
    """The verifier (``fn``) and its grading pool. ``fn: code`` runs each response's program
    against the problem's tests in a sandbox: ``sandbox`` ("bwrap", bubblewrap; "none" runs
    model-written code unsandboxed, with a warning) and ``code`` (pass fraction or all-pass,
    and the sandbox's time, memory, process, file and output limits; docs/code.md).
    ``language``: DeepSeek-R1's language-consistency reward, ``weight`` x the share of the
    reasoning's words in ``target`` added to the reward (``rewards.language``; weight 0: off)."""

    fn: Literal["r1_zero", "question_only", "gsm8k", "synthetic", "code"] = "r1_zero"
    format_weight: float = 0.0
    timeout_s: float = 5.0
    num_workers: int = 2
    sandbox: SandboxKind = "bwrap"
    code: CodeRewardConfig = dataclasses.field(default_factory=CodeRewardConfig)
    language: LanguageRewardConfig = dataclasses.field(default_factory=LanguageRewardConfig)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataMixtureSource:
    """One task of ``data.mixture``: its problems (``data``: a ``DataSection`` whose ``train``,
    ``eval``, sizes and ``gold_format`` apply), their verifier (``reward``) and their domain."""

    domain: str
    data: DataSection = dataclasses.field(default_factory=lambda: DataSection())
    reward: RewardSection = dataclasses.field(default_factory=lambda: RewardSection())


VLLMDevice = Literal["auto", "cpu", "cuda"]
VLLMDType = Literal["auto", "float32", "bfloat16"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplerSection:
    """Rollouts: the embedded JAX sampler or vLLM servers (``vllm_urls``, or one jaxrlvr starts
    with ``vllm_python``).

    ``vllm_host``: where a server jaxrlvr starts listens. It runs in vLLM's development mode
    (per-step weight reload needs it), whose endpoints run methods on the workers, so a
    non-loopback address is refused unless ``vllm_allow_remote_dev_endpoints`` says the network
    is trusted.

    GPU placement of the servers jaxrlvr starts (``jaxrlvr.placement``; README "Running on GPUs"):
    ``vllm_device``: "cpu", "cuda", or "auto" (cuda when GPUs are visible and ``JAX_PLATFORMS``
    does not pin JAX to the CPU). ``vllm_gpus``: GPU numbers (positions in the GPUs visible at
    start) the servers get, split into ``vllm_num_servers`` equal groups, one server with
    ``--tensor-parallel-size`` = group size per group; default: the last ``vllm_num_servers`` GPUs
    (all GPUs when colocated). The trainer's JAX sees the other GPUs only, unless
    ``vllm_colocate``: then trainer and servers share GPUs, JAX keeps
    ``vllm_trainer_memory_fraction`` of each (default 0.5) and each server
    ``vllm_gpu_memory_utilization`` (default 0.35; 0.9 on GPUs of its own).
    ``vllm_dtype``: "auto" (float32 on the CPU, bfloat16 on GPUs), "float32" or "bfloat16"; the
    per-step weight export uses it too. ``vllm_extra_args``: more api_server flags.
    ``eval_temperature``, ``eval_top_p``, ``eval_max_tokens`` (None: ``max_tokens``): the held-out
    evaluation's sampling (top-k off); ``jaxrlvr eval --temperature --top-p --max-tokens`` set them.
    """

    kind: Literal["jax", "vllm"] = "jax"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 128
    stop: tuple[str, ...] = ("</answer>",)
    thinking_budget: int | None = None
    eval_temperature: float = 0.0
    eval_top_p: float = 1.0
    eval_max_tokens: int | None = None
    vllm_urls: tuple[str, ...] = ()
    vllm_python: str | None = None
    vllm_max_model_len: int = 2048
    vllm_restart: bool = True
    vllm_host: str = "127.0.0.1"
    vllm_allow_remote_dev_endpoints: bool = False
    vllm_device: VLLMDevice = "auto"
    vllm_gpus: tuple[int, ...] = ()
    vllm_num_servers: int = 1
    vllm_gpu_memory_utilization: float | None = None
    vllm_dtype: VLLMDType = "auto"
    vllm_extra_args: tuple[str, ...] = ()
    vllm_colocate: bool = False
    vllm_trainer_memory_fraction: float | None = None
    # The JAX sampler's own devices: the last ``jax_devices`` of the host run the sampler (a
    # sub-mesh of their own, fsdp over them), the trainer's mesh takes the rest; weights are
    # copied across after each update. 0: the sampler runs on the trainer's mesh. With
    # ``rl.max_staleness`` > 0 this lets sampling and training run at the same time.
    jax_devices: int = 0
    # The JAX sampler's compute dtype when it should differ from the model's ("bfloat16" against
    # a float32 trainer: the mismatch of GPU RL stacks; docs/experiments/routing_replay.md).
    jax_dtype: Literal["float32", "bfloat16"] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTSection:
    """Supervised warm start (or the whole run when ``rl.algo`` is "none").

    ``data``: "gold" (train problems with their reference completions) or a jsonl file with
    prompt/response fields. ``packing`` / ``max_tokens_per_row``: as in ``RLSection``.
    """

    steps: int = 0
    batch_size: int = 32
    microbatches: int = 1
    # Positions per lm_head/log-softmax chunk (``sft.SFTUpdateConfig.logprob_chunk_size``):
    # bounds the [tokens, V] float32 logits; None computes them whole.
    logprob_chunk_size: int | None = None
    packing: bool = True
    max_tokens_per_row: int | None = None
    data: str = "gold"
    prompt_field: str = "prompt"
    response_field: str = "response"
    optim: OptimizerConfig = dataclasses.field(default_factory=lambda: OptimizerConfig())


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLFields:
    """The RL phase: algorithm, batch shape, estimators and the field's data-side options.

    ``algo``: a registered method (``algos.registry``: grpo, ppo, distill, expert_iteration, the
    offline preference methods, ...) or "none" (an SFT-only run). Each method with a config
    record of its own has it at ``rl.<method>`` (``rl.ppo``, ``rl.distill``, ...): ``RLSection``
    is these fields plus one such field per registered record.

    ``packing``: several rollouts per row (segment ids, per-segment positions; exact: the same
    loss and gradient as one rollout per padded row), rows of ``max_tokens_per_row`` positions
    (default: the length bucket of the step's longest rollout), the row count rounded up to a
    bucket that ``microbatches`` x the mesh's batch shards divides (``rollout.row_bucket``).
    Off: one rollout per row, right-padded to the length bucket.

    ``share_prompts`` (packed rows only, like ``max_tokens_per_row``; without packing and in
    the preference phases it does nothing): each prompt's ``group_size`` rollouts are packed as one
    block, the prompt laid out once and each completion after it in a segment of its own that
    attends to it (``rollout.pack``, ``model.qwen2``): the update and the log-prob passes
    compute a prompt's positions once per group instead of once per rollout, with the same
    log-probs, loss and gradient (float summation order aside). A block is at most
    ``max_tokens_per_row`` positions (default: its length bucket), so rows hold whole groups and
    are as long as a prompt plus ``group_size`` completions; attention is dense within a row, so
    it pays where prompts are a large share of a rollout (the demo: 60 %), while with long
    completions the longer rows' attention can cost more than the prompt copies it saves.

    ``drop_zero_variance_groups``: a group whose rewards are all equal (advantage 0 for every
    completion) leaves the loss: its tokens' loss weights are 0, so it adds nothing to a token
    mean's or a prompt mean's count (ScaleRL's zero-variance filtering; with the seq_mean
    aggregations B still counts its sequences). ``retire_pass_rate`` (ScaleRL's
    No-Positive-Resampling; null: off): a prompt whose group's pass rate (mean ``answer_reward``)
    reaches it in a step is never drawn again (``data.iterators.PromptIterator.retire``; saved in
    the checkpoint's data state; not with ``curriculum``); ``data/retired`` counts them. With
    ``loss.aggregation`` "prompt_mean_token_mean" (ScaleRL's prompt-level averaging) a group is
    told apart by its shared prompt, so it needs ``packing`` and ``share_prompts``.

    ``max_tokens_per_microbatch`` (packing only): a token budget instead of a fixed
    ``microbatches``. Each step then takes the fewest microbatches (from the buckets 1, 2, 3, 4,
    6, 8, 12, ...) whose rows x the step's row length T stay within the budget, with rows per
    microbatch a multiple of the mesh's batch shards (the budget counts the positions of one
    microbatch over all of them), and pads the row count with all-padding rows so that it
    divides (``rollout.budget_rows``). The update and the old/reference log-prob passes run in
    that many microbatches (exact gradient accumulation: the same update as one microbatch),
    compiled once per count and row bucket; the count is logged as ``tokens/microbatches``.
    ``microbatches`` stays 1 then. None: ``microbatches`` microbatches every step.

    ``max_staleness`` (k): asynchronous rollouts (``jaxrlvr.phases.producer``; docs/async.md).
    0 is the synchronous loop. With k > 0 the batch of step t + k is generated while step t
    updates, by the weights of version t (the policy after t updates), so every batch from step
    k on is exactly k versions old (step t < k: t versions). ``off_policy_correction``: with
    k > 0 and ``loss.correction.mode`` "none", token-level truncation of pi_old / pi_sampler at
    2 (``CorrectionConfig(mode="truncate")``) is used; set ``loss.correction`` to choose the
    source, level and mode (docs/corrections.md), or this to false to train without one.
    ``behaviour_logprobs``: with k > 0, keep the parameter versions that sampled the pending
    batches (up to k + 1 copies of the parameters) and recompute each stale batch's log-probs
    under its own version (one extra log-prob pass per step): the correction's "engine" and
    "staleness" sources and their separate diagnostics need it. False: neither source is
    available (only "both"), and the staleness diagnostics read 0.

    ``routing_replay`` (MoE models; ``algos.routing``): "none" trains on the live top-k
    experts, "r3" replays the experts the sampler recorded for each rollout (the JaxSampler
    records them; a vLLM server must return them), "r2" the trainer's own experts of the batch
    under the parameters before the step (fixed across its epochs); on a dense model r3 / r2
    are refused. ``routing_metrics`` (``passes.routing_replay``): "basic" reports the
    sampler-vs-trainer routing disagreement from the update's own forward (no extra forward;
    nothing under replay), "full" also the k3 gap of the trainer with and without replay every
    ``routing_metrics_every`` steps (two extra forwards on those steps), "off" none
    (``routing/*``). ``reference_routes``: whether the KL reference's log-prob pass replays
    those routes: "auto" (default) only under LoRA (the reference is then the policy's own base,
    verl's rule), "replay" always, "live" never (the reference routes itself, as slime runs
    it); the distillation teacher never replays (``algos.routing``).
    """

    # A method that trains on pairs (dpo, ipo, simpo, orpo) is an offline preference phase on
    # ``pref.data`` instead (``PrefSection``); it reads steps, microbatches, logprob_chunk_size.
    algo: str = "grpo"
    steps: int = 100
    prompts_per_step: int = 32
    group_size: int = 8
    epochs_per_step: int = 1
    microbatches: int = 1
    # Positions per lm_head/log-softmax chunk in the update and the old/reference passes
    # (``grpo.GRPOUpdateConfig.logprob_chunk_size``); None computes [tokens, V] logits whole.
    logprob_chunk_size: int | None = None
    advantage: loss_config.AdvantageConfig = dataclasses.field(
        default_factory=loss_config.AdvantageConfig
    )
    loss: loss_config.PolicyLossConfig = dataclasses.field(
        default_factory=loss_config.PolicyLossConfig
    )
    drop_zero_variance_groups: bool = False
    retire_pass_rate: float | None = None
    difficulty_filter: bool = False
    difficulty_filter_k: int = 4
    curriculum: bool = False
    length_reward_weight: float = 0.0
    length_reward_from_step: int = 0
    overlong_cache_len: int | None = None
    mask_forced_tokens: bool = True
    packing: bool = True
    share_prompts: bool = False
    max_tokens_per_row: int | None = None
    max_tokens_per_microbatch: int | None = None
    max_staleness: int = 0
    off_policy_correction: bool = True
    behaviour_logprobs: bool = True
    routing_replay: routing.ReplayMode = "none"
    routing_metrics: routing.MetricsMode = "basic"
    routing_metrics_every: int = 1
    reference_routes: routing.ReferenceRoutes = "auto"

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def preference(self) -> bool:
        """Whether ``algo`` is an offline preference method (trained on pairs from a file)."""
        method = registry.rl_method(self.algo)
        return method is not None and method.data == "pairs"

    @property
    def online(self) -> bool:
        """Whether ``algo`` samples and grades rollouts (its registration's ``data``)."""
        method = registry.rl_method(self.algo)
        return method is not None and method.data == "rollouts"

    @property
    def policy_loss(self) -> loss_config.PolicyLossConfig:
        """``loss`` as the update applies it: with stale rollouts and no correction chosen, the
        token-level truncation of pi_old / pi_sampler at 2."""
        corr = self.loss.correction
        if self.max_staleness > 0 and self.off_policy_correction and corr.mode == "none":
            corr = dataclasses.replace(corr, mode="truncate", level="token", source="both")
            return dataclasses.replace(self.loss, correction=corr)
        return self.loss


# The RL section: ``RLFields`` and, for each registered method with a config record of its own,
# a field ``rl.<method>`` of that record (PPO's ``PPOConfig``, distillation's ``DistillConfig``):
# YAML builds the method's record directly, and a new method adds its section by registering.
RLSection = dataclasses.make_dataclass(
    "RLSection",
    [
        (name, record, dataclasses.field(default_factory=record))
        for name, record in registry.sections().items()
    ],
    bases=(RLFields,),
    frozen=True,
    kw_only=True,
)
RLSection.__module__ = __name__
RLSection.__doc__ = RLFields.__doc__

# data.train values that name a generated task instead of a file or hub dataset.
GENERATED_TASKS = ("synthetic", "scratchpad", "synthetic_code")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefSection:
    """The offline preference phase (``rl.algo``: dpo, ipo, simpo or orpo; ``algos.preference``).

    ``data``: a jsonl file of rows with ``prompt_field`` (the full prompt text, as the model sees
    it), ``chosen_field`` and ``rejected_field`` (response texts; EOS is appended), read with
    ``datasets`` (``jaxrlvr pairs`` writes such a file). ``batch_size``: pairs per step (2 x rows:
    chosen then rejected, unpacked). ``beta``, ``label_smoothing`` (DPO), ``gamma`` (SimPO),
    ``nll_weight`` (DPO/IPO/SimPO + the chosen responses' NLL: RPO): as
    ``preference.PreferenceLossConfig``. The phase runs ``rl.steps`` steps with ``rl.microbatches``
    (which must divide ``batch_size``), ``rl.logprob_chunk_size`` and ``optim``; held-out
    evaluation every ``eval.every`` steps, as the RL loop.
    ``cache_reference`` (DPO, IPO): compute the frozen reference's log-probs once for the whole
    data set when the phase starts and reuse them every epoch, instead of one reference forward
    per batch (the same values; SimPO and ORPO have no reference, so it changes nothing there).
    """

    data: str | None = None
    prompt_field: str = "prompt"
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    batch_size: int = 16
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 1.0
    nll_weight: float = 0.0
    cache_reference: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSection:
    """Held-out evaluation at ``sampler.eval_temperature``; accuracy is the mean over
    ``samples_per_problem`` samples of each of the first ``max_problems`` problems (avg@n).

    ``pass_k`` / ``maj_k``: the k of the unbiased ``eval/pass@k`` and of the majority vote
    ``eval/maj@k`` reported beside it (``jaxrlvr.passk``; docs/evaluation.md), each with its
    standard error over problems (``eval/pass@k_se``); every k at most ``samples_per_problem``.
    """

    every: int = 10
    max_problems: int = 200
    samples_per_problem: int = 1
    at_start: bool = True
    pass_k: tuple[int, ...] = ()
    maj_k: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("pass_k", "maj_k"):
            ks = getattr(self, name)
            ks = (ks,) if isinstance(ks, int) else tuple(ks)
            object.__setattr__(self, name, ks)
            for k in ks:
                if not isinstance(k, int) or not 1 <= k <= self.samples_per_problem:
                    raise ValueError(
                        f"{name}={list(ks)}: {k!r} is not an integer in 1..samples_per_problem "
                        f"({self.samples_per_problem})"
                    )


ToolName = Literal["python", "calculator"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvSection:
    """Multi-turn tool use (``jaxrlvr.envs``; docs/tools.md): rollouts alternate model turns and
    tool outputs. Empty ``tools``: single-turn rollouts (the default).

    ``tools``: ``python`` (``<python>code</python>`` runs in the ``reward.sandbox`` sandbox with
    ``reward.code``'s limits; its printed output comes back) and / or ``calculator``
    (``<calc>expression</calc>``). ``max_turns``: model turns per rollout;
    ``max_tokens_per_turn`` (None: ``sampler.max_tokens``); ``sampler.max_tokens`` bounds the
    whole rollout after the prompt (model and tool tokens). ``max_output_chars``: a tool's
    output is clipped to this. ``num_workers``: threads that run one turn's tool calls.
    """

    tools: tuple[ToolName, ...] = ()
    max_turns: int = 4
    max_tokens_per_turn: int | None = None
    max_output_chars: int = 64
    num_workers: int = 2

    def __post_init__(self):
        object.__setattr__(self, "tools", tuple(self.tools))  # a list from code


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSection:
    """A checkpoint every ``every`` steps of a phase (0: only at a phase's end and on an agreed
    stop), the newest ``keep`` kept."""

    every: int = 10
    keep: int = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelSection = dataclasses.field(default_factory=lambda: ModelSection(tokenizer="char"))
    data: DataSection = dataclasses.field(default_factory=DataSection)
    reward: RewardSection = dataclasses.field(default_factory=RewardSection)
    sampler: SamplerSection = dataclasses.field(default_factory=SamplerSection)
    sft: SFTSection = dataclasses.field(default_factory=SFTSection)
    rl: RLSection = dataclasses.field(default_factory=RLSection)
    pref: PrefSection = dataclasses.field(default_factory=PrefSection)
    optim: OptimizerConfig = dataclasses.field(default_factory=lambda: OptimizerConfig())
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    eval: EvalSection = dataclasses.field(default_factory=EvalSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    env: EnvSection = dataclasses.field(default_factory=EnvSection)

    def __post_init__(self):
        # Every way of making a run's config (YAML, overrides, code, dataclasses.replace) is
        # checked here, once, in one order (the sections are records).
        check_config(self)


# ----------------------------------------------------------------------------------------------
# The config's own values: each section (``SECTION_CHECKS``), then the sections against each other
# (``check_consistency``). ``TrainConfig.__post_init__`` runs ``check_config``, so every way of
# making a config (YAML, overrides, ``TrainConfig(...)`` in code, ``dataclasses.replace``) is
# checked, once, in one order. They live here, not in ``preflight`` with the run's other checks,
# because what ``TrainConfig`` runs may import nothing that imports this module (no import cycle,
# not even a lazy one: tests/test_package_imports.py), and ``preflight`` asks the phases.


def check_model_section(m: ModelSection) -> None:
    if m.path is None and m.tokenizer is None:
        raise ValueError("model.tokenizer is required when model.path is not set")


def check_data_section(d: DataSection) -> None:
    if d.shards is not None and d.shards < 1:
        raise ValueError(f"data.shards must be an integer >= 1 or null, got {d.shards!r}")
    if d.code_layout not in (None, "mbpp", "humaneval"):
        raise ValueError(
            f"data.code_layout must be null, 'mbpp' or 'humaneval', got {d.code_layout!r}"
        )
    domains = [m.domain for m in d.mixture]
    if len(set(domains)) != len(domains) or not all(domains):
        raise ValueError(f"data.mixture: each source needs a domain of its own, got {domains}")
    for i, m in enumerate(d.mixture):
        if m.data.mixture:
            raise ValueError(f"data.mixture[{i}]: a source cannot itself be a mixture")
        check_data_section(m.data)
        check_reward_section(m.reward)


def check_reward_section(r: RewardSection) -> None:
    if r.sandbox not in ("bwrap", "none"):
        raise ValueError(f"reward.sandbox must be 'bwrap' or 'none', got {r.sandbox!r}")


def check_sampler_section(s: SamplerSection) -> None:
    """The sampling parameters (by ``SamplingParams``, the samplers' one validation, now rather
    than at the first rollout or evaluation), the vLLM servers' address and GPU placement."""
    from jaxrlvr import placement
    from jaxrlvr.sampling import base as sampling_base
    from jaxrlvr.sampling import bind

    sampling_base.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        stop=s.stop,
        thinking_budget=s.thinking_budget,
    )
    eval_max_tokens = s.max_tokens if s.eval_max_tokens is None else s.eval_max_tokens
    try:
        sampling_base.SamplingParams(
            temperature=s.eval_temperature, top_p=s.eval_top_p, max_tokens=eval_max_tokens
        )
    except ValueError as e:
        raise ValueError(f"eval_{e}") from None
    bind.check_bind_host(
        s.vllm_host,
        s.vllm_allow_remote_dev_endpoints,
        key="sampler.vllm_host",
        allow_flag="sampler.vllm_allow_remote_dev_endpoints=true",
    )
    loss_config.check_literal("sampler.vllm_device", s.vllm_device, VLLMDevice)
    loss_config.check_literal("sampler.vllm_dtype", s.vllm_dtype, VLLMDType)
    if s.jax_devices < 0:
        raise ValueError(f"sampler.jax_devices={s.jax_devices}: must be >= 0")
    if s.jax_dtype not in (None, "float32", "bfloat16"):
        raise ValueError(f"sampler.jax_dtype={s.jax_dtype!r}: expected float32, bfloat16 or null")
    if s.vllm_num_servers < 1:
        raise ValueError(f"sampler.vllm_num_servers={s.vllm_num_servers}: must be >= 1")
    gpus = list(s.vllm_gpus)
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError(f"sampler.vllm_gpus={gpus!r}: expected distinct GPU numbers >= 0")
    if gpus and s.vllm_device == "cpu":
        raise ValueError(f"sampler.vllm_gpus={gpus!r}: needs sampler.vllm_device cuda or auto")
    if gpus and s.vllm_urls:
        raise ValueError(
            f"sampler.vllm_gpus={gpus!r}: only for servers jaxrlvr starts, not with "
            "sampler.vllm_urls"
        )
    if gpus:
        placement.split_groups(gpus, s.vllm_num_servers)
    for key in ("vllm_gpu_memory_utilization", "vllm_trainer_memory_fraction"):
        value = getattr(s, key)
        if value is not None and not 0.0 < value <= 1.0:
            raise ValueError(f"sampler.{key}={value!r}: expected a fraction in (0, 1]")
    if s.vllm_colocate:
        fraction = s.vllm_trainer_memory_fraction or placement.COLOCATED_TRAINER_FRACTION
        util = s.vllm_gpu_memory_utilization or placement.COLOCATED_SERVER_UTILIZATION
        if fraction + util > placement.MAX_COLOCATED_SUM:
            raise ValueError(
                f"sampler.vllm_colocate: vllm_trainer_memory_fraction={fraction:g} + "
                f"vllm_gpu_memory_utilization={util:g} = {fraction + util:g} leaves no room "
                f"for the CUDA contexts; keep the sum <= {placement.MAX_COLOCATED_SUM:g}"
            )


def check_rl_section(rl: RLSection) -> None:
    method = registry.rl_method(rl.algo)  # a registered method, or the one-line error
    for key in ("steps", "prompts_per_step", "group_size", "epochs_per_step", "microbatches"):
        if getattr(rl, key) < (0 if key == "steps" else 1):
            raise ValueError(f"{key}={getattr(rl, key)!r} must be positive")
    if not (isinstance(rl.max_staleness, int) and rl.max_staleness >= 0):
        raise ValueError(f"rl.max_staleness={rl.max_staleness!r}: expected an int >= 0")
    if rl.max_staleness > 0 and rl.algo not in registry.asynchronous():
        raise ValueError(
            f"rl.max_staleness={rl.max_staleness}: asynchronous rollouts need a method that "
            f"trains on stale rollouts ({', '.join(registry.asynchronous())}), not "
            f"rl.algo={rl.algo!r}"
        )
    corr = rl.loss.correction
    if (
        rl.max_staleness > 0
        and not rl.behaviour_logprobs
        and corr.mode != "none"
        and corr.source != "both"
    ):
        raise ValueError(
            f"rl.loss.correction.source={corr.source!r} with rl.max_staleness="
            f"{rl.max_staleness} needs rl.behaviour_logprobs=true (the log-probs of the "
            "version that sampled), or source 'both'"
        )
    routing.check_mode(rl.routing_replay)
    routing.check_mode(rl.routing_metrics, "rl.routing_metrics", routing.MetricsMode)
    routing.check_mode(rl.reference_routes, "rl.reference_routes", routing.ReferenceRoutes)
    every = rl.routing_metrics_every
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"rl.routing_metrics_every={every!r}: expected an int >= 1")
    if rl.max_tokens_per_row is not None and rl.max_tokens_per_row < 1:
        raise ValueError(f"rl.max_tokens_per_row={rl.max_tokens_per_row!r} must be >= 1")
    budget = rl.max_tokens_per_microbatch
    if budget is not None:
        key = f"rl.max_tokens_per_microbatch={budget!r}"
        if not (isinstance(budget, int) and budget >= 1):
            raise ValueError(f"{key}: expected an int >= 1 or null")
        if not rl.packing or rl.preference:
            raise ValueError(
                f"{key}: a token budget fills packed rollout rows; it needs rl.packing=true "
                "and an online algorithm (grpo, ppo, expert_iteration)"
            )
        if rl.microbatches != 1:
            raise ValueError(
                f"{key}: the budget chooses each step's microbatch count; leave "
                f"rl.microbatches at 1, not {rl.microbatches}"
            )
        if rl.max_tokens_per_row is not None and budget < rl.max_tokens_per_row:
            raise ValueError(
                f"{key} is less than one row of rl.max_tokens_per_row="
                f"{rl.max_tokens_per_row} positions"
            )
    rate = rl.retire_pass_rate
    if rate is not None:
        if isinstance(rate, bool) or not (isinstance(rate, (int, float)) and 0 < rate <= 1):
            raise ValueError(f"rl.retire_pass_rate={rate!r}: expected a number in (0, 1] or null")
        if rl.curriculum:
            raise ValueError(
                "rl.retire_pass_rate retires problems from the plain data order; it cannot be "
                "combined with rl.curriculum=true"
            )
    if rl.loss.aggregation == "prompt_mean_token_mean" and not (
        rl.packing and rl.share_prompts and not rl.preference
    ):
        raise ValueError(
            "rl.loss.aggregation=prompt_mean_token_mean tells a prompt's group by its shared "
            "prompt: it needs rl.packing=true and rl.share_prompts=true (an online method)"
        )
    if method is not None and method.check is not None:
        method.check(rl)  # the method's own checks of the section (its registration's)


def check_pref_section(p: PrefSection) -> None:
    if p.batch_size < 1:
        raise ValueError(f"pref.batch_size={p.batch_size!r} must be positive")


def check_checkpoint_section(c: CheckpointSection) -> None:
    if not (isinstance(c.every, int) and c.every >= 0):
        raise ValueError(f"checkpoint.every={c.every!r}: expected an int >= 0")
    if not (isinstance(c.keep, int) and c.keep >= 1):
        raise ValueError(f"checkpoint.keep={c.keep!r}: expected an int >= 1")


def check_env_section(e: EnvSection) -> None:
    for t in e.tools:
        loss_config.check_literal("env.tools", t, ToolName)
    if len(set(e.tools)) != len(e.tools):
        raise ValueError(f"env.tools={list(e.tools)}: a tool is named twice")
    for name in ("max_turns", "max_output_chars", "num_workers"):
        value = getattr(e, name)
        if not (isinstance(value, int) and value >= 1):
            raise ValueError(f"env.{name}={value!r}: expected an int >= 1")
    if e.max_tokens_per_turn is not None and not (
        isinstance(e.max_tokens_per_turn, int) and e.max_tokens_per_turn >= 1
    ):
        raise ValueError(
            f"env.max_tokens_per_turn={e.max_tokens_per_turn!r}: expected None or an int >= 1"
        )


# (dotted section, its check) in the order of TrainConfig's fields; a nested section before the
# section that holds it (as YAML builds them).
SECTION_CHECKS = (
    ("model", check_model_section),
    ("data", check_data_section),
    ("reward", check_reward_section),
    ("sampler", check_sampler_section),
    ("rl", check_rl_section),
    ("pref", check_pref_section),
    ("checkpoint", check_checkpoint_section),
    ("env", check_env_section),
)


def check_consistency(cfg: TrainConfig) -> None:
    """The sections against each other (each one's own values already checked)."""
    if cfg.env.tools:
        if not cfg.rl.mask_forced_tokens:
            raise ValueError(
                "env.tools needs rl.mask_forced_tokens=true (tool outputs are not the "
                "policy's tokens and must stay out of the loss)"
            )
        if cfg.sampler.thinking_budget is not None:
            raise ValueError("env.tools cannot be combined with sampler.thinking_budget")


def check_config(cfg: TrainConfig) -> None:
    """The config's own values, section by section (``SECTION_CHECKS``), then the sections
    against each other (``check_consistency``): one line, ``<section>: <problem>``, at the first
    problem (``configlib.ConfigKeyError``, or the check's own error when it is one)."""
    for key, check in (*SECTION_CHECKS, ("TrainConfig", check_consistency)):
        target = cfg
        for part in key.split(".") if key != "TrainConfig" else ():
            target = getattr(target, part)
        try:
            check(target)
        except configlib.ConfigKeyError:
            raise
        except (ValueError, TypeError) as e:
            raise configlib.ConfigKeyError(f"{key}: {e}") from None


def load_config_dict(path: str, _seen: tuple[str, ...] = ()) -> dict:
    """A YAML config as a dict; a top-level ``base: other.yaml`` (relative to the file) is loaded
    first and this file's sections are merged over it, key by key."""
    path = os.path.abspath(path)
    if path in _seen:
        raise configlib.ConfigKeyError(f"{path}: circular 'base' chain")
    data = configlib.load_yaml(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise configlib.ConfigKeyError(f"{path}: base={base!r}: expected a file name")
    parent = load_config_dict(os.path.join(os.path.dirname(path), base), (*_seen, path))
    return configlib.deep_merge(parent, data)


def load_config(path: str | None, overrides: tuple[str, ...] | list[str] = ()) -> TrainConfig:
    """Reads a YAML config (with its ``base`` chain) and applies dotted ``key=value`` overrides."""
    data = load_config_dict(path) if path else {}
    data = configlib.apply_overrides(data, overrides)
    return configlib.build(TrainConfig, data)


def config_to_dict(cfg: TrainConfig) -> dict:
    return configlib.to_dict(cfg)
