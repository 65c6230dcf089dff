"""A/B figures of docs/integration.md: ds_seqpar.initialize + ZeRO vs one process without SP.

Runs ``tests/helpers/hf_ab.py::deepspeed_ab`` (5 SGD steps, lr 0.5, S = 64, float32 tiny models)
for every ``AB_CASES`` entry and the PEFT LoRA case on 4 gloo ranks, and writes the worst rank's
relative errors to ``benchmarks/results/ab_hf_cpu.txt``::

    python -m benchmarks.ab_hf
"""

from __future__ import annotations

from benchmarks.common import RESULTS

HEADER = """# A/B of ds_seqpar.initialize + ZeRO against one process without SP (tests/helpers/hf_ab.py::deepspeed_ab),
# 4 gloo CPU ranks, float32, tiny random-init models, S=64, 5 SGD steps (lr 0.5), relative errors, worst rank.
# Produced by `python -m benchmarks.ab_hf`.
"""


def main() -> None:
    from tests.helpers.harness import DistPool
    from tests.helpers.hf_ab import AB_CASES, deepspeed_ab

    cases = [(*case, False) for case in AB_CASES] + [("llama", 4, 2, 3, True)]
    lines = []
    with DistPool(4) as pool:
        for kind, sp, u, stage, lora in cases:
            reps = pool.run(deepspeed_ab, kind, sp, u, stage, 5, 64, 0.5, lora)
            loss = max(max(r["loss_errs"]) for r in reps)
            grad = max(r["grad_err"] for r in reps)
            name = f"{kind}{' + LoRA' if lora else ''}"
            line = f"{name} dp={4 // sp} sp={sp} U={u} ZeRO-{stage}: max loss rel err {loss:.2e}, step-1 grad rel err {grad:.2e}"
            print(line, flush=True)
            lines.append(line)
    (RESULTS / "ab_hf_cpu.txt").write_text(HEADER + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
