"""A new phase is its module plus one line in ``phases.PLAN`` (issue 46 item 3): a toy phase,
written here as a contributor would write its module, is planned, named, restored through the
method registry and reports its own summary lines, with no other file edited."""

from jaxrlvr import config as config_lib
from jaxrlvr import phases
from jaxrlvr.algos import registry
from jaxrlvr.phases import base, rl


class CISPOPolishPhase(rl.RLPhase):
    """Toy phase: when ``rl.algo`` is cispo, a run's training slot is this phase (same steps as
    the RL phase, its own checkpoint name, method and printed line)."""

    name = "cispo_polish"

    @classmethod
    def wanted(cls, cfg: base.Sections) -> bool:
        return cfg.rl.algo == "cispo"

    @classmethod
    def method(cls, cfg):
        return "cispo"

    def summary(self, evals):
        return {"polish_steps": self.position}

    def report(self, summary):
        return [f"polished with CISPO for {summary['polish_steps']} steps"]


def _cfg(algo):
    return config_lib.load_config("configs/demo.yaml", [f"rl.algo={algo}"])


def test_a_toy_phase_is_its_module_plus_one_line_in_the_plan(monkeypatch):
    # The one line: the phase stands before the phase it replaces in its slot.
    i = [cls for _, cls in phases.PLAN].index(rl.RLPhase)
    plan = (*phases.PLAN[:i], ("train", CISPOPolishPhase), *phases.PLAN[i:])
    monkeypatch.setattr(phases, "PLAN", plan)

    cispo = _cfg("cispo")
    assert [c.name for c in phases.plan(cispo)] == ["sft", "cispo_polish"]
    assert phases.by_name(cispo)["cispo_polish"] is CISPOPolishPhase
    method = CISPOPolishPhase.method(CISPOPolishPhase.view(cispo))
    assert registry.get(method).name == "cispo"  # a checkpoint's method restores through it
    # Other runs keep their phases.
    assert [c.name for c in phases.plan(_cfg("grpo"))] == ["sft", "rl"]

    phase = CISPOPolishPhase.__new__(CISPOPolishPhase)
    phase.position = 3
    assert phase.report(phase.summary({})) == ["polished with CISPO for 3 steps"]
