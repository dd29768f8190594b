"""The EP buffer from Python (examples/python/moonep.py, EpBuffer) against a float64 numpy
reference, the caller computing the experts between dispatch and combine:

    MOONEP_LIBRARY=build/lib/libmoonep.so mpirun -np 3 python3 tests/runtime/python_ep_buffer.py

Every rank draws the same global problem (Zipf-skewed top-k routing, so MoonEP replicates hot
experts; a few -1 ids), keeps its tokens and its E/R home experts, and runs one step: dispatch,
prefetch of the replicated experts' weights into its replica slots, the experts on the layout
(out = (rows @ gate) @ down, linear so that the reference is short), combine, combine backward,
the top-k weight gradient, dispatch backward and the reduce of the replica slots' weight
gradients into their home experts. y, dx, d topk_weights and the home experts' gate and down
gradients must match the reference (rel. error < 1e-5), the prefetched slots must hold their
experts' weights exactly (at least one expert must be replicated somewhere), the layouts of all
ranks must hold as many rows as there are routed (token, k), and a handle's layout must stay as
it was after release and another dispatch. Then a dispatch with a wrong x on one rank: a
ValueError there, the peers' error giving its reason, and the buffer still usable; and each later
call (combine,
combine backward, top-k weight gradient, dispatch backward, prefetch, reduce, and a handle that is
not an EpHandle) with a wrong argument on one rank: every rank's call fails at once and the buffer
is unusable. Exit code 0 on success.
"""
import os
import sys

import numpy as np

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "examples", "python"))
import moonep  # noqa: E402

failures = []


def rel(a, b):
    den = np.max(np.abs(b))
    return float(np.max(np.abs(a - b)) / den) if den > 0 else float(np.max(np.abs(a - b)))


def check(name, got, want, tol=1e-5):
    e = rel(got, want)
    if not e < tol:
        failures.append(f"{name}: rel. error {e:.2e}")
    return e


def main():
    comm = moonep.Comm.from_env()
    R, rank = comm.size, comm.rank
    epn, K, H, I = 2, 2, 12, 10
    E = epn * R
    tokens = [20 + 7 * r for r in range(R)]
    T, lo = max(tokens), sum(tokens[:rank])
    mine_t = slice(lo, lo + tokens[rank])
    rng = np.random.default_rng(5)
    wg = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(np.float32)
    wu = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(np.float32)
    wd = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(np.float32)
    n = sum(tokens)
    x = rng.standard_normal((n, H)).astype(np.float32)
    dy = rng.standard_normal((n, H)).astype(np.float32)
    popularity = 1.0 / np.arange(1, E + 1) ** 1.3
    popularity /= popularity.sum()
    ids = np.stack([rng.choice(E, size=K, replace=False, p=popularity)
                    for _ in range(n)]).astype(np.int32)
    ids[rng.random((n, K)) < 0.1] = -1
    w = rng.random((n, K)).astype(np.float32)

    # The float64 reference of y[t] = sum_k w[t,k] x[t] G_e D_e (e = ids[t,k] >= 0), backward too.
    x64, dy64, w64 = x.astype(np.float64), dy.astype(np.float64), w.astype(np.float64)
    g64, d64 = wg.astype(np.float64), wd.astype(np.float64)
    ry, rdx, rdw = np.zeros_like(x64), np.zeros_like(x64), np.zeros_like(w64)
    rgg, rgd = np.zeros_like(g64), np.zeros_like(d64)
    for e in range(E):
        t_idx, k_idx = np.nonzero(ids == e)
        if len(t_idx) == 0:
            continue
        a = x64[t_idx] @ g64[e]
        out = a @ d64[e]
        we = w64[t_idx, k_idx][:, None]
        np.add.at(ry, t_idx, we * out)
        rdw[t_idx, k_idx] = np.sum(dy64[t_idx] * out, axis=1)
        dout = we * dy64[t_idx]
        np.add.at(rdx, t_idx, dout @ d64[e].T @ g64[e].T)
        rgd[e] += a.T @ dout
        rgg[e] += x64[t_idx].T @ (dout @ d64[e].T)

    buf = moonep.EpBuffer(comm, num_experts=E, top_k=K, hidden=H, intermediate=I, max_tokens=T)
    S = epn  # slots = -1: E/R replica slots (MoonEP's default), not taken from the binding
    if buf.slots != S:
        failures.append(f"the binding counts {buf.slots} replica slots; MoonEP makes {S}")
    home = [np.ascontiguousarray(a[rank * epn:(rank + 1) * epn]) for a in (wg, wu, wd)]
    replica = [np.zeros((S, H, I), np.float32), np.zeros((S, H, I), np.float32),
               np.zeros((S, I, H), np.float32)]
    home_g = [np.zeros_like(a) for a in home]
    replica_g = [np.zeros_like(a) for a in replica]

    h = buf.dispatch(x[mine_t], ids[mine_t], w[mine_t])
    if h.num_groups != epn + S:
        failures.append(f"{h.num_groups} groups in the layout; expected E/R + slots = {epn + S}")
    home[0].flags.writeable = False  # prefetch only reads the home weights
    buf.prefetch(h, home, replica)
    # Each group's weights: a home expert's own, or the replica slot's prefetched copy.
    replicas = 0
    routed = sum(int(np.sum(ids == e)) for e in range(E))
    rows_here = 0
    for g in range(h.num_groups):
        e = int(h.group_expert[g])
        if g >= epn and e >= 0:
            replicas += 1
            s = g - epn
            for name, got, want in (("gate", replica[0][s], wg[e]), ("up", replica[1][s], wu[e]),
                                    ("down", replica[2][s], wd[e])):
                if not np.array_equal(got, want):
                    failures.append(f"replica slot {s} ({name}) does not hold expert {e}")
        if e < 0 and h.group_count[g] != 0:
            failures.append(f"group {g} holds {h.group_count[g]} rows but no expert")
        rows_here += int(h.group_count[g])

    def weights(g):
        return (home[0][g], home[2][g]) if g < epn else (replica[0][g - epn], replica[2][g - epn])

    out_rows = np.zeros((h.num_rows, H), np.float32)
    for g in range(h.num_groups):
        if h.group_expert[g] < 0 or h.group_count[g] == 0:
            continue
        r = slice(h.group_offset[g], h.group_offset[g] + h.group_count[g])
        G, D = weights(g)
        out_rows[r] = (h.rows[r] @ G) @ D
    y = buf.combine(h, out_rows)
    check("y", y, ry[mine_t])
    dy_rows = buf.combine_backward(h, dy[mine_t])
    check("d topk_weights", buf.topk_weight_grad(h, dy_rows, out_rows), rdw[mine_t])
    dx_rows = np.zeros_like(dy_rows)
    for g in range(h.num_groups):
        if h.group_expert[g] < 0 or h.group_count[g] == 0:
            continue
        r = slice(h.group_offset[g], h.group_offset[g] + h.group_count[g])
        G, D = weights(g)
        dout = h.row_weights[r][:, None] * dy_rows[r]
        dx_rows[r] = dout @ D.T @ G.T
        gg, gd = (home_g[0][g], home_g[2][g]) if g < epn else \
            (replica_g[0][g - epn], replica_g[2][g - epn])
        gg += h.rows[r].T @ (dout @ D.T)  # views: in place into the arrays MoonEP reduces
        gd += (h.rows[r] @ G).T @ dout
        # "up" is not used by these linear experts: its gradient is the gate's, so that the
        # reduce of all three tensors is checked.
        (home_g[1][g] if g < epn else replica_g[1][g - epn])[...] += h.rows[r].T @ (dout @ D.T)
    check("dx", buf.dispatch_backward(h, dx_rows), rdx[mine_t])
    buf.reduce(h, home_g, replica_g)
    mine_e = slice(rank * epn, (rank + 1) * epn)
    check("d gate (home experts, replicas' gradients reduced in)", home_g[0], rgg[mine_e])
    check("d down (home experts, replicas' gradients reduced in)", home_g[2], rgd[mine_e])
    check("d up (= d gate here; home experts, replicas' reduced in)", home_g[1], rgg[mine_e])
    # The handle's layout is a copy: it stays as it was after release and another dispatch.
    rows_before = h.rows.copy()
    buf.release(h)
    other = buf.dispatch(x[mine_t] + 1.0, ids[mine_t], w[mine_t])
    if not np.array_equal(h.rows, rows_before):
        failures.append("the handle's rows changed after release and another dispatch")
    buf.release(other)
    if comm_allreduce_sum(np.array([replicas], np.int64)) == 0 and R > 1:
        failures.append("no expert was replicated: prefetch and reduce were not exercised")
    # Every (token, k) routed somewhere is a row on some rank exactly once.
    counts = comm_allreduce_sum(np.array([rows_here], np.int64))
    if counts != routed:
        failures.append(f"the layouts hold {counts} rows over all ranks; {routed} (t, k) are "
                        "routed")

    # A handle that is not an EpHandle: a TypeError there, the peers' call fails at once.
    for refused in ("handle", "combine_backward", "topk_weight_grad", "dispatch_backward",
                    "prefetch", "reduce"):
        refuse_later_call(comm, refused, E, K, H, I, T, x[mine_t], ids[mine_t], w[mine_t], home)
    # A wrong x on the last rank only: a ValueError there, the peers' dispatch fails with its
    # reason, and the buffer stays usable.
    wrong = f"x has shape {(tokens[R - 1], H + 1)}"
    try:
        if rank == R - 1:
            buf.dispatch(np.zeros((tokens[R - 1], H + 1), np.float32), ids[mine_t], w[mine_t])
        else:
            buf.dispatch(x[mine_t], ids[mine_t], w[mine_t])
        failures.append("a dispatch with a wrong x on one rank succeeded")
    except ValueError as e:
        if rank != R - 1 or wrong not in str(e):
            failures.append(f"rank {rank}: unexpected ValueError: {e}")
    except moonep.MoonEPError as e:
        if rank == R - 1 or f"rank {R - 1}: refused by the caller: {wrong}" not in str(e):
            failures.append(f"rank {rank}: the peers' error lacks the reason: {e}")
    h = buf.dispatch(x[mine_t], ids[mine_t], w[mine_t])
    # A wrong array in a later collective call on the last rank: a ValueError there, the peers'
    # call fails at once (MoonEP is passed NULL), and the buffer is unusable on every rank. (The
    # barrier first: a peer still finishing the dispatch would fail there instead, which MoonEP
    # documents: the same call, or the one still in flight where the peer is behind.)
    comm_allreduce_sum(np.zeros(1, np.int64))
    try:
        rows = np.zeros((h.num_rows + (1 if rank == R - 1 else 0), H), np.float32)
        buf.combine(h, rows)
        failures.append("a combine with a wrong out_rows on one rank succeeded")
    except ValueError as e:
        if rank != R - 1 or "the combine failed on every rank" not in str(e):
            failures.append(f"rank {rank}: unexpected ValueError: {e}")
    except moonep.MoonEPError as e:
        if rank == R - 1 or f"rank {R - 1}" not in str(e):
            failures.append(f"rank {rank}: the peers' error does not name rank {R - 1}: {e}")
    try:
        buf.dispatch(x[mine_t], ids[mine_t], w[mine_t])
        failures.append("a dispatch on the failed buffer succeeded")
    except moonep.MoonEPError as e:
        if "unusable" not in str(e):
            failures.append(f"rank {rank}: the failed buffer's error does not say so: {e}")
    buf.destroy()
    comm.destroy()
    for f in failures:
        print(f"[rank {rank}] FAIL: {f}", flush=True)
    print(f"[rank {rank}] python EP buffer: {replicas} replica slots used, "
          f"{'PASS' if not failures else 'FAIL'}", flush=True)
    return 1 if failures else 0


def refuse_later_call(comm, which, E, K, H, I, T, x, ids, w, home):
    """On a new buffer: a dispatch, then the last rank passes a wrong argument to `which` (a
    handle that is not an EpHandle for "handle") while its peers pass good ones: an exception
    there, a MoonEPError naming it on the peers, at once."""
    R, rank = comm.size, comm.rank
    buf = moonep.EpBuffer(comm, num_experts=E, top_k=K, hidden=H, intermediate=I, max_tokens=T)
    h = buf.dispatch(x, ids, w)
    comm_allreduce_sum(np.zeros(1, np.int64))  # every rank past the dispatch
    bad = rank == R - 1
    n, S = h.num_rows, buf.slots
    rows = np.zeros((n + (1 if bad and which != "handle" else 0), H), np.float32)
    slots = [np.zeros((S + (1 if bad else 0), H, I), np.float32),
             np.zeros((S, H, I), np.float32), np.zeros((S, I, H), np.float32)]
    grads = [np.zeros_like(a) for a in home]
    calls = {
        "handle": lambda: buf.combine("not a handle" if bad else h, rows),
        "combine_backward":
            lambda: buf.combine_backward(h, np.zeros((len(x) + bad, H), np.float32)),
        "topk_weight_grad": lambda: buf.topk_weight_grad(h, rows, rows),
        "dispatch_backward": lambda: buf.dispatch_backward(h, rows),
        "prefetch": lambda: buf.prefetch(h, home, slots),
        "reduce": lambda: buf.reduce(h, grads, slots),
    }
    try:
        calls[which]()
        if bad:
            failures.append(f"{which}: a wrong argument on rank {R - 1} did not fail the call")
        else:  # this rank's part needed nothing from rank R - 1: its next call fails instead
            buf.combine(h, np.zeros((n, H), np.float32))
            failures.append(f"{which}: rank {rank}: neither the call nor the next failed")
    except (ValueError, TypeError) as e:
        if not bad or "failed on every rank" not in str(e):
            failures.append(f"{which}: rank {rank}: unexpected {type(e).__name__}: {e}")
    except moonep.MoonEPError as e:
        if bad or f"rank {R - 1}" not in str(e):
            failures.append(f"{which}: rank {rank}: the peers' error does not name rank {R - 1}: "
                            f"{e}")
    buf.destroy()


def comm_allreduce_sum(mine):
    """The sum of `mine` over MPI_COMM_WORLD through Open MPI's library (the binding loaded it)."""
    import ctypes
    mpi = ctypes.CDLL("libmpi.so.40")
    world = ctypes.addressof(ctypes.c_char.in_dll(mpi, "ompi_mpi_comm_world"))
    int64 = ctypes.addressof(ctypes.c_char.in_dll(mpi, "ompi_mpi_int64_t"))
    op_sum = ctypes.addressof(ctypes.c_char.in_dll(mpi, "ompi_mpi_op_sum"))
    out = np.zeros_like(mine)
    mpi.MPI_Allreduce.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 3
    mpi.MPI_Allreduce(mine.ctypes.data, out.ctypes.data, 1, int64, op_sum, world)
    return int(out[0])


if __name__ == "__main__":
    sys.exit(main())
