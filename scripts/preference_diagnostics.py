"""Noise-free diagnostics of preference (or RL) runs on the demo task (docs/preference.md).

Usage: python scripts/preference_diagnostics.py WARM_HF_DIR PAIRS_JSONL RUN_DIR [RUN_DIR ...]

For the warm start (an exported Hugging Face folder) and each run's newest checkpoint:
- exact held-out accuracy: the mean over the first 100 held-out problems of P(gold completion)
  at temperature 1 (one forward per problem; the expected value of the sampled avg@n, without
  its sampling noise; other strings graded correct are ignored);
- on the training pairs, the mean summed log-probs of the chosen and the rejected responses,
  and their change from the warm start split into the tokens the two responses share (the
  prefix up to their first difference), the first differing token, and the tokens after it.
"""

import json
import sys

import jax
import numpy as np

from jaxrlvr import assembly, builders, rollout
from jaxrlvr import config as config_lib
from jaxrlvr import model as model_lib
from jaxrlvr import prompts as prompt_lib
from jaxrlvr.algos import engine


def main(warm: str, pairs_path: str, runs: list[str]) -> None:
    cfg = config_lib.load_config("configs/demo.yaml", [f"model.path={warm}"])
    mesh = model_lib.make_mesh(model_lib.MeshConfig(data=1, fsdp=-1, tensor=1))
    tok = builders.build_tokenizer(cfg.model)
    heldout = builders.load_splits(cfg)[1][:100]
    pairs = [json.loads(line) for line in open(pairs_path)]

    def response_logps(lm, prompts, responses):
        fn = jax.jit(lambda b: engine.token_logprobs(lm, b)[0])
        out = []
        for i in range(0, len(prompts), 256):
            p = [prompt_lib.encode(tok, x) for x in prompts[i : i + 256]]
            r = [prompt_lib.encode(tok, x) + [tok.eos_token_id] for x in responses[i : i + 256]]
            b = rollout.to_batch(rollout.pack(p, r, pad_id=tok.pad_token_id, max_length=64))
            logp, m = np.asarray(fn(b)), np.asarray(b.loss_mask) > 0
            out += [logp[j][m[j]] for j in range(len(p))]
        return out

    def measure(lm):
        gold = response_logps(
            lm,
            [prompt_lib.render(cfg.data.template, p, tok) for p in heldout],
            [cfg.data.gold_format.replace("{answer}", p.answer) for p in heldout],
        )
        acc = float(np.mean([np.exp(g.sum()) for g in gold]))
        prompts = [p["prompt"] for p in pairs]
        chosen = response_logps(lm, prompts, [p["chosen"] for p in pairs])
        rejected = response_logps(lm, prompts, [p["rejected"] for p in pairs])
        return acc, chosen, rejected

    def parts(pair, x):
        a, b = prompt_lib.encode(tok, pair["chosen"]), prompt_lib.encode(tok, pair["rejected"])
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return np.asarray([x[:k].sum(), x[k : k + 1].sum(), x[k + 1 :].sum()])

    w_acc, wc, wr = measure(builders.build_model(cfg.model, tok, mesh, seed=cfg.run.seed))
    mean = lambda xs: np.mean([x.sum() for x in xs])  # noqa: E731
    print(f"warm start: exact accuracy {w_acc:.4f}; chosen {mean(wc):.3f}, rejected {mean(wr):.3f}")
    for run in runs:
        run_cfg = config_lib.load_config(f"{run}/config.yaml", [])
        acc, c, r = measure(assembly.restore_policy(run_cfg, run, mesh, tok)[1])
        dc = np.mean([parts(p, c[i]) - parts(p, wc[i]) for i, p in enumerate(pairs)], 0)
        dr = np.mean([parts(p, r[i]) - parts(p, wr[i]) for i, p in enumerate(pairs)], 0)
        print(
            f"{run}: exact accuracy {acc:.4f} ({acc - w_acc:+.4f}); chosen {mean(c):.3f}, "
            f"rejected {mean(r):.3f}; change [shared, first diff, rest] chosen "
            f"{np.round(dc, 3).tolist()} rejected {np.round(dr, 3).tolist()}"
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
