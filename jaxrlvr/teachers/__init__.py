"""Teachers for on-policy distillation: the local JAX teacher (``local``), the vLLM teacher
(``vllm``), and their loading, checks, choice per domain and metrics (``registry``).

Everything a user needs is re-exported here (``jaxrlvr.teachers.LocalTeacher``,
``TeacherRegistry``, ``load_teacher``, ...); ``VLLMTeacher`` is imported from ``teachers.vllm``
(it pulls in the HTTP client). When scoring runs, on the host or on device, is the rollout pass
``passes.teacher_scores``'s.
"""

from jaxrlvr.teachers.local import LocalTeacher, TeacherError
from jaxrlvr.teachers.registry import (
    Teacher,
    TeacherRegistry,
    check_teacher,
    device_scores,
    is_url,
    load_registry,
    load_teacher,
    metrics,
    missing_domain,
)

__all__ = [
    "LocalTeacher",
    "Teacher",
    "TeacherError",
    "TeacherRegistry",
    "check_teacher",
    "device_scores",
    "is_url",
    "load_registry",
    "load_teacher",
    "metrics",
    "missing_domain",
]
