#!/usr/bin/env python3
"""torch._grouped_mm on the group sizes moonep-bench-gemm-cuda measured, and the merged table.

    moonep-bench-gemm-cuda --out ours.csv --shapes-out shapes.txt
    python3 bench/torch_grouped_mm.py --shapes shapes.txt --ours ours.csv [--out torch.csv]

Same problem as the C++ benchmark: bf16 X[rows, 7168] x W_g[7168, 2048] per group, bf16 out,
random inputs, median of --reps CUDA-event-timed runs after 3 warm-ups. torch.mm of the same FLOPs
is timed too, back to back and alternating with torch._grouped_mm (256 MiB overwritten before every
run). The merged table gives MoonEP's GEMM (the strategy kAuto picks) against torch._grouped_mm and
against the dense cuBLAS GEMM of the same FLOPs from the C++ run, and checks the issue's targets,
each on ratios taken at the same clocks (the H200 runs these loops at its power cap, so two
processes see different clocks).
"""
import argparse
import csv
import statistics
import sys

import torch

H, I = 7168, 2048


def time_ms(fn, reps):
    """Median ms of fn, run back to back after 3 warm-ups."""
    return time_alternating_ms([fn], reps)[0]


def time_alternating_ms(fns, reps, flush=None):
    """Median ms of each fn after 3 warm-ups, run alternately; with `flush`, that buffer is
    overwritten before every run (as the C++ benchmark's alternating timing: the same clocks for
    all, nothing left in the L2)."""
    for _ in range(3):
        for fn in fns:
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            if flush is not None:
                flush.fill_(i + 1)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times[i].append(a.elapsed_time(b))
    return [statistics.median(t) for t in times]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", required=True)
    p.add_argument("--ours", required=True)
    p.add_argument("--out", default="")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if args.reps < 1:
        p.error(f"--reps {args.reps}: must be >= 1")
    dev = torch.device("cuda")
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    shapes = []
    with open(args.shapes) as f:
        for line in f:
            parts = line.split()
            if parts:
                sizes = [int(v) for v in parts[1:]]
                if not sizes or min(sizes) < 0 or sum(sizes) == 0:
                    p.error(f"{args.shapes}: shape '{parts[0]}' has no group sizes (or no rows)")
                shapes.append((parts[0], sizes))
    if not shapes:
        p.error(f"{args.shapes}: no shapes")
    ours = {}
    with open(args.ours) as f:
        for r in csv.DictReader(f):
            ours[r["shape"]] = r
    max_total = max(sum(s) for _, s in shapes)
    max_groups = max(len(s) for _, s in shapes)
    gen = torch.Generator(device=dev).manual_seed(0)
    a_all = torch.randn(max_total, H, device=dev, dtype=torch.bfloat16, generator=gen)
    # torch._grouped_mm wants the second operand K-major ("column-major"): [G, N, K] transposed.
    b_all = (torch.randn(max_groups, I, H, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02).transpose(-2, -1)
    flush = torch.empty(256 << 20, device=dev, dtype=torch.uint8)  # > the L2 (50-60 MiB on Hopper)
    results = []
    for name, sizes in shapes:
        total, groups = sum(sizes), len(sizes)
        a = a_all[:total]
        b = b_all[:groups]
        offs = torch.tensor(sizes, device=dev, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        flops = 2.0 * total * H * I
        try:
            ms = time_ms(lambda: torch._grouped_mm(a, b, offs=offs), args.reps)
            torch_tf = flops / (ms * 1e9)
        except Exception as e:  # noqa: BLE001 - report and carry on with the other shapes
            print(f"# {name}: torch._grouped_mm failed: {e}", file=sys.stderr)
            torch_tf = float("nan")
        b0 = b_all[0].contiguous()
        dense_ms = time_ms(lambda: torch.mm(a, b0), args.reps)
        # torch._grouped_mm against torch.mm of the same FLOPs, alternating and L2-flushed.
        try:
            gm_il, mm_il = time_alternating_ms(
                [lambda: torch._grouped_mm(a, b, offs=offs), lambda: torch.mm(a, b0)], args.reps, flush)
            torch_x_il = mm_il / gm_il
        except Exception:  # noqa: BLE001 - reported above
            torch_x_il = float("nan")
        results.append((name, groups, total, torch_tf, flops / (dense_ms * 1e9), torch_x_il))

    if args.out:
        with open(args.out, "w") as f:
            f.write("shape,groups,rows,torch_grouped_mm_tflops,torch_mm_tflops,torch_grouped_mm_over_mm_il\n")
            for r in results:
                f.write("%s,%d,%d,%.2f,%.2f,%.3f\n" % r)

    # x_dense: MoonEP over the dense GEMM, both timed back to back (block) in the C++ run;
    # x_dense_il: the same pair timed alternately with the L2 overwritten before every run (the
    # headline: same clocks for both, no operand left in the L2 by a kernel's previous run).
    # x_torch: MoonEP over torch._grouped_mm, back to back, from two processes (so from whatever
    # clock state the power cap left each in: on the H200 the same dense GEMM ran 10 % apart);
    # x_torch_il: x_dense_il over torch's own alternating, L2-flushed grouped_mm / mm ratio, each
    # measured against the dense GEMM at its own clocks (the target check uses it).
    print("# %-18s %6s %7s | %7s %7s %7s %7s | %7s %8s %10s %8s %10s | %s" % (
        "shape", "groups", "rows", "dense", "t.mm", "torchGM", "MoonEP", "pick", "x_dense", "x_dense_il",
        "x_torch", "x_torch_il", "targets"))
    misses = 0
    for name, groups, total, torch_tf, tmm, torch_x_il in results:
        o = ours.get(name)
        if o is None:  # a shape without MoonEP's figure cannot meet its targets
            print(f"  {name:<18s} no row in {args.ours}: MISS (not measured)")
            misses += 1
            continue
        dense = float(o["dense_tflops"])
        pick = o["auto"]
        moon = float(o[pick + "_tflops"])
        best = max(float(o.get(k + "_tflops", 0) or 0) for k in ("streams", "grouped", "chunked", "persistent"))
        x_dense, x_torch = moon / dense, moon / torch_tf
        x_il = float(o["auto_il_tflops"]) / float(o["dense_il_tflops"]) if "auto_il_tflops" in o else x_dense
        x_torch_il = x_il / torch_x_il
        notes = []
        if total / groups >= 512 and x_il < 0.9:
            notes.append("MISS >=0.9x dense")
        if not x_torch_il >= 0.95:  # (a NaN, torch failing, counts as a miss)
            notes.append("MISS >=0.95x torch")
        if best > moon * 1.02:
            notes.append("other strategy %.0f" % best)
        misses += any(n.startswith("MISS") for n in notes)
        print("  %-18s %6d %7d | %7.1f %7.1f %7.1f %7.1f | %7s %8.2f %10.2f %8.2f %10.2f | %s" % (
            name, groups, total, dense, tmm, torch_tf, moon, pick, x_dense, x_il, x_torch, x_torch_il,
            ", ".join(notes) or "ok"))
    print(f"# shapes missing a target: {misses}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
