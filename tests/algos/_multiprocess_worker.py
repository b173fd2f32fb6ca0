"""Worker for test_multiprocess.py: one GRPO update on a mesh over every process's devices.

Usage: python _multiprocess_worker.py OUT PORT NUM_PROCESSES PROCESS_ID
With NUM_PROCESSES == 1 it runs in a single process on a one-device mesh (the reference).
Each process has 4 fake CPU devices and uses gloo collectives. The same update runs twice from
the same initial state: once on the full batch that every process holds (``step.shard_batch``),
once on only this process's own rows (``step.shard_local_batch``). Every process writes the
updated params (gathered to its host) and the loss of both runs, the second under "local/", and
the global row indices it fed to the second, to OUT.<process_id>.npz.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jaxrlvr import distributed  # noqa: E402
from jaxrlvr import model as M  # noqa: E402
from jaxrlvr.algos import algorithm, grpo, optim, step  # noqa: E402
from jaxrlvr.algos import batch as batch_lib  # noqa: E402
from jaxrlvr.algos import state as state_lib  # noqa: E402

B, T = 8, 16


def make_batch() -> batch_lib.Batch:
    rng = np.random.default_rng(0)
    full = rng.integers(0, 128, (B, T + 1)).astype(np.int32)
    resp = rng.integers(2, 10, B)
    pos = np.arange(T)[None, :]
    return batch_lib.Batch(
        input_ids=full[:, :-1],
        attention_mask=(pos < (4 + resp)[:, None]).astype(np.int32),
        labels=full[:, 1:],
        loss_mask=(pos >= 3) & (pos < (3 + resp)[:, None]),
        advantages=rng.normal(size=B).astype(np.float32),
        old_logp=(-5.0 + 0.3 * rng.normal(size=(B, T))).astype(np.float32),
    )


def main(out: str, port: int, num_processes: int, process_id: int) -> None:
    if num_processes > 1:
        distributed.initialize(
            distributed.DistributedConfig(
                enabled=True,
                coordinator_address=f"127.0.0.1:{port}",
                num_processes=num_processes,
                process_id=process_id,
                initialization_timeout=120,
            )
        )
        assert jax.process_count() == num_processes
        mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))  # all 8 devices
    else:
        mesh = M.make_mesh(M.MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    cfg = M.ModelConfig.tiny()
    lm = M.init_model(cfg, seed=0, mesh=mesh)
    graphdef, params = nnx.split(lm, nnx.Param)
    # Adam's eps = 1e-4 instead of 1e-8: an update is lr * g / (|g| + eps), whose sensitivity to
    # float rounding of a near-zero gradient is up to lr / eps. With 1e-8 that turns ~1e-9
    # reduction-order noise into ~1e-4 parameter differences on a handful of elements; with
    # 1e-4 it stays below 1e-7, so the comparison tests the sharding, not Adam's conditioning.
    tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, eps=1e-4))
    upd = grpo.make_grpo_update(graphdef, tx, grpo.GRPOUpdateConfig(num_microbatches=2))
    state = step.shard_state(state_lib.TrainState.create(graphdef, params, tx), mesh)
    ssh = step.state_shardings(state, mesh)
    # A second copy of the initial state (the first update donates the first one's buffers).
    state_local = jax.device_put(state, ssh, may_alias=False)
    batch = make_batch()
    # The bare update as a record whose rollouts are its batch, compiled as the driver compiles:
    # once fed the global batch, once only this process's rows.
    rec = algorithm.Algorithm(
        name="grpo",
        init=None,
        prepare=lambda state, batch: (batch, {}),
        update=upd,
        rollout_spec=upd.batch_spec,
    )
    compiled = step.CompiledAlgorithm(rec, mesh, ssh, local_rows=False)
    compiled_local = step.CompiledAlgorithm(rec, mesh, ssh, local_rows=True)
    flat = {"num_devices": np.asarray(len(mesh.devices.flat))}

    def record(prefix, state, metrics):
        for path, v in nnx.to_flat_state(state.params):
            name = prefix + "/".join(str(k) for k in path)
            flat[name] = np.asarray(multihost_utils.process_allgather(v, tiled=True))
        flat[prefix + "metric/loss"] = np.asarray(jax.device_get(metrics["loss"]))

    # The full batch on every process.
    record("", *compiled.update(state, compiled.prepare(state, batch)[0]))
    # Only this process's rows: the other process's rows never reach this one.
    rows = step.process_batch_rows(mesh, B)
    local = jax.tree.map(lambda x: x[rows], batch)
    assert local.input_ids.shape[0] == B // num_processes
    placed, _ = compiled_local.prepare(state_local, local)
    record("local/", *compiled_local.update(state_local, placed))
    flat["local_rows"] = rows
    np.savez(f"{out}.{process_id}.npz", **flat)
    if num_processes > 1:
        multihost_utils.sync_global_devices("done")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
