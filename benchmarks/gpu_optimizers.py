"""The optimizer table of optimizer_memory.py on a CUDA device, with a loss and a resume check.

For ``adamw_torch`` (the baseline), the names whose library needs CUDA (``galore_adamw_8bit``,
``galore_adamw_8bit_layerwise``; ``adalomo``, which the library can only build on CUDA and
engine-lomo also runs on the CPU) and the paged bitsandbytes names (``paged_*``: their state
lives in CUDA unified memory), each in a fresh worker process, this trains the same model
and batches as ``optimizer_memory.py`` (whose code it imports: settings, workers, table) for
``--steps`` steps and reports

* ``state MiB``, ``steps/s`` and their ratios to adamw_torch, as there;
* ``peak MiB``: ``torch.cuda.max_memory_allocated()`` over the timed steps (the peak stats
  are reset at the end of the last warm-up step), minus what was allocated before the model
  was built. Paged state is allocated by bitsandbytes in unified memory, outside torch's
  allocator: it is in ``state MiB`` but not in ``peak MiB``;
* ``loss falls``: the last step's training loss is below the first step's;
* ``resume``: the run saves a checkpoint after step ``steps - 1``; a new ``Run`` (fresh model,
  same config) resumes from it and trains the last step; its weights and loss must equal the
  uninterrupted run's exactly (``identical``; otherwise the largest weight difference). The
  workers run with ``torch.use_deterministic_algorithms(True, warn_only=True)`` so that CUDA
  kernels are repeatable.

Steps ``warmup + 1`` .. ``steps - 1`` are timed (the last step follows the checkpoint save).
Without a CUDA device it says so and exits 0. ``--device cpu`` runs the same checks on the
CPU (the GaLore 8-bit names are then refused by the engine, paged names train unpaged): a
check of this script's logic, not a benchmark. Always exits 0.

Run (meant to take under 5 minutes on one H200: 10 workers of ~20 s, mostly imports)::

    .venv/bin/python benchmarks/gpu_optimizers.py
    .venv/bin/python benchmarks/gpu_optimizers.py --device cpu --model tiny-llama   # the logic, on CPU
    .venv/bin/python benchmarks/gpu_optimizers.py --names paged_adamw_8bit --steps 10
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import optimizer_memory as om  # benchmarks/optimizer_memory.py: this script's folder is on sys.path
import torch

from engine.catalogue import FIRST_PARTY

CUDA_NAMES = ("galore_adamw_8bit", "galore_adamw_8bit_layerwise", "adalomo")
PAGED_NAMES = tuple(name for name in FIRST_PARTY["bnb"].provides["optimizer"] if name.startswith("paged_"))


def check(name: str, args: argparse.Namespace, output_dir: str) -> dict[str, Any]:
    """Train ``name``, measure it, then resume its checkpoint of step ``steps - 1`` in a new Run."""
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # needed for deterministic cuBLAS
    torch.use_deterministic_algorithms(True, warn_only=True)
    saved = args.steps - 1
    checkpoints = {"save_strategy": "steps", "save_steps": saved}
    result, run = om.measure(name, args, output_dir, args.device, last=saved, **checkpoints)
    trained = {key: value.detach().cpu().clone() for key, value in run.model.state_dict().items()}
    del run
    resumed = om.new_run(name, args, om.new_model(args.model), output_dir, om.Probe(), args.device,
                         resume_from_checkpoint=os.path.join(output_dir, f"checkpoint-{saved}"), **checkpoints)
    resumed.train()
    result["resume_weight_diff"] = max((value.detach().cpu() - trained[key]).abs().max().item()
                                       for key, value in resumed.model.state_dict().items())
    result["resume_loss"] = om.losses(resumed)[-1]
    return result


def loss_falls(result: dict[str, Any]) -> bool:
    return result["losses"][-1] < result["losses"][0]


def resume_identical(result: dict[str, Any]) -> bool:
    return result["resume_weight_diff"] == 0 and result["resume_loss"] == result["losses"][-1]


def resume_cell(result: dict[str, Any]) -> str:
    if resume_identical(result):
        return "identical"
    return (f"DIFFERS: max |dw| {result['resume_weight_diff']:.1e}, "
            f"loss {result['resume_loss']} vs {result['losses'][-1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    om.add_arguments(parser, steps=20, warmup=5, batch_size=8)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default); cpu checks the script's logic where no GPU is lent")
    args = parser.parse_args()
    if args.worker:
        om.worker(args, check)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (gpu_optimizers.py needs a GPU; --device cpu runs its "
              "checks on the CPU)")
        return
    names = om.selected_names(parser, args, [om.BASELINE, *CUDA_NAMES, *PAGED_NAMES])
    if args.steps < args.warmup + 3:
        parser.error("--steps must be at least --warmup + 3 (timed steps, then the resumed step)")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (logic check, not a GPU figure)"
    results = om.benchmark(__file__, args, names, device,
                           extra={"loss falls": lambda r: "yes" if loss_falls(r) else "NO", "resume": resume_cell})
    peak = "torch.cuda.max_memory_allocated" if args.device == "cuda" else "resident memory high-water mark"
    print(f"(state: tensors in optimizer.state_dict(); peak: {peak} over the timed steps above what was "
          "allocated before the model was built; steps/s: 1 / median step time; ratios to adamw_torch; "
          "resume: checkpoint after the second-last step, resumed in a new Run, last step compared)")
    if args.device == "cuda" and any(name in PAGED_NAMES for name in names):
        print("(paged names: bitsandbytes allocates their state in CUDA unified memory, which "
              "max_memory_allocated does not see: their peak leaves the state out)")
    ran = {name: r for name, r in results.items() if "refused" not in r and "failed" not in r}
    failed = ([f"{name}: {'refused' if 'refused' in r else 'failed'}" for name, r in results.items() if name not in ran]
              + [f"{name}: loss did not fall" for name, r in ran.items() if not loss_falls(r)]
              + [f"{name}: resume not identical" for name, r in ran.items() if not resume_identical(r)])
    print()
    print("checks: " + ("all passed" if not failed else "; ".join(failed)))


if __name__ == "__main__":
    main()
