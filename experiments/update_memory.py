"""What XLA allocates for a step's programs, compiled but not run, on any backend.

Builds the trainer as `bench_rl_step.py` does (same flags), traces the step's programs
on the shapes it would give them and prints each one's memory analysis: temporaries,
arguments, outputs and the bytes aliased between them. A program that does not fit a
card can be sized this way on the CPU or on a smaller card (XLA:CPU keeps some bf16
values in float32, so its temporaries run larger than a GPU's).

    python experiments/update_memory.py --preset gemma-3-1b --num_layers 4 --algo grpo \
        --micro_batch 64 [--programs learn forward]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import bench_rl_step as bench


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--programs", nargs="+", default=["learn"],
                        help="of the step's programs: generate, forward, learn")
    ours, rest = parser.parse_known_args(argv)
    args = bench.parse_args(rest)
    algo = "grpo" if args.algo == "both" else args.algo
    bench.set_head_kernel(args)
    gib = 2 ** 30
    with tempfile.TemporaryDirectory() as workdir:
        trainer = bench.build_trainer(args, algo, workdir)[0]
        config = trainer.programs.model_config
        print(f"{args.preset}: {config.num_layers} layers, {algo}, {args.batch} x {args.n}, "
              f"P{args.prompt_len} / R{args.response_len}, micro-batch {args.micro_batch}, "
              f"remat {args.remat}", flush=True)
        with trainer.sharder.active():
            traced = trainer.programs.trace_step(trainer.state, trainer.ref_params,
                                                 trainer.frozen, trainer.root_key,
                                                 trainer.rollouts.needs_baseline)
            print("| program | compile s | temp GiB | arguments GiB | outputs GiB | "
                  "aliased GiB |\n|---|---|---|---|---|---|")
            for name in ours.programs:
                if name not in traced:
                    sys.exit(f"no program {name!r} in this step: {sorted(traced)}")
                start = time.perf_counter()
                compiled = traced[name].lower().compile()
                seconds = time.perf_counter() - start
                m = compiled.memory_analysis()
                print(f"| {name} | {seconds:.1f} | {m.temp_size_in_bytes / gib:.2f} | "
                      f"{m.argument_size_in_bytes / gib:.2f} | "
                      f"{m.output_size_in_bytes / gib:.2f} | "
                      f"{m.alias_size_in_bytes / gib:.2f} |", flush=True)
        trainer.close()


if __name__ == "__main__":
    main()
