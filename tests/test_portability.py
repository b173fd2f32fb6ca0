"""Portability without the hardware: every compiled program lowers for TPU and for CUDA.

Each program that jaxrlvr jits is exported with ``jax.export.export(jitted, platforms=(p,))`` for
p in ("tpu", "cuda") from this CPU-only machine, at the Qwen2.5-1.5B architecture (abstract,
shape-only parameters: float32 master weights, bfloat16 compute), on a (data=2, fsdp=2,
tensor=2) mesh of the 8 fake CPU devices that ``tests/conftest.py`` sets up, with the shardings
the trainer and the sampler really use:

- every update and every ``prepare`` (old/reference log-probs, rollout-time values) of the
  ``algorithm`` records, jitted by ``step.CompiledAlgorithm`` itself (state shardings from
  ``step.state_shardings`` of the abstract ``init`` state, rows over ('data', 'fsdp')), and the
  records' ``init`` (the step-0 state) and ``model.init_model``'s random initialisation; on
  packed rows (the driver's default: segment ids, per-segment positions) and, for SFT, GRPO and
  PPO, on padded rows;
- the log-prob function (``engine.make_logprob_fn``), packed and padded;
- the sampler's generate program (``jax_sampler._generate_jit``) with the exact arguments that
  ``JaxSampler`` passes it (recorded from a tiny sampler on the same mesh, then re-targeted at
  the 1.5B parameters): greedy, top-k + top-p, top-p alone (the sorted path), and under a
  thinking budget. The thinking budget is not part of any compiled program: it runs on the host
  (``sampling.base.generate_with_thinking_budget``) as two calls of the plain program, and those
  two programs are what the thinking-budget case exports;
- the model's forward ``model(input_ids, attention_mask, position_ids)`` (also with
  ``segment_ids``), prefill into the KV cache and one-token decode from it.

No case is skipped: every program lowers for both platforms (checked with JAX 0.10.2). Where a
JAX version cannot export one for a platform, skip only that case and name the version.

Lowering is the whole of what is checked: the platform's lowering rules, the custom calls that
``jax.export`` accepts as stable, and the sharding annotations. A host callback, a CPU-only
custom call or a primitive without a TPU/GPU lowering fails here. Compiling (memory, layouts
the backend's compiler rejects), speed and numerics still need the hardware.
"""

import dataclasses
import functools
import importlib
import pkgutil
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxrlvr.algos
from jaxrlvr import model as M
from jaxrlvr.algos import (
    algorithm,
    cispo,
    distill,
    engine,
    grpo,
    loss_config,
    optim,
    ppo,
    preference,
    sft,
    step,
)
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.model import weights
from jaxrlvr.sampling import base, jax_sampler

PLATFORMS = ("tpu", "cuda")
B, T = 16, 64  # training rows x tokens: small, lowering time does not depend on it
TOP_K = 8  # the distillation teacher's top-k tokens per position
MICROBATCHES = 2  # exercises the lax.scan accumulation path of every update

# Qwen2.5-1.5B (config.json of Qwen/Qwen2.5-1.5B), float32 master weights, bfloat16 compute.
QWEN25_1_5B = M.ModelConfig.qwen2_5_1_5b(dtype="bfloat16", param_dtype="float32")

# name -> {platform: len(exported.mlir_module())}; printed at the end of the module (pytest -s).
SIZES: dict[str, dict[str, int]] = {}


@dataclasses.dataclass(frozen=True)
class Arch:
    cfg: M.ModelConfig
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    params: nnx.State  # jax.ShapeDtypeStruct leaves


@pytest.fixture(scope="module")
def arch():
    assert len(jax.devices()) == 8, "tests/conftest.py sets 8 fake CPU devices"
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    abstract = nnx.eval_shape(lambda: M.Qwen2ForCausalLM(QWEN25_1_5B, mesh=mesh))
    graphdef, params = nnx.split(abstract, nnx.Param)
    assert M.param_count(params) > 1.5e9  # the real architecture, never materialised
    # The embedding and the 7 kernels of each layer are split over the mesh (rules table).
    sharded = [not s.is_fully_replicated for s in jax.tree.leaves(M.param_shardings(params, mesh))]
    assert sum(sharded) >= 8
    yield Arch(QWEN25_1_5B, mesh, graphdef, params)
    print("\nStableHLO text size (characters of exported.mlir_module()):")
    for name, sizes in SIZES.items():
        print(f"  {name:40s} " + "  ".join(f"{p}={n:>9,d}" for p, n in sorted(sizes.items())))


def _sds(x, sharding=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)


def export(
    name: str, platform: str, jitted, *args, expected_shardings=None, runs_model=True, **kwargs
):
    """Exports ``jitted`` for ``platform`` (lowering only) and checks what came out: one
    platform, the 8-device mesh, bfloat16 compute where the model runs (``runs_model``; None:
    not checked), and with
    ``expected_shardings`` (a pytree like ``args``) the sharding of every input."""
    platforms = platform if isinstance(platform, tuple) else (platform,)
    # The MoE's expert-parallel dispatch lowers to a ``ragged_all_to_all`` custom call, which
    # jax.export does not promise to keep compatible across versions: allowed, named here.
    ragged = jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")
    exported = jax.export.export(jitted, platforms=platforms, disabled_checks=[ragged])(
        *args, **kwargs
    )
    assert exported.platforms == platforms
    assert exported.nr_devices == 8
    text = exported.mlir_module()
    assert "sdy.sharding" in text or "mhlo.sharding" in text
    if runs_model is not None:
        assert ("xbf16>" in text) == runs_model
    if expected_shardings is not None:
        # Every input carries the sharding the trainer gives it (none silently replicated).
        want = jax.tree.leaves(expected_shardings)
        got = exported.in_shardings_jax(want[0].mesh)
        assert len(got) == len(want) == len(exported.in_avals)
        kept = set(exported.module_kept_var_idx)  # unused inputs (SFT's prepare) are dropped
        wrong = [
            (i, g, w.spec)
            for i, (g, w, aval) in enumerate(zip(got, want, exported.in_avals))
            if i in kept and not (g is not None and g.is_equivalent_to(w, aval.ndim))
        ]
        assert not wrong, f"{name}: inputs exported with other shardings: {wrong[:5]}"
        assert any(not w.is_fully_replicated for w in want)
    SIZES.setdefault(name, {})["+".join(platforms)] = len(text)
    return exported


# ---------------------------------------------------------------------------------------------
# Updates and prepare: the algorithm records, compiled as the driver compiles them.

_OPT = optim.OptimizerConfig(learning_rate=1e-6)
_PLC = loss_config.PolicyLossConfig


def _grpo(epochs_per_batch=1, logprob_chunk_size=None, **loss):
    cfg = grpo.GRPOUpdateConfig(
        loss=_PLC(**loss), num_microbatches=MICROBATCHES, logprob_chunk_size=logprob_chunk_size
    )
    return lambda a: grpo.grpo_algorithm(
        a.graphdef, _OPT, cfg, mesh=a.mesh, epochs_per_batch=epochs_per_batch
    )


def _cispo():
    # Two epochs: the old-log-prob pass runs (with one epoch every CISPO weight is 1).
    cfg = cispo.CISPOUpdateConfig(num_microbatches=MICROBATCHES)
    return lambda a: cispo.cispo_algorithm(a.graphdef, _OPT, cfg, mesh=a.mesh, epochs_per_batch=2)


def _ppo(trunk, **loss):
    return lambda a: ppo.ppo_algorithm(
        a.graphdef,
        _OPT,
        ppo.PPOUpdateConfig(loss=_PLC(**loss), trunk=trunk, num_microbatches=MICROBATCHES),
        params_shape=a.params,
        mesh=a.mesh,
    )


def _preference(kind):
    cfg = preference.PreferenceUpdateConfig(
        loss=preference.PreferenceLossConfig(kind=kind), num_microbatches=MICROBATCHES
    )
    return lambda a: preference.preference_algorithm(a.graphdef, _OPT, cfg, mesh=a.mesh)


def _distill(**kwargs):
    cfg = distill.DistillUpdateConfig(
        loss=_PLC(aggregation="token_mean"),
        distill=distill.DistillConfig(**kwargs),
        num_microbatches=MICROBATCHES,
        logprob_chunk_size=T // 4,
    )
    return lambda a: distill.distill_algorithm(a.graphdef, _OPT, cfg, mesh=a.mesh)


def _sft_like(factory):
    return lambda a: factory(
        a.graphdef, _OPT, sft.SFTUpdateConfig(num_microbatches=MICROBATCHES), mesh=a.mesh
    )


ALGORITHMS = {
    "sft": _sft_like(sft.sft_algorithm),
    "expert_iteration": _sft_like(sft.expert_iteration_algorithm),
    "grpo": _grpo(),
    "grpo_dapo": _grpo(aggregation="token_mean", clip_eps_high=0.28, dual_clip=3.0),
    "grpo_dr_grpo": _grpo(aggregation="seq_mean_token_sum_norm", norm_constant=float(T)),
    "grpo_gspo": _grpo(ratio_level="sequence", clip_eps_low=3e-4, clip_eps_high=4e-4),
    "grpo_kl_loss": _grpo(kl_coef=0.04, kl_estimator="k3", entropy_coef=1e-3),
    "grpo_correction": _grpo(
        correction=loss_config.CorrectionConfig(mode="icepop", level="geometric", source="engine")
    ),
    # Several epochs per batch: prepare runs the old-log-prob pass (one epoch skips it), here
    # with the log-softmax in position chunks under remat.
    "grpo_epochs2_chunked": _grpo(epochs_per_batch=2, logprob_chunk_size=T // 4),
    "ppo_shared": _ppo("shared"),
    "ppo_separate": _ppo("separate", kl_coef=0.05, kl_in="reward"),
    # Preference pairs are unpacked rows only (``algos.preference``): padded cases.
    "preference_dpo_padded": _preference("dpo"),
    "preference_orpo_padded": _preference("orpo"),
    # On-policy distillation: the reverse-KL advantage (teacher_logp [B, T]) and the JSD over
    # the teacher's top-k (teacher_topk_ids / teacher_topk_logp [B, T, K], the student's logits
    # in position chunks under remat).
    "distill": _distill(),
    "distill_jsd": _distill(signal="jsd", beta=0.5, top_k=TOP_K),
    "cispo": _cispo(),
}
# GRPO's prepare depends on the loss config only through the reference (kl_coef > 0) and the
# batch specs (and on epochs_per_batch): variants that change none of them run GRPO's prepare
# program (checked below), which is not exported again for them.
PREPARE_AS = {"grpo_dapo": "grpo", "grpo_dr_grpo": "grpo", "grpo_gspo": "grpo"}


def _rollouts(spec: batch_lib.BatchSpec, packed: bool = True) -> batch_lib.Batch:
    """The host batch that the driver hands to ``prepare`` (``rollout.to_batch`` dtypes),
    abstract, with the fields of ``spec`` (``algorithm.select_fields``, as the driver does).

    ``packed`` (the driver's default, ``rl.packing``): several rollouts per row, with
    ``segment_ids``/``positions`` and the per-sequence fields spread over their tokens [B, T];
    otherwise one rollout per padded row, per-sequence fields [B]."""
    bt = lambda dtype: jax.ShapeDtypeStruct((B, T), dtype)  # noqa: E731
    seq = bt(jnp.float32) if packed else jax.ShapeDtypeStruct((B,), jnp.float32)
    full = batch_lib.Batch(
        input_ids=bt(jnp.int32),
        attention_mask=bt(jnp.int32),
        labels=bt(jnp.int32),
        loss_mask=bt(jnp.float32),
        advantages=seq,
        sampler_logp=bt(jnp.float32),
        teacher_logp=bt(jnp.float32),
        teacher_topk_ids=jax.ShapeDtypeStruct((B, T, TOP_K), jnp.int32),
        teacher_topk_logp=jax.ShapeDtypeStruct((B, T, TOP_K), jnp.float32),
        rewards=seq,
        correct=seq,
        segment_ids=bt(jnp.int32) if packed else None,
        positions=bt(jnp.int32) if packed else None,
    )
    return algorithm.select_fields(full, spec)


PADDED = "_padded"  # case-name suffix: one rollout per padded row instead of packed rows


_COMPILED: dict[str, tuple] = {}  # name -> what _compiled returns (shared by the platforms)


def _compiled(name: str, arch: Arch):
    if name in _COMPILED:
        return _COMPILED[name]
    algo = ALGORITHMS[name if name in ALGORITHMS else name.removesuffix(PADDED)](arch)
    state = jax.eval_shape(lambda p: algo.init(p, 0), arch.params)
    shardings = step.state_shardings(state, arch.mesh)
    compiled = step.CompiledAlgorithm(algo, arch.mesh, shardings)
    rollouts = _rollouts(algo.rollout_spec, packed=not name.endswith(PADDED))
    batch, _ = jax.eval_shape(algo.prepare, state, rollouts)  # what update receives
    _COMPILED[name] = compiled, state, shardings, rollouts, batch, algo
    return _COMPILED[name]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", [*ALGORITHMS, "sft_padded", "grpo_padded", "ppo_shared_padded"])
def test_update_and_prepare_lower(arch, name, platform):
    compiled, state, shardings, rollouts, batch, algo = _compiled(name, arch)
    rows = step.batch_shardings(batch, arch.mesh)
    export(
        f"{name}/update",
        platform,
        compiled._update,
        state,
        batch,
        expected_shardings=(shardings, rows),
    )
    if name in PREPARE_AS:
        _, same_state, *_, same_algo = _compiled(PREPARE_AS[name], arch)
        assert algo.rollout_spec == same_algo.rollout_spec
        assert algo.batch_spec == same_algo.batch_spec
        assert (state.ref_params is None) == (same_state.ref_params is None)
        return
    export(
        f"{name}/prepare",
        platform,
        compiled._prepare,
        state,
        rollouts,
        expected_shardings=(shardings, step.batch_shardings(rollouts, arch.mesh)),
        runs_model=None,  # a forward only where a pass is needed (old, reference, values)
    )


# The step-0 state: the driver runs ``init`` eagerly (op by op, each op compiled on its own), so
# lowering it as one program covers the same ops: optimiser moments, the KL reference copy, the
# PPO value head's random init, the separate critic's copy of the policy.
INIT_CASES = ("sft", "grpo_kl_loss", "ppo_shared", "ppo_separate")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", INIT_CASES)
def test_algorithm_init_lowers(arch, name, platform):
    _, _, shardings, _, _, algo = _compiled(name, arch)
    params_sh = M.param_shardings(arch.params, arch.mesh)
    init = jax.jit(lambda p: algo.init(p, 0), in_shardings=(params_sh,), out_shardings=shardings)
    exported = export(
        f"{name}/init",
        platform,
        init,
        arch.params,
        expected_shardings=(params_sh,),
        runs_model=False,
    )
    got = exported.out_shardings_jax(arch.mesh)
    want = jax.tree.leaves(shardings)
    assert all(
        g.is_equivalent_to(w, a.ndim) for g, w, a in zip(got, want, exported.out_avals, strict=True)
    )


def test_every_algorithm_factory_is_covered():
    """A new algorithm record must be added to ALGORITHMS (and so to the portability check)."""
    factories = {"sft", "expert_iteration", "grpo", "ppo", "preference", "distill", "cispo"}
    modules = [
        importlib.import_module(f"jaxrlvr.algos.{m.name}")
        for m in pkgutil.iter_modules(jaxrlvr.algos.__path__)
    ]
    public = {
        n.removesuffix("_algorithm")
        for module in modules
        for n, f in vars(module).items()
        if callable(f)
        and getattr(f, "__module__", None) == module.__name__
        and not n.startswith("_")
        and f.__annotations__.get("return") in (algorithm.Algorithm, "Algorithm")
    }
    # algorithm.with_epochs wraps a record and policy_gradient_algorithm is the skeleton grpo, ppo,
    # distill and cispo build on; each method module's registry builders (build, build_sft,
    # build_expert_iteration) call the factories above: none makes a new method.
    public -= {"with_epochs", "policy_gradient"}
    public = {n for n in public if not n.startswith("build")}
    assert public == factories, f"new algorithm factories to cover here: {public - factories}"
    prefixed = ("grpo", "ppo", "preference", "distill")
    covered = {n.split("_")[0] if n.startswith(prefixed) else n for n in ALGORITHMS}
    assert covered == factories


# ---------------------------------------------------------------------------------------------
# The log-prob function and the model's forward, prefill and decode.


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_logprob_fn_lowers(arch, packed, platform):
    fn = engine.make_logprob_fn(arch.graphdef, num_microbatches=MICROBATCHES, mesh=arch.mesh)
    batch = _rollouts(batch_lib.BatchSpec(), packed=packed)
    params_sh = M.param_shardings(arch.params, arch.mesh)
    rows = step.batch_shardings(batch, arch.mesh)
    jitted = jax.jit(fn, in_shardings=(params_sh, rows))
    name = "logprob_fn" + ("" if packed else PADDED)
    export(name, platform, jitted, arch.params, batch, expected_shardings=(params_sh, rows))


def _forward(graphdef, params, input_ids, attention_mask, position_ids, segment_ids=None):
    return nnx.merge(graphdef, params)(
        input_ids, attention_mask, position_ids, segment_ids=segment_ids
    )


def _prefill(graphdef, cfg, params, input_ids, attention_mask, position_ids, *, cache_len):
    cache = M.init_cache(cfg, input_ids.shape[0], cache_len)
    return nnx.merge(graphdef, params)(
        input_ids, attention_mask, position_ids, cache=cache, cache_index=0
    )


def _decode(graphdef, params, token_ids, attention_mask, position_ids, cache, cache_index):
    return nnx.merge(graphdef, params)(
        token_ids, attention_mask, position_ids, cache=cache, cache_index=cache_index
    )


def _cache_shardings(cache: M.KVCache, mesh) -> M.KVCache:
    from jaxrlvr.model import decoder

    return M.KVCache(
        k=tuple(M.logical_sharding(decoder.CACHE_K_AXES, x.shape, mesh) for x in cache.k),
        v=tuple(M.logical_sharding(decoder.CACHE_V_AXES, x.shape, mesh) for x in cache.v),
    )


@pytest.mark.parametrize("platform", PLATFORMS)
def test_model_init_lowers(arch, platform):
    """``model.init_model``'s program (random initialisation, created sharded)."""
    exported = export(
        "model/init", platform, weights.init_state_fn(arch.cfg, mesh=arch.mesh), runs_model=False
    )
    text = exported.mlir_module()
    constraints = text.count("sdy.sharding_constraint") + text.count("@Sharding")
    assert constraints >= len(jax.tree.leaves(arch.params))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_model_forward_prefill_and_decode_lower(arch, platform):
    mesh, cfg = arch.mesh, arch.cfg
    params_sh = M.param_shardings(arch.params, mesh)
    rows = M.batch_sharding(mesh, 2)
    replicated = NamedSharding(mesh, PartitionSpec())
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)

    forward = jax.jit(
        functools.partial(_forward, arch.graphdef), in_shardings=(params_sh, rows, rows, rows)
    )
    export(
        "model/forward", platform, forward, arch.params, ids, ids, ids,
        expected_shardings=(params_sh, rows, rows, rows),
    )  # fmt: skip
    packed = jax.jit(
        functools.partial(_forward, arch.graphdef), in_shardings=(params_sh, rows, rows, rows, rows)
    )
    export(
        "model/forward_packed", platform, packed, arch.params, ids, ids, ids, ids,
        expected_shardings=(params_sh, rows, rows, rows, rows),
    )  # fmt: skip

    slots = 2 * T
    mask = jax.ShapeDtypeStruct((B, slots), jnp.int32)
    prefill = jax.jit(
        functools.partial(_prefill, arch.graphdef, cfg, cache_len=slots),
        in_shardings=(params_sh, rows, rows, rows),
    )
    export(
        "model/prefill", platform, prefill, arch.params, ids, mask, ids,
        expected_shardings=(params_sh, rows, rows, rows),
    )  # fmt: skip

    cache = jax.eval_shape(lambda: M.init_cache(cfg, B, slots))
    cache_sh = _cache_shardings(cache, mesh)
    one = jax.ShapeDtypeStruct((B, 1), jnp.int32)
    decode = jax.jit(
        functools.partial(_decode, arch.graphdef),
        in_shardings=(params_sh, rows, rows, rows, cache_sh, replicated),
        donate_argnums=4,
    )
    export(
        "model/decode", platform, decode, arch.params, one, mask, one, cache,
        jax.ShapeDtypeStruct((), jnp.int32),
        expected_shardings=(params_sh, rows, rows, rows, cache_sh, replicated),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The sampler's generate program, with the arguments JaxSampler really passes it.

SAMPLING = {
    "greedy": base.SamplingParams(temperature=0.0, max_tokens=64),
    "top_k_top_p": base.SamplingParams(temperature=0.8, top_k=20, top_p=0.95, max_tokens=64),
    "top_p": base.SamplingParams(temperature=1.0, top_p=0.9, max_tokens=64),
    # Host-side (base.generate_with_thinking_budget): two calls of the plain program.
    "thinking_budget": base.SamplingParams(
        temperature=1.0, top_p=0.95, max_tokens=256, thinking_budget=64
    ),
}


class _ByteTokenizer:
    """The little of a Hugging Face tokenizer that JaxSampler and the thinking budget call."""

    eos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [b + 2 for b in text.encode()]

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i - 2 for i in ids if i >= 2).decode(errors="replace")


@pytest.fixture(scope="module")
def generate_calls(arch):
    """name -> the (params, inputs, static kwargs) of every ``_generate_jit`` call that
    ``JaxSampler.generate`` makes: a tiny sampler on the same mesh runs its real host code, with
    the compiled program replaced by a recorder (every row runs to its ``max_new``)."""
    calls: list[tuple] = []

    def record(params, inputs, **static):
        calls.append((inputs, static))
        rows, gen = inputs["prompt_ids"].shape[0], static["s"].gen_len
        n = int(inputs["max_new"])
        z = np.zeros((rows, gen), np.int32)
        return z, z.astype(np.float32), np.full((rows,), n, np.int32), np.zeros((rows,), bool)

    tok = _ByteTokenizer()
    # Zero weights (nothing runs): the sampler's host code only needs the parameter tree.
    abstract = nnx.eval_shape(lambda: M.Qwen2ForCausalLM(M.ModelConfig.tiny(), mesh=arch.mesh))
    graphdef, state = nnx.split(abstract)
    tiny = nnx.merge(graphdef, jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), state))
    sampler = jax_sampler.JaxSampler(tiny, tok, mesh=arch.mesh)
    prompts = [tok.encode(q, add_special_tokens=False) for q in ("1 + 1 =", "What is 6 * 7?")]
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax_sampler, "_generate_jit", record)
        for name, params in SAMPLING.items():
            del calls[:]
            sampler.generate(prompts, 4, params)
            out[name] = list(calls)
    return out


def test_thinking_budget_is_host_side(generate_calls):
    """Under a thinking budget the sampler runs the plain program twice (budget, continuation);
    no compiled program knows about the budget."""
    assert [len(generate_calls[n]) for n in SAMPLING] == [1, 1, 1, 2]
    assert {f.name for f in dataclasses.fields(jax_sampler._Static)}.isdisjoint(
        {"thinking_budget", "thinking_end_text"}
    )


_GENERATE_SIZES: dict[tuple, int] = {}  # (platform, static choices, abstract inputs) -> size


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", list(SAMPLING))
def test_generate_lowers(arch, generate_calls, name, platform):
    # The sampler's own graph definition and parameter placement (JaxSampler.__init__ and
    # update_weights), at the 1.5B architecture.
    abstract = nnx.eval_shape(
        lambda: M.Qwen2ForCausalLM(arch.cfg, rngs=nnx.Rngs(0), mesh=arch.mesh)
    )
    graphdef, _ = nnx.split(abstract, nnx.Param)
    params_sh = M.param_shardings(arch.params, arch.mesh)
    params = jax.tree.map(lambda x, s: _sds(x, s), arch.params, params_sh)
    for i, (inputs, static) in enumerate(generate_calls[name]):
        placed = {k: _sds(v, v.sharding) for k, v in inputs.items()}
        assert placed["prompt_ids"].sharding == M.batch_sharding(arch.mesh, 2)
        static = dict(static, graphdef=graphdef, cfg=arch.cfg)
        label = f"generate/{name}" + (f"[call {i + 1}]" if len(generate_calls[name]) > 1 else "")
        # The same program as an earlier case (the thinking budget's first call is the plain
        # top-p program): its export is not repeated.
        key = (platform, static["s"], tuple((k, str(v)) for k, v in sorted(placed.items())))
        if key not in _GENERATE_SIZES:
            exported = export(
                label,
                platform,
                jax_sampler._generate_jit,
                params,
                placed,
                expected_shardings=(params_sh, [x.sharding for x in jax.tree.leaves(placed)]),
                **static,
            )
            _GENERATE_SIZES[key] = len(exported.mlir_module())
        SIZES.setdefault(label, {})[platform] = _GENERATE_SIZES[key]


# ---------------------------------------------------------------------------------------------
# Qwen3 and Qwen3-MoE at real sizes (issue 39): the GRPO update, the forward and one-token
# decode of Qwen3-1.7B and Qwen3-30B-A3B (``ModelConfig`` presets of their config.json), on the
# (data=2, fsdp=2, tensor=2) mesh for the dense model, the expert-parallel (fsdp=2, expert=2,
# tensor=2) mesh for the MoE. The MoE runs the accelerators' grouped-matmul kernel and dispatch
# (``moe_impl="ragged_dot"``, hence ``ragged_all_to_all``: "auto" would resolve to the CPU's
# on this host). The 1.7B is exported for CUDA, the 30B-A3B for TPU and CUDA in one
# multi-platform export (one lowering); the update's lowering rules are the same for both.

QWEN3 = {
    "qwen3_1_7b": lambda: M.ModelConfig.qwen3_1_7b(dtype="bfloat16", param_dtype="float32"),
    "qwen3_30b_a3b": lambda: M.ModelConfig.qwen3_30b_a3b(
        dtype="bfloat16", param_dtype="float32", moe_impl="ragged_dot"
    ),
}


def _qwen3_arch(name):
    cfg = QWEN3[name]()
    # The MoE on the expert-parallel mesh (fsdp=2, expert=2, tensor=2): ragged_all_to_all.
    sizes = dict(fsdp=2, expert=2, tensor=2) if cfg.is_moe else dict(data=2, fsdp=2, tensor=2)
    mesh = M.make_mesh(M.MeshConfig(**sizes))
    abstract = nnx.eval_shape(lambda: M.CausalLM(cfg, mesh=mesh))
    graphdef, params = nnx.split(abstract, nnx.Param)
    assert M.param_count(params) == cfg.num_params()
    if cfg.is_moe:
        # Whole experts per (expert x fsdp) shard, their width over tensor: none replicated.
        specs = M.param_partition_specs(params, mesh)
        experts = [
            s for path, s in jax.tree_util.tree_leaves_with_path(specs) if "experts" in str(path)
        ]
        assert len(experts) == 3
        assert all(s[1] == ("expert", "fsdp") and "tensor" in s for s in experts)
    return Arch(cfg, mesh, graphdef, params)


def _assert_experts_never_gathered(name, text, cfg):
    """The expert-parallel dispatch in ``text`` (StableHLO): ragged all-to-alls, the shard_map
    body sees E / expert experts, and no all-gather yields a kernel of all E experts."""
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    assert "ragged_all_to_all" in text, name
    assert f"tensor<{e // 2}x{d}x{f}xbf16>" in text, name  # the local experts' gate / up
    whole = re.compile(rf"all_gather.*-> tensor<(\d+x)?{e}x({d}x{f}|{f}x{d})x")
    assert not any(whole.search(line) for line in text.splitlines()), name


@pytest.mark.slow  # lowering the 1.7B (~10 s) and the 30B-A3B (~50 s) update, forward, decode
@pytest.mark.parametrize(
    "name,platform", [("qwen3_1_7b", "cuda"), ("qwen3_30b_a3b", ("tpu", "cuda"))]
)
def test_qwen3_update_forward_decode_lower(name, platform):
    arch = _qwen3_arch(name)
    algo = _grpo()(arch)
    state = jax.eval_shape(lambda p: algo.init(p, 0), arch.params)
    shardings = step.state_shardings(state, arch.mesh)
    compiled = step.CompiledAlgorithm(algo, arch.mesh, shardings)
    batch, _ = jax.eval_shape(algo.prepare, state, _rollouts(algo.rollout_spec))
    rows = step.batch_shardings(batch, arch.mesh)
    exported = export(
        f"{name}/grpo/update",
        platform,
        compiled._update,
        state,
        batch,
        expected_shardings=(shardings, rows),
    )
    if arch.cfg.is_moe:
        assert "ragged_dot" in exported.mlir_module()
        _assert_experts_never_gathered("update", exported.mlir_module(), arch.cfg)

    params_sh = M.param_shardings(arch.params, arch.mesh)
    ids_sh = M.batch_sharding(arch.mesh, 2)
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
    forward = jax.jit(
        functools.partial(_forward, arch.graphdef), in_shardings=(params_sh, ids_sh, ids_sh, ids_sh)
    )
    exported = export(
        f"{name}/forward", platform, forward, arch.params, ids, ids, ids,
        expected_shardings=(params_sh, ids_sh, ids_sh, ids_sh),
    )  # fmt: skip
    if arch.cfg.is_moe:
        _assert_experts_never_gathered("forward", exported.mlir_module(), arch.cfg)
    slots = 2 * T
    cache = jax.eval_shape(lambda: M.init_cache(arch.cfg, B, slots))
    cache_sh = _cache_shardings(cache, arch.mesh)
    one = jax.ShapeDtypeStruct((B, 1), jnp.int32)
    mask = jax.ShapeDtypeStruct((B, slots), jnp.int32)
    replicated = NamedSharding(arch.mesh, PartitionSpec())
    decode = jax.jit(
        functools.partial(_decode, arch.graphdef),
        in_shardings=(params_sh, ids_sh, ids_sh, ids_sh, cache_sh, replicated),
        donate_argnums=4,
    )
    exported = export(
        f"{name}/decode", platform, decode, arch.params, one, mask, one, cache,
        jax.ShapeDtypeStruct((), jnp.int32),
        expected_shardings=(params_sh, ids_sh, ids_sh, ids_sh, cache_sh, replicated),
    )  # fmt: skip
    if arch.cfg.is_moe:
        _assert_experts_never_gathered("decode", exported.mlir_module(), arch.cfg)
