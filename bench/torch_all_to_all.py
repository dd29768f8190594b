"""torch.distributed.all_to_all_single of the bytes a MoE dispatch moves, as a baseline for
moonep-bench-dispatch --backend=nccl (issue #12). One process per GPU, launched by mpirun:

    mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29511 python3 bench/torch_all_to_all.py \
        --tokens 4096 --hidden 7168 --top-k 8 --experts 256 --zipf 0,0.6,1.2

Per rank, tokens * top_k rows of `hidden` bf16 values are sent; row r goes to the rank that holds
its expert (experts e*R/E .. contiguous per rank, as MoonEP's default home placement), experts drawn
with Zipf(s) popularity over a fixed random permutation (s = 0: uniform). No dedup and no planning:
what a plain all-to-all dispatch costs. Prints one row per skew: the slowest rank's median time over
the iterations, bytes sent per rank, algbw (bytes / time) and the hottest rank's received bytes /
mean (what the busiest receiver waits for). Rank r uses GPU r % device_count.
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--zipf", default="0,0.6,1.2")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK", "0")))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", rank=rank, world_size=world)
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    E, R, K, T, H = args.experts, world, args.top_k, args.tokens, args.hidden
    if E % R:
        sys.exit(f"experts ({E}) must be a multiple of the ranks ({R})")
    if rank == 0:
        print(f"# torch {torch.__version__} all_to_all_single, {R} ranks, T={T} K={K} H={H} bf16, "
              f"E={E}; {torch.cuda.get_device_name(dev)}")
        print(f"# {'zipf':>6} {'bytes/rank':>12} {'time(us)':>10} {'p99(us)':>10} {'algbw(GB/s)':>12} "
              f"{'hot recv/mean':>14}")
    g = torch.Generator().manual_seed(1234)
    perm = torch.randperm(E, generator=g)
    send = torch.empty(T * K, H, dtype=torch.bfloat16, device=dev).normal_()
    for s in [float(x) for x in args.zipf.split(",")]:
        pop = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** s
        pop = pop[perm.argsort()]  # expert e's popularity
        gen = torch.Generator().manual_seed(99 + rank)
        ids = torch.multinomial(pop, T * K, replacement=True, generator=gen)
        dest = ids // (E // R)
        send_counts = torch.bincount(dest, minlength=R)
        order = dest.argsort(stable=True)
        data = send[order.to(dev)]
        rc = torch.empty(R, dtype=torch.int64, device=dev)
        dist.all_to_all_single(rc, send_counts.to(dev))
        recv_counts = rc.cpu()
        recv = torch.empty(int(recv_counts.sum()), H, dtype=torch.bfloat16, device=dev)
        times = []
        for it in range(args.warmup + args.iters):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, data, recv_counts.tolist(), send_counts.tolist())
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            slowest = torch.tensor([dt], device=dev)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if it >= args.warmup:
                times.append(float(slowest) * 1e6)
        got = torch.tensor([float(recv_counts.sum())], device=dev)
        allgot = [torch.zeros_like(got) for _ in range(R)]
        dist.all_gather(allgot, got)
        hot = max(float(x) for x in allgot) / (sum(float(x) for x in allgot) / R)
        if rank == 0:
            med = statistics.median(times)
            p99 = sorted(times)[min(len(times) - 1, int(0.99 * len(times)))]
            nbytes = T * K * H * 2
            print(f"  {s:6.2f} {nbytes:12d} {med:10.1f} {p99:10.1f} {nbytes / med / 1e3:12.2f} "
                  f"{hot:14.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
