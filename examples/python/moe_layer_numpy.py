"""A MoonEP MoE layer from Python (ctypes + numpy), checked against a numpy reference:

    mpirun -np 4 python3 examples/python/moe_layer_numpy.py

Every rank draws the same global problem from a seed (expert weights, every rank's tokens, a
skewed top-k router), keeps its tokens and its E/R home experts, runs forward and backward through
MoonEP, and compares y, dx, d topk_weights and its experts' weight gradients with the float64
numpy reference of the whole problem. Exit code 0 when every rank matches (rel. error < 1e-5).
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moonep  # noqa: E402


def silu(a):
    return a / (1.0 + np.exp(-a))


def reference(x, ids, w, dy, wg, wu, wd):
    """float64 forward and backward of y = sum_k w[t,k] FFN_{ids[t,k]}(x[t])."""
    T, K = ids.shape
    y = np.zeros_like(x)
    dx = np.zeros_like(x)
    dw = np.zeros_like(w)
    gg, gu, gd = np.zeros_like(wg), np.zeros_like(wu), np.zeros_like(wd)
    for e in range(wg.shape[0]):
        t_idx, k_idx = np.nonzero(ids == e)
        if len(t_idx) == 0:
            continue
        xe = x[t_idx]
        a, b = xe @ wg[e], xe @ wu[e]
        s = silu(a)
        h = s * b
        out = h @ wd[e]
        we = w[t_idx, k_idx][:, None]
        np.add.at(y, t_idx, we * out)
        dw[t_idx, k_idx] = np.sum(dy[t_idx] * out, axis=1)
        dout = we * dy[t_idx]
        dh = dout @ wd[e].T
        sig = 1.0 / (1.0 + np.exp(-a))
        da = dh * b * (sig * (1.0 + a * (1.0 - sig)))
        db = dh * s
        np.add.at(dx, t_idx, da @ wg[e].T + db @ wu[e].T)
        gd[e] += h.T @ dout
        gg[e] += xe.T @ da
        gu[e] += xe.T @ db
    return y, dx, dw, gg, gu, gd


def rel(a, b):
    den = np.max(np.abs(b))
    return float(np.max(np.abs(a - b)) / den) if den > 0 else float(np.max(np.abs(a - b)))


def main():
    comm = moonep.Comm.from_env()
    R, rank = comm.size, comm.rank
    epn, K, H, I = 4, 2, 32, 64
    E = epn * R
    tokens = [40 + 3 * r for r in range(R)]  # ragged
    rng = np.random.default_rng(7)
    wg = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(np.float32)
    wu = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(np.float32)
    wd = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(np.float32)
    T = sum(tokens)
    x = rng.standard_normal((T, H)).astype(np.float32)
    dy = rng.standard_normal((T, H)).astype(np.float32)
    popularity = 1.0 / np.arange(1, E + 1) ** 1.5  # Zipf: a few hot experts
    ids = np.stack([rng.choice(E, size=K, replace=False, p=popularity / popularity.sum())
                    for _ in range(T)]).astype(np.int32)
    ids[rng.random((T, K)) < 0.1] = -1  # dropped entries
    w = np.where(ids >= 0, rng.random((T, K)), 0.0).astype(np.float32)

    lo = sum(tokens[:rank])
    hi = lo + tokens[rank]
    mine = slice(rank * epn, (rank + 1) * epn)
    my_wg, my_wu, my_wd = (np.ascontiguousarray(a[mine]) for a in (wg, wu, wd))

    f64 = [a.astype(np.float64) for a in (x, ids, w, dy, wg, wu, wd)]
    f64[1] = ids
    ry, rdx, rdw, rgg, rgu, rgd = reference(*f64)
    ok = True
    # Perfect balance, then moonep weighing replicas at 30 tokens a transfer (fewer replicas, the
    # same results), then also the rows a plan moves at 1/4 token a row (libmoonep 0.3.0), then
    # the costs the cost probe measured on these ranks (libmoonep 0.4.0).
    measured = moonep.measure_costs(comm, num_experts=E, top_k=K, hidden=H, intermediate=I,
                                    max_tokens=max(tokens), num_threads=1, compute_rows=64,
                                    link_rows=64, repetitions=3)
    if rank == 0:
        print(f"cost probe ({measured['ranks']} ranks): a token {measured['token_seconds'] * 1e6:.3g}"
              f" us, a row {measured['row_seconds_inter'] * 1e6:.3g} us -> "
              + ", ".join(f"{k} {measured[k]}" for k in moonep.COST_FIELDS), flush=True)
    runs = (("perfect balance", {}),
            ("weighing replicas at 30 tokens", dict(replica_cost_intra=30, replica_cost_inter=30)),
            ("weighing replicas at 30 tokens and rows at 256/1024",
             dict(replica_cost_intra=30, replica_cost_inter=30, row_cost_intra=256,
                  row_cost_inter=256)),
            ("measured costs", dict(costs=measured)))
    for what, costs in runs:
        g_gate, g_up, g_down = (np.zeros_like(a) for a in (my_wg, my_wu, my_wd))
        layer = moonep.Layer(comm, num_experts=E, top_k=K, hidden=H, intermediate=I,
                             max_tokens=max(tokens), num_threads=1, **costs)
        layer.bind(my_wg, my_wu, my_wd, g_gate, g_up, g_down)
        y = layer.forward(x[lo:hi], ids[lo:hi], w[lo:hi])
        dx, dtopk = layer.backward(dy[lo:hi])
        stats = layer.stats()
        errors = {"y": rel(y, ry[lo:hi]), "dx": rel(dx, rdx[lo:hi]), "dtopk": rel(dtopk, rdw[lo:hi]),
                  "dWg": rel(g_gate, rgg[mine]), "dWu": rel(g_up, rgu[mine]),
                  "dWd": rel(g_down, rgd[mine])}
        ok = ok and all(v < 1e-5 for v in errors.values())
        line = " ".join(f"{k} {v:.1e}" for k, v in errors.items())
        print(f"[rank {rank}] numpy MoE layer via MoonEP ({what}): {line} -> "
              f"{'PASS' if all(v < 1e-5 for v in errors.values()) else 'FAIL'}", flush=True)
        if rank == 0:
            print(f"load max/mean {stats['max_load_before'] / stats['mean_load']:.2f} without "
                  f"MoonEP, {stats['max_load_after'] / stats['mean_load']:.2f} with it "
                  f"({stats['replicas']} replicas, {what})", flush=True)
        layer.destroy()
    comm.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
