"""Pass fields (``batch.register_field``): declared by the module that owns them, carried by
``Batch`` in ``extra`` by name through construction, ``replace``, pytrees, jit, padding and
validation, with one-line errors naming the field."""

import jax
import numpy as np
import pytest

from jaxrlvr.algos import algorithm, distill, routing, step
from jaxrlvr.algos import batch as batch_lib


def _base(b=2, t=3) -> dict:
    return dict(
        input_ids=np.zeros((b, t), np.int32),
        attention_mask=np.ones((b, t), np.int32),
        labels=np.zeros((b, t), np.int32),
        loss_mask=np.ones((b, t), np.float32),
    )


def test_the_owning_modules_declare_the_fields_and_batch_names_none():
    fields = batch_lib.known_fields()
    assert fields["routes"] is routing.ROUTES and routing.ROUTES.model
    assert fields["teacher_topk_ids"] is distill.TEACHER_TOPK_IDS
    assert (distill.TEACHER_TOPK_IDS.layout, distill.TEACHER_TOPK_IDS.kind) == ("btk", "int")
    assert set(batch_lib.model_fields()) == {"routes", "sampler_routes"}
    assert routing.ROUTES.fill == -1 and distill.TEACHER_LOGP.fill == 0
    # batch.py's source names no pass field.
    source = open(batch_lib.__file__).read()
    assert not any(n in source for n in ("teacher_", "routes", "domain_ids"))


def test_register_field_refuses_bad_and_conflicting_declarations():
    with pytest.raises(ValueError, match="'labels' is a core Batch field"):
        batch_lib.register_field("labels", "bt", "int")
    with pytest.raises(ValueError, match="batch field 'routes' registered twice"):
        batch_lib.register_field("routes", "bt", "int")
    with pytest.raises(ValueError, match="layout must be one of"):
        batch_lib.register_field("x_new", "tb")
    assert batch_lib.register_field("routes", "btlk", "route", model=True) == routing.ROUTES


def test_pass_fields_by_name_through_replace_pytrees_and_jit():
    routes = np.full((2, 3, 1, 2), 1, np.int16)
    b = batch_lib.Batch(**_base(), routes=routes, teacher_logp=None)
    assert b.routes is routes and b.teacher_logp is None and set(b.extra) == {"routes"}
    b = b.replace(teacher_logp=np.ones((2, 3), np.float32), routes=None)
    assert b.routes is None and list(b.extra) == ["teacher_logp"]
    assert list(b.as_dict()) == [*_base(), "teacher_logp"]
    mapped = jax.tree.map(lambda x: x + 1, b)
    assert isinstance(mapped, batch_lib.Batch) and float(mapped.teacher_logp.sum()) == 12.0
    assert float(jax.jit(lambda x: x.teacher_logp.sum())(b)) == 6.0
    with pytest.raises(TypeError, match="unknown field 'teacher_lgp'"):
        batch_lib.Batch(**_base(), teacher_lgp=np.zeros((2, 3), np.float32))
    with pytest.raises(AttributeError, match="Batch has no field 'teacher_lgp'"):
        _ = b.teacher_lgp


def test_validation_select_fields_and_padding_treat_pass_fields_like_the_core():
    spec = batch_lib.BatchSpec(required=("teacher_logp",))
    good = batch_lib.Batch(**_base(), teacher_logp=np.zeros((2, 3), np.float32))
    assert batch_lib.validate_batch(good, spec) == (2, 3)
    with pytest.raises(batch_lib.BatchError, match=r"batch\.teacher_logp is required"):
        batch_lib.validate_batch(batch_lib.Batch(**_base()), spec)
    with pytest.raises(batch_lib.BatchError, match=r"batch\.teacher_logp must be float32"):
        batch_lib.validate_batch(good.replace(teacher_logp=np.zeros((2, 3), np.int32)), spec)
    topk = good.replace(teacher_topk_ids=np.zeros((2, 3, 4), np.int32))
    with pytest.raises(batch_lib.BatchError, match=r"batch\.teacher_topk_ids is not used"):
        batch_lib.validate_batch(topk, spec)
    bad_routes = good.replace(routes=np.zeros((2, 3, 2), np.int16))
    with pytest.raises(batch_lib.BatchError, match=r"batch\.routes must have shape \(2, 3, 'L'"):
        batch_lib.validate_batch(bad_routes, spec)
    # Model fields pass every spec; fields the spec does not use are dropped.
    routed = topk.replace(routes=np.zeros((2, 3, 1, 2), np.int8))
    kept = algorithm.select_fields(routed, spec)
    assert set(kept.extra) == {"teacher_logp", "routes"}
    padded = step.pad_rows(kept, 3, 4)
    assert padded.routes.shape == (3, 4, 1, 2) and (padded.routes[2] == -1).all()
    assert (padded.routes[:2, :3] == 0).all() and (padded.teacher_logp[2] == 0).all()
