"""Device mesh and the logical-axis rules that map parameter and activation names onto it.

Every parameter carries a ``logical_axes`` tuple (``embed``, ``heads``, ``mlp``, ...). One small
rules table maps each logical name to mesh axes of the mesh ``('data', 'fsdp', 'expert',
'tensor')``:

- ``embed`` is sharded over ``('fsdp', 'expert')`` (ZeRO-3 style: weights gathered per layer on
  use),
- ``heads``, ``kv_heads``, ``mlp``, ``vocab`` over ``tensor`` (Megatron-style column/row split),
- activations' ``batch`` over ``('data', 'fsdp', 'expert')``,
- ``expert`` (the stacked experts of a MoE block, ``[E, ...]``) over ``('expert', 'fsdp')``.

The ``expert`` mesh axis (1 unless ``MeshConfig.expert`` asks for more) is expert parallelism:
outside the MoE blocks it is one more batch-and-ZeRO axis, like ``fsdp``; inside them each
device keeps E / expert experts and the tokens travel to them (``model.expert_parallel``), so
the experts are never gathered whole. With ``expert=1`` the axis drops out of every rule and the
experts are split over ``fsdp`` as before (whole experts per device, gathered per layer on use,
as fsdp gathers any weight). A dimension takes a mesh axis only once, so an expert kernel
[E, D, F] puts ``('expert', 'fsdp')`` on E and leaves ``embed`` whole, while ``mlp`` stays on
``tensor``; when E is not divisible by those sizes, ``embed`` takes them as in a dense layer.

A dimension whose size is not divisible by its mesh axes is replicated rather than failing, so
the same rules work for tiny test models and real checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")

# logical name -> mesh axis (or tuple of axes), None = replicated.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "seq": None,
    "layers": None,
    "embed": ("fsdp", "expert"),
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "expert": ("expert", "fsdp"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Mesh sizes per axis; one axis may be -1 for "all remaining devices"."""

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.expert, self.tensor)
        if sum(s == -1 for s in sizes) > 1:
            raise ValueError(f"mesh: at most one axis may be -1, got {dict(zip(MESH_AXES, sizes))}")
        for name, s in zip(MESH_AXES, sizes):
            if s == 0 or s < -1:
                raise ValueError(f"mesh.{name}={s}: must be a positive integer or -1")

    def resolve(self, num_devices: int) -> tuple[int, int, int, int]:
        sizes = [self.data, self.fsdp, self.expert, self.tensor]
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(
                    f"mesh: {num_devices} devices are not divisible by the fixed axes "
                    f"{dict(zip(MESH_AXES, sizes))}"
                )
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(
                f"mesh: axes {dict(zip(MESH_AXES, sizes))} need {math.prod(sizes)} devices, "
                f"{num_devices} available"
            )
        return tuple(sizes)


def make_mesh(cfg: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a ('data', 'fsdp', 'expert', 'tensor') mesh over ``devices`` (default: all, every
    process)."""
    cfg = cfg or MeshConfig()
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.resolve(len(devices))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def single_device_mesh(device: jax.Device | None = None) -> Mesh:
    return make_mesh(MeshConfig(data=1, fsdp=1, expert=1, tensor=1), [device or jax.devices()[0]])


def logical_to_pspec(
    logical_axes: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    rules: dict | None = None,
) -> PartitionSpec:
    """Maps logical names to a PartitionSpec; with ``shape`` and ``mesh``, non-divisible dims and
    mesh axes already used by an earlier dimension are replicated."""
    rules = LOGICAL_RULES if rules is None else rules
    used: set[str] = set()
    spec = []
    for i, name in enumerate(logical_axes):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise KeyError(f"no sharding rule for logical axis {name!r}")
        axes = rules[name]
        axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        axes = tuple(a for a in axes if a not in used)
        if mesh is not None:
            axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
            if shape is not None and axes and shape[i] % math.prod(mesh.shape[a] for a in axes):
                axes = ()
        used.update(axes)
        spec.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def logical_sharding(
    logical_axes: Sequence[str | None] | None, shape: Sequence[int] | None, mesh: Mesh
) -> NamedSharding:
    """The ``NamedSharding`` of an array of ``shape`` whose dimensions carry ``logical_axes``
    (``None``: replicated). The one place where logical names become a sharding: parameters,
    optimiser state, KV caches and activation constraints all come through here."""
    if logical_axes is None:
        return NamedSharding(mesh, PartitionSpec())
    return NamedSharding(mesh, logical_to_pspec(logical_axes, shape, mesh))


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _variable_axes(v: nnx.Variable) -> Sequence[str | None] | None:
    return v.get_metadata().get("logical_axes")


def logical_shardings(tree, mesh: Mesh):
    """A ``NamedSharding`` for every leaf of ``tree`` (same structure, ``Variable`` wrappers kept).

    Each ``nnx.Variable`` is sharded by its ``logical_axes`` metadata (replicated without one),
    which covers parameters and the optax moments that copy them; every other leaf (steps,
    counts, rng keys) is replicated. ``param_shardings`` and ``algos.step.state_shardings`` are
    this function.
    """
    replicated = NamedSharding(mesh, PartitionSpec())

    def leaf(x):
        if _is_variable(x):
            return x.replace(logical_sharding(_variable_axes(x), x.get_value().shape, mesh))
        return replicated

    return jax.tree.map(leaf, tree, is_leaf=_is_variable)


def param_partition_specs(params: nnx.State, mesh: Mesh | None = None) -> nnx.State:
    """PartitionSpec per parameter from its ``logical_axes`` metadata (a State of specs)."""

    def spec(v):
        axes = _variable_axes(v)
        if axes is None:
            return PartitionSpec()
        return logical_to_pspec(axes, v.get_value().shape, mesh)

    return jax.tree.map(spec, params, is_leaf=_is_variable)


def param_shardings(params: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedSharding per parameter (same tree structure as ``params``, Variable wrappers kept)."""
    return logical_shardings(params, mesh)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Sharding of a batch-leading array: batch over ('data', 'fsdp', 'expert'), the rest
    replicated."""
    axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    first = None if not axes else (axes[0] if len(axes) == 1 else axes)
    return NamedSharding(mesh, PartitionSpec(first, *([None] * (ndim - 1))))


def constrain(x: jax.Array, logical_axes: Sequence[str | None], mesh: Mesh | None) -> jax.Array:
    """Activation sharding constraint by logical names; a no-op only when no mesh is given."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_sharding(logical_axes, x.shape, mesh))
