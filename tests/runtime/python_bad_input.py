"""Bad input to the Python binding (examples/python/moonep.py) gets a clear exception and nothing
else: no out-of-bounds read or write through ctypes, no lost forward state, no silent fallback.

    MOONEP_LIBRARY=build/lib/libmoonep.so mpirun -np 2 python3 tests/runtime/python_bad_input.py

Every rank passes the same bad input (the binding's checks run before any collective call), then
one rank alone, whose peers must fail that forward with its reason. After
the refused calls, a forward and backward on good input must still match the float64 numpy
reference, so the refusals left the layer and its bound weights intact. Exit code 0 on success.
"""
import os
import sys

import numpy as np

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "examples", "python"))
import moonep  # noqa: E402
from moe_layer_numpy import reference, rel  # noqa: E402

failures = []


def expect(exc_type, fragment, call):
    """call() must raise exc_type with fragment in its message."""
    try:
        call()
    except exc_type as e:
        if fragment not in str(e):
            failures.append(f"{fragment!r} not in {type(e).__name__}: {e}")
        return
    except Exception as e:  # noqa: BLE001 - any other exception is a failure
        failures.append(f"expected {exc_type.__name__} ({fragment!r}), got "
                        f"{type(e).__name__}: {e}")
        return
    failures.append(f"expected {exc_type.__name__} ({fragment!r}); the call succeeded")


def barrier():
    """MPI_Barrier on MPI_COMM_WORLD through Open MPI's library (the binding loaded it): the test
    separates a refused collective call from the one before it, which a fast rank's abort notice
    would otherwise fail on a slower peer still inside it."""
    import ctypes
    try:
        mpi = ctypes.CDLL("libmpi.so.40")
        world = ctypes.addressof(ctypes.c_char.in_dll(mpi, "ompi_mpi_comm_world"))
    except (OSError, ValueError):
        import time
        time.sleep(1.0)  # not Open MPI: give the peers time instead
        return
    mpi.MPI_Barrier.argtypes = [ctypes.c_void_p]
    mpi.MPI_Barrier(world)


def comm_allgather_floats(values):
    """Every rank's list of floats (the same length on every rank), through Open MPI's library
    as barrier() does; without it, this rank's list alone."""
    import ctypes
    try:
        mpi = ctypes.CDLL("libmpi.so.40")
        world = ctypes.addressof(ctypes.c_char.in_dll(mpi, "ompi_mpi_comm_world"))
        double = ctypes.addressof(ctypes.c_char.in_dll(mpi, "ompi_mpi_double"))
    except (OSError, ValueError):
        return [list(values)]
    n = len(values)
    size = ctypes.c_int()
    mpi.MPI_Comm_size.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    mpi.MPI_Comm_size(world, ctypes.byref(size))
    mine = (ctypes.c_double * n)(*values)
    out = (ctypes.c_double * (n * size.value))()
    mpi.MPI_Allgather.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    mpi.MPI_Allgather(mine, n, double, out, n, double, world)
    return [list(out[r * n:(r + 1) * n]) for r in range(size.value)]


def library_check():
    """A named library that cannot be loaded is an error, not a fallback to another one."""
    good = os.environ.get("MOONEP_LIBRARY")
    os.environ["MOONEP_LIBRARY"] = "/nonexistent/libmoonep.so"
    expect(OSError, "MOONEP_LIBRARY=/nonexistent/libmoonep.so cannot be loaded", moonep.version)
    if good is None:
        del os.environ["MOONEP_LIBRARY"]
    else:
        os.environ["MOONEP_LIBRARY"] = good


def main():
    library_check()
    comm = moonep.Comm.from_env()
    R, rank = comm.size, comm.rank
    epn, K, H, I, T = 2, 2, 16, 24, 12
    E = epn * R
    rng = np.random.default_rng(11)
    wg = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(np.float32)
    wu = (rng.standard_normal((E, H, I)) / np.sqrt(H)).astype(np.float32)
    wd = (rng.standard_normal((E, I, H)) / np.sqrt(I)).astype(np.float32)
    x = rng.standard_normal((R * T, H)).astype(np.float32)
    dy = rng.standard_normal((R * T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, size=K, replace=False) for _ in range(R * T)]).astype(np.int32)
    w = rng.random((R * T, K)).astype(np.float32)
    lo, hi = rank * T, (rank + 1) * T
    mine = slice(rank * epn, (rank + 1) * epn)
    my = [np.ascontiguousarray(a[mine]) for a in (wg, wu, wd)]
    grads = [np.zeros_like(a) for a in my]

    expect(ValueError, "policy 'balanced' is not one of",
           lambda: moonep.Layer(comm, E, K, H, I, T, policy="balanced"))
    # The same on one rank alone: it still joins the creation, so its peers fail at once, naming it.
    if rank == R - 1:
        expect(ValueError, "policy 'balanced' is not one of",
               lambda: moonep.Layer(comm, E, K, H, I, T, policy="balanced"))
    elif R > 1:
        expect(moonep.MoonEPError, f"rank {R - 1}", lambda: moonep.Layer(comm, E, K, H, I, T))
    if rank == R - 1:
        expect(ValueError, "Layer:", lambda: moonep.Layer(comm, E, K, H, I, T, slots=1.5))
    elif R > 1:
        expect(moonep.MoonEPError, f"rank {R - 1}", lambda: moonep.Layer(comm, E, K, H, I, T))
    # The cost probe: a bad argument on one rank fails every rank at once (the peers' MoonEPError
    # names the rank), then a good probe runs; costs and cost arguments together are refused.
    probe = dict(num_experts=E, top_k=K, hidden=H, intermediate=I, max_tokens=T, num_threads=1,
                 compute_rows=8, link_rows=8, repetitions=1)
    if rank == R - 1:
        expect(ValueError, "policy 'balanced' is not one of",
               lambda: moonep.measure_costs(comm, **dict(probe, policy="balanced")))
    elif R > 1:
        expect(moonep.MoonEPError, f"rank {R - 1}", lambda: moonep.measure_costs(comm, **probe))
    costs = moonep.measure_costs(comm, **probe)
    if sorted(k for k in costs if k in moonep.COST_FIELDS) != sorted(moonep.COST_FIELDS):
        failures.append(f"measure_costs returned {sorted(costs)}")
    expect(ValueError, "pass either costs",
           lambda: moonep.Layer(comm, E, K, H, I, T, costs=costs, replica_cost_inter=5))
    expect(ValueError, "costs lacks ['row_cost_inter']",
           lambda: moonep.Layer(comm, E, K, H, I, T,
                                costs={k: 1 for k in moonep.COST_FIELDS[:3]}))
    # Speeds (libmoonep 0.5.0): measure_costs gives one per rank, the same on every rank; a wrong
    # count or value is a ValueError on every rank that passes it (on one rank alone its peers
    # fail naming it), speeds that differ between ranks fail every rank, good ones make a layer.
    speeds = costs.get("speeds")
    if speeds is None or len(speeds) != R or not all(v > 0 for v in speeds):
        failures.append(f"measure_costs speeds: {speeds}")
    all_speeds = comm_allgather_floats(speeds or [0.0] * R)
    if any(row != all_speeds[0] for row in all_speeds):
        failures.append(f"measure_costs speeds differ between ranks: {all_speeds}")
    expect(ValueError, f"speeds has {R + 1} values; the communicator has {R} ranks",
           lambda: moonep.Layer(comm, E, K, H, I, T, speeds=[1.0] * (R + 1)))
    expect(ValueError, f"speeds has {R + 1} values",
           lambda: moonep.EpBuffer(comm, E, K, H, T, speeds=[1.0] * (R + 1)))
    expect(ValueError, "speeds[0] is 0.0; must be finite and positive",
           lambda: moonep.Layer(comm, E, K, H, I, T, speeds=[0.0] + [1.0] * (R - 1)))
    expect(ValueError, "speeds must be a sequence of numbers",
           lambda: moonep.Layer(comm, E, K, H, I, T, speeds=["fast"] * R))
    if rank == R - 1:
        expect(ValueError, "speeds[0] is nan",
               lambda: moonep.Layer(comm, E, K, H, I, T, speeds=[float("nan")] * R))
    elif R > 1:
        expect(moonep.MoonEPError, f"rank {R - 1}",
               lambda: moonep.Layer(comm, E, K, H, I, T, speeds=[1.0] * R))
    if R > 1:
        expect(moonep.MoonEPError, "speeds",
               lambda: moonep.Layer(comm, E, K, H, I, T, speeds=[1.0 + rank] * R))
    expect(ValueError, "speeds must be a sequence of numbers",
           lambda: moonep.Layer(comm, E, K, H, I, T, speeds="12"))
    expect(ValueError, "speeds='measured' takes the speeds from costs",
           lambda: moonep.Layer(comm, E, K, H, I, T, speeds="measured"))
    expect(moonep.MoonEPError, "speeds are for policies moonep and moonep-greedy",
           lambda: moonep.Layer(comm, E, K, H, I, T, policy="eplb", speeds=[1.0] * R))
    moonep.Layer(comm, E, K, H, I, T, num_threads=1, speeds=[1.0] * (R - 1) + [2.0]).destroy()
    # The probe's speeds with its costs scaled to tokens of the fastest rank.
    moonep.Layer(comm, E, K, H, I, T, num_threads=1, costs=costs, speeds="measured").destroy()
    moonep.EpBuffer(comm, E, K, H, T, speeds=speeds).destroy()
    layer = moonep.Layer(comm, num_experts=E, top_k=K, hidden=H, intermediate=I, max_tokens=T,
                         num_threads=1)

    # bind: shapes, dtypes, layout, all-or-none gradients.
    wrong_count = np.zeros((epn + 1, H, I), np.float32)
    expect(ValueError, f"w_gate has shape {wrong_count.shape}; expected {(epn, H, I)}",
           lambda: layer.bind(wrong_count, my[1], my[2]))
    expect(ValueError, f"w_down has shape {(epn, H, I)}; expected {(epn, I, H)}",
           lambda: layer.bind(my[0], my[1], my[1]))
    expect(ValueError, "w_up must be a C-contiguous float32",
           lambda: layer.bind(my[0], my[1].astype(np.float64), my[2]))
    expect(ValueError, "w_gate must be a C-contiguous float32",
           lambda: layer.bind(np.asfortranarray(my[0]), my[1], my[2]))
    expect(ValueError, "pass g_gate, g_up and g_down together",
           lambda: layer.bind(my[0], my[1], my[2], grads[0], grads[1]))
    expect(ValueError, f"g_down has shape {grads[0].shape}",
           lambda: layer.bind(my[0], my[1], my[2], grads[0], grads[1], grads[0]))
    frozen = np.zeros_like(grads[1])
    frozen.flags.writeable = False
    expect(ValueError, "g_up is read-only",
           lambda: layer.bind(my[0], my[1], my[2], grads[0], frozen, grads[2]))
    layer.bind(*my, *grads)

    # backward and release with no forward awaiting them.
    expect(RuntimeError, "backward: no forward awaits it", lambda: layer.backward(dy[lo:hi]))
    expect(RuntimeError, "release: no forward awaits it", layer.release)

    # forward: every array's shape against the layer and against x.
    xs, ids_s, ws = x[lo:hi], ids[lo:hi], w[lo:hi]
    expect(ValueError, f"x has shape {(T, H + 1)}; expected {(T, H)}",
           lambda: layer.forward(np.zeros((T, H + 1), np.float32), ids_s, ws))
    expect(ValueError, "expected (tokens, hidden = 16)",
           lambda: layer.forward(xs.reshape(-1), ids_s, ws))
    expect(ValueError, f"topk_ids has shape {(T - 1, K)}; expected {(T, K)}",
           lambda: layer.forward(xs, ids_s[:-1], ws))
    expect(ValueError, f"topk_weights has shape {(T, K - 1)}; expected {(T, K)}",
           lambda: layer.forward(xs, ids_s, ws[:, :-1]))
    expect(ValueError, "topk_ids must hold integers, not float64",
           lambda: layer.forward(xs, ids_s.astype(np.float64) + 0.5, ws))
    # Checked by the library itself, on every rank alike.
    bad_ids = ids_s.copy()
    bad_ids[3, 1] = E
    expect(moonep.MoonEPError, "moonepLayerForward failed", lambda: layer.forward(xs, bad_ids, ws))
    too_many = np.zeros((T + 1, H), np.float32)
    expect(moonep.MoonEPError, "moonepLayerForward failed",
           lambda: layer.forward(too_many, np.zeros((T + 1, K), np.int32),
                                 np.zeros((T + 1, K), np.float32)))

    # Bad input on one rank only: a ValueError there, and the peers' forward fails at once with
    # that rank's reason (the binding refuses through moonepLayerRefuseForward).
    wide = f"x has shape {(T, H + 1)}; expected {(T, H)}"
    if rank == R - 1:
        expect(ValueError, wide, lambda: layer.forward(np.zeros((T, H + 1), np.float32), ids_s, ws))
    else:
        expect(moonep.MoonEPError, f"rank {R - 1}: refused by the caller: {wide}",
               lambda: layer.forward(xs, ids_s, ws))
    # Good input after all that (the refused forwards were refused on every rank at once, through
    # MoonEP, and left the layer usable): matches the float64 reference.
    expect(ValueError, "topk_ids holds values outside int32",
           lambda: layer.forward(xs, ids_s.astype(np.int64) + (1 << 32), ws))
    y = layer.forward(xs, ids_s, ws)
    dx, dtopk = layer.backward(dy[lo:hi])
    f64 = [a.astype(np.float64) for a in (x, ids, w, dy, wg, wu, wd)]
    f64[1] = ids
    ry, rdx, rdw, rgg, rgu, rgd = reference(*f64)
    errors = {"y": rel(y, ry[lo:hi]), "dx": rel(dx, rdx[lo:hi]), "dtopk": rel(dtopk, rdw[lo:hi]),
              "dWg": rel(grads[0], rgg[mine]), "dWu": rel(grads[1], rgu[mine]),
              "dWd": rel(grads[2], rgd[mine])}
    for k, v in errors.items():
        if not v < 1e-5:
            failures.append(f"{k} rel. error {v:.2e} after the refused calls")
    # A wrong dy: refused, and the backward fails on every rank (MoonEP is told, so no peer waits
    # for this one); the layer is unusable afterwards.
    layer.forward(xs, ids_s, ws)
    barrier()
    expect(ValueError, f"dy has shape {(T - 2, H)}; expected {(T, H)} (the backward failed on "
           "every rank", lambda: layer.backward(dy[lo:hi - 2]))
    expect(moonep.MoonEPError, "unusable", lambda: layer.forward(xs, ids_s, ws))
    layer.destroy()
    comm.destroy()
    for f in failures:
        print(f"[rank {rank}] FAIL: {f}", flush=True)
    print(f"[rank {rank}] python bad input: {'PASS' if not failures else 'FAIL'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
