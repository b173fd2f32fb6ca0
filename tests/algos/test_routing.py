"""MoE routing replay (``algos.routing``): routes recorded by the JaxSampler, carried through
packing, shared prompts and microbatches as ``Batch.routes``, replayed in the forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlvr import model as M
from jaxrlvr import rollout
from jaxrlvr.algos import engine
from jaxrlvr.sampling import base, jax_sampler

CFG = M.ModelConfig(
    vocab_size=64,
    model_type="qwen3_moe",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]
N = 2


@pytest.fixture(scope="module")
def lm():
    return M.CausalLM(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def completions(lm):
    sampler = jax_sampler.JaxSampler(lm, eos_token_ids=[])
    params = base.SamplingParams(max_tokens=6, temperature=1.0, seed=0, logprobs=True)
    return sampler.generate(PROMPTS, N, params)


@jax.jit
def _live_ids(params, ids):
    graphdef = nnx.graphdef(M.CausalLM(CFG, rngs=nnx.Rngs(0)))
    _, _, router = nnx.merge(graphdef, params).backbone(ids, with_router=True)
    return router.expert_ids


def _live_routes(lm, ids):
    ids_lbtk = _live_ids(nnx.state(lm, nnx.Param), jnp.asarray([ids]))
    return np.transpose(np.asarray(ids_lbtk), (1, 2, 0, 3))[0]


def test_sampler_routes_equal_one_forward(lm, completions):
    """Prefill (grouped) and decode record the experts a single forward over prompt +
    completion chooses, in the compact dtype."""
    for c in completions:
        full = PROMPTS[c.prompt_index] + c.token_ids
        assert c.routes.dtype == np.int8
        assert c.routes.shape == (len(full) - 1, CFG.num_hidden_layers, 2)
        np.testing.assert_array_equal(c.routes, _live_routes(lm, full[:-1]))


def _rows(completions, routes=None, **kw):
    packed = rollout.pack(
        [PROMPTS[c.prompt_index] for c in completions],
        [c.token_ids for c in completions],
        pad_id=0,
        routes=routes if routes is not None else [c.routes for c in completions],
        **kw,
    )
    return packed, rollout.to_batch(packed, routes=packed.routes)


def _logp(lm, batch, microbatches=1):
    graphdef, params = nnx.split(lm, nnx.Param)
    fn = jax.jit(engine.make_logprob_fn(graphdef, num_microbatches=microbatches))
    return np.asarray(fn(params, jax.tree.map(jnp.asarray, batch))[0])


def test_replay_of_live_routes_is_bit_identical(lm, completions):
    _, batch = _rows(completions)
    replayed = _logp(lm, batch)
    live = _logp(lm, batch.replace(routes=None))
    np.testing.assert_array_equal(replayed, live)


def _other_routes(completions, seed=0):
    """Routes that differ from the live ones: random distinct expert pairs, the prompt's the
    same for every completion of a prompt (as one sampler's prefill records them)."""
    rng = np.random.default_rng(seed)

    def draw(n):
        return np.stack([rng.permutation(8)[:2] for _ in range(n * 2)]).reshape(n, 2, 2)

    prompt = {i: draw(len(p) - 1) for i, p in enumerate(PROMPTS)}
    return [
        np.concatenate([prompt[c.prompt_index], draw(len(c.token_ids))]).astype(np.int8)
        for c in completions
    ]


def _by_sequence(packed, logp, completions):
    """Each completion's label log-probs, by its placement (or row)."""
    out = []
    for i, c in enumerate(completions):
        if packed.placement is None:
            start = len(PROMPTS[c.prompt_index]) - 1
            out.append(logp[i, start : start + len(c.token_ids)])
        else:
            row, _, end = packed.placement[i]
            out.append(logp[row, end - len(c.token_ids) : end])
    return np.concatenate(out)


@pytest.mark.slow
def test_forced_routes_exact_under_packing_shared_prompts_and_microbatches(lm, completions):
    routes = _other_routes(completions)
    padded, batch = _rows(completions, routes)
    ref = _by_sequence(padded, _logp(lm, batch), completions)
    live = _by_sequence(padded, _logp(lm, batch.replace(routes=None)), completions)
    assert np.max(np.abs(ref - live)) > 1e-3  # forcing other experts changes the output
    for kw, mb in (
        (dict(segments=True, row_tokens=16), 1),
        (dict(segments=True, row_tokens=32, share_prompts=N), 1),
        (dict(batch_size=4), 2),
    ):
        packed, b = _rows(completions, routes, **kw)
        got = _by_sequence(packed, _logp(lm, b, mb), completions)
        np.testing.assert_allclose(got, ref, atol=1e-5, err_msg=str(kw))


@pytest.mark.slow
def test_replay_gradient_reaches_router(lm, completions):
    """Under replay the router's gradient is that of the live-gate reference: the gate weights
    recomputed from the live softmax at the forced experts (a NumPy-free reference: the dense
    expert block with a one-hot combine of those weights, via ``moe.dense_experts``)."""
    routes = _other_routes(completions, seed=1)
    _, batch = _rows(completions, routes)
    batch = jax.tree.map(jnp.asarray, batch)
    graphdef, params = nnx.split(lm, nnx.Param)

    def loss(p):
        model = nnx.merge(graphdef, p)
        logp, _, _ = engine.token_logprobs(model, batch)
        return jnp.sum(logp * batch.attention_mask)

    grads = jax.jit(jax.grad(loss))(params)
    router_grad = grads["model"]["layers"]["mlp"]["gate"]["kernel"].get_value()
    assert float(jnp.max(jnp.abs(router_grad))) > 1e-6


def test_routes_survive_the_json_of_batches_in_flight(completions):
    """Asynchronous rollouts checkpoint their pending batches as JSON: routes come back equal,
    in their dtype."""
    import json

    from jaxrlvr.data import loading
    from jaxrlvr.phases import producer

    r = producer.Rollouts(
        step=3,
        problems=[loading.Problem(id="p0", question="q", answer="a")],
        prompts=PROMPTS,
        completions=completions,
        metrics={},
    )
    back = producer.Rollouts.from_json(json.loads(json.dumps(r.to_json())))
    for a, b in zip(completions, back.completions):
        assert b.routes.dtype == a.routes.dtype
        np.testing.assert_array_equal(a.routes, b.routes)


def test_vllm_routes_from_the_documented_response():
    """vLLM's documented format (``--enable-return-routed-experts``): the response's
    ``prompt_routed_experts`` [prompt_len, L, k], each choice's ``routed_experts`` [gen_len, L, k];
    the completion's routes cover the input tokens of [prompt][completion]."""
    from jaxrlvr.sampling import vllm_sampler

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 8, (4, 3, 2)).tolist()
    gens = [rng.integers(0, 8, (n, 3, 2)).tolist() for n in (3, 1)]
    body = {
        "prompt_routed_experts": prompt,
        "choices": [
            {
                "index": i,
                "finish_reason": "stop",
                "token_ids": list(range(len(g))),
                "text": "",
                "routed_experts": g,
            }
            for i, g in enumerate(gens)
        ],
    }
    out = vllm_sampler.parse_completion_response(body, 0, 2, False, prompt_len=4)
    for c, g in zip(out, gens):
        want = np.concatenate([np.asarray(prompt), np.asarray(g)])[: 4 + len(g) - 1]
        assert c.routes.dtype == np.int16
        np.testing.assert_array_equal(c.routes, want)
    del body["prompt_routed_experts"]  # the completion's only: the prompt's part is unknown
    c = vllm_sampler.parse_completion_response(body, 0, 2, False, prompt_len=4)[0]
    assert (c.routes[:4] == -1).all() and (c.routes[4:] == np.asarray(gens[0])[:2]).all()
    plain = {k: v for k, v in body["choices"][0].items() if k != "routed_experts"}
    assert (
        vllm_sampler.parse_completion_response({"choices": [plain]}, 0, 1, False)[0].routes is None
    )


def test_preflight_refuses_r3_on_a_cpu_vllm(tmp_path):
    from jaxrlvr import config as config_lib
    from jaxrlvr import configlib, preflight

    cfg = config_lib.load_config(
        "configs/demo_moe.yaml",
        [
            f"run.out_dir={tmp_path}/run",
            "rl.routing_replay=r3",
            "sampler.kind=vllm",
            "sampler.vllm_device=cpu",
        ],
    )
    with pytest.raises(configlib.PreflightError, match="routing_replay=r3.*CPU"):
        preflight.check_routing_replay(cfg)


class _TwoSteps:
    """An environment that answers twice with an observation, then ends the episode."""

    stop = ()

    def __init__(self):
        self.k = 0

    def reset(self, prompt, problem=None):
        return None

    def step(self, action):
        from jaxrlvr import envs

        self.k += 1
        return envs.EnvStep(observation=f" ok{self.k} ", done=self.k >= 3, info={})

    def close(self):
        pass


@pytest.mark.slow
def test_multi_turn_routes_align_with_one_forward_over_the_trajectory():
    """Each turn's routes continue where the last turn's stopped (environment tokens take the
    next turn's prefill): the trajectory's routes equal a single forward's over prompt +
    trajectory (float32, one sampler)."""
    from jaxrlvr import envs
    from jaxrlvr.data import tokenizer as tokenizer_lib

    tok = tokenizer_lib.build_char_tokenizer()
    cfg = dataclasses.replace(CFG, vocab_size=len(tok))
    lm = M.CausalLM(cfg, rngs=nnx.Rngs(1))
    sampler = jax_sampler.JaxSampler(lm, tok, eos_token_ids=[])
    multi = envs.MultiTurnSampler(
        sampler,
        tok,
        _TwoSteps,
        envs.TurnLimits(max_turns=4, max_tokens_per_turn=4, max_total_tokens=40),
    )
    prompt = tok("1+2=", add_special_tokens=False)["input_ids"]
    # Half the vocabulary ends a model turn, so the rollout reaches the environment.
    stops = tuple(range(3, len(tok), 2))
    params = base.SamplingParams(
        max_tokens=4, temperature=1.0, seed=0, logprobs=True, stop_token_ids=stops
    )
    (t,) = multi.generate([prompt], 1, params)
    assert t.turns >= 2 and any(t.forced)
    full = prompt + t.token_ids
    assert t.routes.shape == (len(full) - 1, cfg.num_hidden_layers, 2)
    _, _, router = lm.backbone(jnp.asarray([full[:-1]]), with_router=True)
    live = np.transpose(np.asarray(router.expert_ids), (1, 2, 0, 3))[0]
    np.testing.assert_array_equal(t.routes, live)


def test_disagreement_counts_sets_not_order():
    """Same experts in another order agree; the shares count valid tokens with routes only."""
    from jaxrlvr.algos import routing

    sampler = np.array([[[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[0, 1], [0, 1]], [[-1, -1], [0, 1]]]])
    live = np.array([[[[1, 0], [2, 3]], [[4, 6], [6, 7]], [[0, 2], [0, 3]], [[5, 6], [7, 0]]]])
    valid = np.array([[1, 1, 1, 1]])  # token 3 has no routes: not counted
    m = routing.disagreement(jnp.asarray(sampler), jnp.asarray(live), jnp.asarray(valid))
    np.testing.assert_allclose(float(m["routing/layer0/disagree"]), 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(float(m["routing/layer1/disagree"]), 1 / 3, rtol=1e-6)
    np.testing.assert_allclose(float(m["routing/disagree"]), 0.5, rtol=1e-6)
    np.testing.assert_allclose(float(m["routing/token_disagree"]), 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(float(m["routing/covered"]), 3 / 4, rtol=1e-6)


def test_r2_routes_are_the_trainers_own_and_pin_later_epochs(lm, completions):
    """R2 (``routing.trainer_routes``): the trainer's live routes of the batch under the step's
    parameters, the same as each sequence's own forward; replaying them under those parameters
    is no replay, and after the parameters move (a later epoch) they keep the experts of the
    first epoch: the output equals forcing those experts, not the moved model's live choice."""
    from jaxrlvr.algos import routing

    _, batch = _rows(completions)
    graphdef, params = nnx.split(lm, nnx.Param)
    r2 = np.asarray(jax.jit(lambda p, b: routing.trainer_routes(graphdef, p, b))(params, batch))
    for i, c in enumerate(completions):
        ids = list(PROMPTS[c.prompt_index]) + list(c.token_ids)
        n = len(ids) - 1  # label positions
        np.testing.assert_array_equal(r2[i, :n], _live_routes(lm, ids)[:n])
    first = batch.replace(routes=r2.astype(np.int16))
    np.testing.assert_array_equal(_logp(lm, first), _logp(lm, batch.replace(routes=None)))

    # "a later epoch": the router moved enough to choose other experts somewhere
    moved = jax.tree.map(lambda a: a, params)
    kernel = moved["model"]["layers"]["mlp"]["gate"]["kernel"]
    noise = jax.random.normal(jax.random.PRNGKey(3), kernel.get_value().shape)
    moved["model"]["layers"]["mlp"]["gate"]["kernel"] = nnx.Param(kernel.get_value() + 2.0 * noise)
    lm2 = nnx.merge(graphdef, moved)
    r2_later = np.asarray(
        jax.jit(lambda p, b: routing.trainer_routes(graphdef, p, b))(moved, batch)
    )
    valid = np.asarray(batch.attention_mask) > 0
    assert np.any(r2_later[valid] != r2[valid])  # the moved router's own choice differs
    pinned = _logp(lm2, first)
    assert np.max(np.abs(pinned - _logp(lm2, batch.replace(routes=None)))) > 1e-4
    np.testing.assert_array_equal(
        pinned, _logp(lm2, batch.replace(routes=r2.astype(np.int32)))
    )  # the first epoch's experts, whatever their integer dtype


MIXED = dataclasses.replace(CFG, num_hidden_layers=3, mlp_only_layers=(0,))  # dense, MoE, MoE


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.__setitem__((0, 2, 1, 0), 8), r"Batch.routes\[0, 2, 1, 0\] = 8: .*\[-1, 8\)"),
        (lambda r: r.__setitem__((0, 1, 0, 1), -2), r"Batch.routes\[0, 1, 0, 1\] = -2"),
        (lambda r: r.__setitem__((0, 3, 1), [5, 5]), r"Batch.routes\[0, 3, 1, 1\] = 5: .*twice"),
    ],
)
def test_bad_forced_routes_are_refused_in_one_line(edit, message):
    """An id outside [-1, E) or twice in one token's set is refused naming the field, the
    value and its index, before any compute (an id >= E used to give NaN logits)."""
    from jaxrlvr.algos import routing

    routes = np.tile(np.array([0, 1], np.int8), (1, 5, 2, 1))
    edit(routes)
    with pytest.raises(routing.RouteError, match=message) as err:
        routing.to_model(routes, CFG)
    assert "\n" not in str(err.value)
    routes[:] = -1  # -1 twice is "live top-k", not a repeat
    routing.to_model(routes, CFG)


def test_route_layer_axis_must_be_every_layer_or_every_moe_layer():
    from jaxrlvr.algos import routing

    with pytest.raises(routing.RouteError, match=r"axis 2\) of size 1 is neither every decoder "):
        routing.to_model(np.zeros((1, 4, 1, 2), np.int32), MIXED)
    with pytest.raises(routing.RouteError, match="need.*MoE model"):
        routing.to_model(np.zeros((1, 4, 2, 2), np.int32), dataclasses.replace(CFG, **_DENSE))
    # every decoder layer: the dense layer's row is not read (vLLM writes 0 0 there)
    every = np.array([[[[0, 0], [1, 2], [3, 4]]]], np.int32)
    routing.to_model(every, MIXED)
    with pytest.raises(routing.RouteError, match=r"Completion.routes\[0, 2, 1\] = 3: .*twice"):
        routing.check_routes(
            np.array([[[0, 0], [1, 2], [3, 3]]]),
            num_experts=8,
            sparse_layers=MIXED.sparse_layers,
            k=2,
            field="Completion.routes",
        )


_DENSE = dict(model_type="qwen3", num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0)


@pytest.mark.slow
def test_routes_over_the_moe_layers_only_equal_routes_over_every_layer():
    """A mixed layout (layer 0 dense) forced with routes over its 2 MoE layers: laid out as
    routes over all 3 layers with an unread -1 row at the dense layer, and the forward runs
    (it used to fail deep in the layer loop with a reshape TypeError)."""
    from jaxrlvr.algos import routing

    lm = M.CausalLM(MIXED, rngs=nnx.Rngs(2))
    batch = rollout.to_batch(rollout.pack([[1, 5]], [[9, 13, 2, 7]], pad_id=0))
    t = batch.input_ids.shape[1]
    rng = np.random.default_rng(0)
    moe_only = np.stack([[rng.permutation(8)[:2] for _ in range(2)] for _ in range(t)])[None]
    moe_only = moe_only.astype(np.int16)
    every = routing.layout(moe_only, MIXED.sparse_layers)
    assert every.shape == (1, t, 3, 2) and (every[:, :, 0] == -1).all()
    np.testing.assert_array_equal(every[:, :, 1:], moe_only)
    # The decoder gets the same forced experts either way (one forward shows it runs).
    np.testing.assert_array_equal(routing.to_model(moe_only, MIXED), routing.to_model(every, MIXED))
    assert np.isfinite(_logp(lm, batch.replace(routes=moe_only))).all()


def test_replay_on_a_dense_model_is_refused_in_one_line():
    """``rl.routing_replay: r3`` (or r2) on a dense model used to train on, replaying nothing;
    the routing pass refuses it when the run is assembled, naming the field."""
    from jaxrlvr import config as config_lib
    from jaxrlvr import configlib
    from jaxrlvr.passes import routing_replay

    dense = dataclasses.replace(CFG, **_DENSE)
    for mode in ("r3", "r2"):
        cfg = config_lib.load_config("configs/demo.yaml", [f"rl.routing_replay={mode}"])
        with pytest.raises(configlib.ConfigKeyError, match=rf"rl.routing_replay={mode}: .*dense"):
            routing_replay.RoutingReplay.from_config(cfg, model_cfg=dense, graphdef=None)
    cfg = config_lib.load_config("configs/demo.yaml", [])
    assert routing_replay.RoutingReplay.from_config(cfg, model_cfg=dense, graphdef=None) is None


@pytest.mark.slow
def test_basic_routing_metrics_come_from_the_update_forward(lm, completions):
    """``rl.routing_metrics: basic`` with replay off: the pass moves the recorded routes to
    ``sampler_routes`` and builds no forward of its own; the update's forward (one epoch: the
    parameters before the step) reports the disagreement, equal to ``routing.disagreement`` of
    a separate forward's live routes (counts: exact), over 2 microbatches."""
    import optax

    from jaxrlvr.algos import grpo, routing
    from jaxrlvr.passes import routing_replay

    routes = _other_routes(completions, seed=2)
    _, batch = _rows(completions, routes, batch_size=4)
    batch = batch.replace(
        advantages=np.asarray([1.0, -1.0, 0.5, -0.5], np.float32),
        sampler_logp=np.zeros(batch.input_ids.shape, np.float32),
    )
    graphdef, params = nnx.split(lm, nnx.Param)
    rp = routing_replay.RoutingReplay(CFG, graphdef, mode="none", metrics="basic")
    fed, pass_m = rp.device(None, batch, step=0)
    assert pass_m == {} and not rp._fns and fed.routes is None
    algo = grpo.grpo_algorithm(graphdef, optax.sgd(0.0), grpo.GRPOUpdateConfig(num_microbatches=2))
    state = algo.init(params, 0)
    _, metrics = jax.jit(algo.update)(state, algo.prepare(state, fed)[0])
    got = rp.finish(jax.device_get(metrics))
    _, _, router = lm.backbone(
        jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask), with_router=True
    )
    live = np.transpose(np.asarray(router.expert_ids), (1, 2, 0, 3))
    want = routing.disagreement(batch.routes, live, batch.attention_mask)
    assert want["routing/disagree"] > 0.1  # other experts than the live ones
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-6), k
    assert not any("/_" in k for k in got)


def test_completion_routes_from_a_sampler_are_checked_before_packing(completions):
    """The routing pass checks each completion's routes on the host (a vLLM response's too),
    naming the completion, the field and the position."""
    from jaxrlvr.algos import routing
    from jaxrlvr.passes import routing_replay

    rp = routing_replay.RoutingReplay(CFG, None, mode="r3")
    assert rp.host(None, PROMPTS, completions) == ({}, {})
    routes = np.array(completions[1].routes)
    routes[2, 1] = [9, 1]
    bad = list(completions)
    bad[1] = dataclasses.replace(completions[1], routes=routes)
    with pytest.raises(
        routing.RouteError, match=r"^completion 1: Completion.routes\[2, 1, 0\] = 9"
    ):
        rp.host(None, PROMPTS, bad)
    # The step's routes are checked as one array; a completion whose layer axis differs from
    # the others' is still named (here: one layer of two).
    bad[1] = dataclasses.replace(completions[1], routes=np.array(completions[1].routes)[:, :1])
    with pytest.raises(routing.RouteError, match=r"^completion 1: Completion.routes: layer axis"):
        rp.host(None, PROMPTS, bad)


def test_reference_and_teacher_passes_route_themselves_unless_told(lm, completions):
    """The KL reference's log-prob pass (``policy_gradient.policy_passes``, a record's
    ``prepare``) on a batch whose forced routes differ from the model's own: by default
    (``rl.reference_routes: auto``, no LoRA) ``ref_logp`` is the un-forced forward's, as slime
    runs the reference; with "replay" the forced one's, and with "auto" under LoRA too (the
    reference is then the policy's base, verl's rule). The old policy's pass replays always.
    A local distillation teacher (another network) never replays: slime's "fallthrough"."""
    import optax

    from jaxrlvr import config as config_lib
    from jaxrlvr import teachers
    from jaxrlvr.algos import grpo, policy_gradient
    from jaxrlvr.algos.loss_config import PolicyLossConfig
    from jaxrlvr.model import lora

    routes = _other_routes(completions, seed=4)
    _, batch = _rows(completions, routes)
    batch = jax.tree.map(jnp.asarray, batch.replace(advantages=np.zeros(4, np.float32)))
    valid = np.asarray(batch.loss_mask) > 0
    cfg = grpo.GRPOUpdateConfig(loss=PolicyLossConfig(kl_coef=0.1))
    lora_lm = M.CausalLM(
        dataclasses.replace(CFG, lora=lora.LoRAConfig(rank=2, alpha=4.0)), rngs=nnx.Rngs(1)
    )
    for model, cases in ((lm, (("auto", False), ("replay", True))), (lora_lm, (("auto", True),))):
        graphdef, params = nnx.split(model, nnx.Param)
        fn = jax.jit(engine.make_logprob_fn(graphdef))  # one program each: routes or none
        forced = np.asarray(fn(params, batch)[0])
        live = np.asarray(fn(params, batch.replace(routes=None))[0])
        assert np.max(np.abs(forced - live)[valid]) > 1e-3  # the forced experts matter
        if model is lm:  # the teacher's pass on the student's batch, forced routes and all
            teacher = np.asarray(teachers.LocalTeacher(graphdef, params).batch_logprobs(batch))
            np.testing.assert_allclose(teacher[valid], live[valid], atol=1e-6)
        for mode, replayed in cases:
            algo = grpo.grpo_algorithm(graphdef, optax.sgd(0.0), cfg, reference_routes=mode)
            got, _ = policy_gradient.policy_passes(
                fn, algo.init(params, 0), batch, reference_routes=mode
            )
            want = forced if replayed else live
            np.testing.assert_allclose(np.asarray(got.ref_logp)[valid], want[valid], atol=1e-6)
            np.testing.assert_array_equal(np.asarray(got.old_logp), forced)
    # The record wires its ``reference_routes`` into ``prepare`` (the non-default one here).
    graphdef, params = nnx.split(lm, nnx.Param)
    algo = grpo.grpo_algorithm(graphdef, optax.sgd(0.0), cfg, reference_routes="replay")
    prepared = jax.jit(algo.prepare)(algo.init(params, 0), batch)[0]
    fn = jax.jit(engine.make_logprob_fn(graphdef))
    np.testing.assert_allclose(
        np.asarray(prepared.ref_logp)[valid], np.asarray(fn(params, batch)[0])[valid], atol=1e-5
    )
    with pytest.raises(ValueError, match="^rl.reference_routes='r3': expected one of auto"):
        grpo.grpo_algorithm(graphdef, optax.sgd(0.0), cfg, reference_routes="r3")
    with pytest.raises(ValueError, match="rl.reference_routes"):
        config_lib.load_config("configs/demo.yaml", ["rl.reference_routes=r3"])
    run = config_lib.load_config("configs/demo.yaml", ["rl.reference_routes=replay"])
    assert run.rl.reference_routes == "replay"


def test_stand_in_completions_and_pass_carry_what_generate_and_device_give(lm, completions):
    """Compiling the RL step ahead (``RLPhase.programs_ahead``) lowers it for stand-in
    rollouts: ``JaxSampler.stand_in`` around the same tokens carries every field ``generate``
    gives in the same shape and dtype (routes [P + C - 1, L, k], log-probs per token), and the
    routing pass's ``stand_in`` lays them out as its ``device`` part does (replay off: routes
    moved to ``sampler_routes``; r3: kept), or says it cannot where they need the state (r2)."""
    from jaxrlvr.passes import routing_replay

    sampler = jax_sampler.JaxSampler(lm, eos_token_ids=[])
    params = base.SamplingParams(max_tokens=6, temperature=1.0, seed=0, logprobs=True)
    fake = sampler.stand_in(PROMPTS, [c.token_ids for c in completions], params)
    for real, got in zip(completions, fake, strict=True):
        assert got.prompt_index == real.prompt_index and got.token_ids == real.token_ids
        assert len(got.logprobs) == len(real.logprobs)
        assert got.routes.shape == real.routes.shape and got.routes.dtype == real.routes.dtype
    _, batch = _rows(completions, [c.routes for c in completions], batch_size=4)
    _, fake_batch = _rows(fake, [c.routes for c in fake], batch_size=4)
    for mode in ("none", "r3"):
        rp = routing_replay.RoutingReplay(CFG, None, mode=mode)
        want, _ = rp.device(None, batch, step=0)
        got = rp.stand_in(fake_batch, step=0)
        shapes = lambda b: jax.tree.map(lambda x: (np.shape(x), np.asarray(x).dtype), b)  # noqa: E731
        assert shapes(got) == shapes(want), mode
    assert not routing_replay.RoutingReplay(CFG, None, mode="r2").can_stand_in
