"""ctypes binding of the MoonEP C API (moonep.h + moonep_runtime.h): communicators, the MoE
layer and the EP buffer (host memory). Arrays are numpy arrays (C-contiguous); MoonEP reads and
writes them in place, so they must stay alive while MoonEP uses them (weights and gradients: while
bound to the layer).

    import moonep
    comm = moonep.Comm.from_env()                 # under mpirun / srun
    layer = moonep.Layer(comm, num_experts=16, top_k=2, hidden=64, intermediate=128,
                         max_tokens=256)
    layer.bind(w_gate, w_up, w_down, g_gate, g_up, g_down)   # this rank's E/R experts
    y = layer.forward(x, topk_ids, topk_weights)
    dx, d_topk_weights = layer.backward(dy)       # gradients accumulate into g_*

The library is found from $MOONEP_LIBRARY, else build/lib/libmoonep.so next to this checkout,
else the system's libmoonep.so.0.
"""
import ctypes
import math
import os

import numpy as np

_FLOAT32, _BFLOAT16 = 0, 1
_CONFIG_MAGIC = 0x4D4F4F4E
_POLICIES = {"none": 0, "moonep": 1, "moonep-greedy": 2, "eplb": 3, "fastermoe-shadow": 4,
             "test-force-replicas": 5}
PHASES = ["counts", "plan", "dispatch", "compute-home", "prefetch-wait", "compute-replica",
          "combine", "bwd-dispatch", "topk-grad", "bwd-compute", "bwd-combine", "reduce"]
OPS = ["counts", "dispatch", "combine", "combine-backward", "dispatch-backward",
       "topk-weight-grad", "prefetch", "reduce"]


class MoonEPError(RuntimeError):
    def __init__(self, function, code, message):
        super().__init__(f"{function} failed: {_lib().moonepGetErrorString(code).decode()}: "
                         f"{message}")
        self.code = code


class _LayerConfig(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("num_experts", ctypes.c_int), ("top_k", ctypes.c_int),
                ("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("dtype", ctypes.c_int), ("grad_dtype", ctypes.c_int), ("slots", ctypes.c_int),
                ("pad_multiple", ctypes.c_int), ("policy", ctypes.c_int),
                ("device", ctypes.c_int), ("device_index", ctypes.c_int),
                ("max_tokens", ctypes.c_int64), ("max_recv_rows", ctypes.c_int64),
                ("max_inflight", ctypes.c_int), ("layer_id", ctypes.c_int),
                ("num_threads", ctypes.c_int), ("ranks_per_node", ctypes.c_int),
                ("eplb_period", ctypes.c_int), ("transport", ctypes.c_char_p),
                ("replica_cost_intra", ctypes.c_int64), ("replica_cost_inter", ctypes.c_int64),
                ("row_cost_intra", ctypes.c_int64), ("row_cost_inter", ctypes.c_int64),
                ("speeds", ctypes.POINTER(ctypes.c_double))]


class _CostProbeOptions(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("compute_rows", ctypes.c_int64),
                ("link_rows", ctypes.c_int64), ("repetitions", ctypes.c_int),
                ("forward_only", ctypes.c_int), ("transfer_rows", ctypes.c_int64),
                ("speeds", ctypes.POINTER(ctypes.c_double))]


class _MeasuredCosts(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("token_seconds", ctypes.c_double),
                ("row_seconds_intra", ctypes.c_double), ("row_seconds_inter", ctypes.c_double),
                ("intra_measured", ctypes.c_int), ("inter_measured", ctypes.c_int),
                ("ranks", ctypes.c_int),
                ("replica_cost_intra", ctypes.c_int64), ("replica_cost_inter", ctypes.c_int64),
                ("row_cost_intra", ctypes.c_int64), ("row_cost_inter", ctypes.c_int64),
                ("compute_rows", ctypes.c_int64), ("link_rows", ctypes.c_int64),
                ("transfer_seconds_intra", ctypes.c_double),
                ("transfer_seconds_inter", ctypes.c_double), ("transfer_rows", ctypes.c_int64),
                ("token_seconds_fastest", ctypes.c_double),
                ("token_seconds_slowest", ctypes.c_double)]


COST_FIELDS = ("replica_cost_intra", "replica_cost_inter", "row_cost_intra", "row_cost_inter")
_SPEED_FIELDS = ("token_seconds_fastest", "token_seconds_slowest")


class _StepStats(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("step", ctypes.c_int64), ("tokens", ctypes.c_int64),
                ("total_tokens", ctypes.c_int64), ("max_load_before", ctypes.c_int64),
                ("max_load_after", ctypes.c_int64), ("mean_load", ctypes.c_double),
                ("replicas", ctypes.c_int), ("rows_computed", ctypes.c_int64),
                ("rows_sent", ctypes.c_int64 * len(OPS)),
                ("bytes_sent", ctypes.c_int64 * len(OPS)),
                ("bytes_received", ctypes.c_int64 * len(OPS)),
                ("time_ms", ctypes.c_double * len(PHASES)),
                ("forward_ms", ctypes.c_double), ("backward_ms", ctypes.c_double)]


class _ExpertTensors(ctypes.Structure):
    _fields_ = [("gate", ctypes.c_void_p), ("up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("dtype", ctypes.c_int)]


class _EpLayout(ctypes.Structure):
    _fields_ = [("num_rows", ctypes.c_int64), ("rows", ctypes.c_void_p),
                ("row_weights", ctypes.c_void_p), ("num_groups", ctypes.c_int),
                ("group_expert", ctypes.c_void_p), ("group_offset", ctypes.c_void_p),
                ("group_count", ctypes.c_void_p)]


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


_LIB = None


def _lib():
    global _LIB
    if _LIB is not None:
        return _LIB
    # Open MPI loads its plugins with dlopen; they need libmpi's symbols globally visible.
    for name in ("libmpi.so.40", "libmpi.so"):
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError:
            pass
    here = os.path.dirname(os.path.abspath(__file__))
    explicit = os.environ.get("MOONEP_LIBRARY")
    if explicit:
        # The caller named a library: that one or an error, never a silent fallback to another.
        candidates = [explicit]
    else:
        candidates = [os.path.join(here, "..", "..", "build", "lib", "libmoonep.so"),
                      "libmoonep.so.0"]
    errors = []
    for path in candidates:
        if not path:
            continue
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError as e:
            errors.append(str(e))
    else:
        if explicit:
            raise OSError(f"MOONEP_LIBRARY={explicit} cannot be loaded: " + "; ".join(errors))
        raise OSError("libmoonep not found (set MOONEP_LIBRARY): " + "; ".join(errors))
    lib.moonepGetErrorString.restype = ctypes.c_char_p
    lib.moonepGetLastThreadError.restype = ctypes.c_char_p
    lib.moonepGetLastError.restype = ctypes.c_char_p
    lib.moonepGetLastError.argtypes = [ctypes.c_void_p]
    lib.moonepCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId,
                                       ctypes.c_int]
    lib.moonepLayerForward.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    for f in ("moonepCommDestroy", "moonepLayerDestroy"):
        getattr(lib, f).argtypes = [ctypes.c_void_p]
    if hasattr(lib, "moonepLayerRefuseForward"):
        lib.moonepLayerRefuseForward.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    lib.moonepLayerBackward.argtypes = [ctypes.c_void_p] * 6
    lib.moonepLayerRelease.argtypes = [ctypes.c_void_p] * 2
    lib.moonepLayerBindParams.argtypes = [ctypes.c_void_p] * 3
    lib.moonepLayerGetStats.argtypes = [ctypes.c_void_p, ctypes.POINTER(_StepStats)]
    lib.moonepCommRank.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    lib.moonepCommSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    lib.moonepLayerCreate.argtypes = [ctypes.c_void_p, ctypes.POINTER(_LayerConfig),
                                      ctypes.POINTER(ctypes.c_void_p)]
    lib.moonepEpBufferCreate.argtypes = [ctypes.c_void_p, ctypes.POINTER(_LayerConfig),
                                         ctypes.POINTER(ctypes.c_void_p)]
    lib.moonepEpBufferDestroy.argtypes = [ctypes.c_void_p]
    lib.moonepEpDispatch.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [
        ctypes.POINTER(ctypes.c_void_p)]
    lib.moonepEpGetLayout.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(_EpLayout)]
    for f in ("moonepEpCombine", "moonepEpCombineBackward", "moonepEpDispatchBackward",
              "moonepEpPrefetch", "moonepEpReduce"):
        getattr(lib, f).argtypes = [ctypes.c_void_p] * 4
    lib.moonepEpTopkWeightGrad.argtypes = [ctypes.c_void_p] * 5
    lib.moonepEpRelease.argtypes = [ctypes.c_void_p] * 2
    if hasattr(lib, "moonepMeasureCosts"):
        lib.moonepMeasureCosts.argtypes = [ctypes.c_void_p, ctypes.POINTER(_LayerConfig),
                                           ctypes.POINTER(_CostProbeOptions),
                                           ctypes.POINTER(_MeasuredCosts)]
    if hasattr(lib, "moonepEpRefuseDispatch"):
        lib.moonepEpRefuseDispatch.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    _LIB = lib
    return lib


def _check(function, code):
    if code != 0:
        raise MoonEPError(function, code, _lib().moonepGetLastThreadError().decode())


def _layer_config(what, bad, policy, device="cpu", **fields):
    """A _LayerConfig of `fields` (the defaults of a CPU float32 layer for the others), and the
    first error in the arguments (`bad`, or a policy, device or number that is not one). With an
    error the config is one MoonEP refuses (policy -1): pass it to the collective call anyway, so
    that every rank fails at once instead of waiting for this one, then raise the error."""
    if bad is None and policy not in _POLICIES:
        bad = ValueError(f"policy {policy!r} is not one of {sorted(_POLICIES)}")
    if bad is None and device not in ("cpu", "cuda"):
        bad = ValueError("device must be 'cpu' or 'cuda'")
    values = dict(size=ctypes.sizeof(_LayerConfig), magic=_CONFIG_MAGIC, version=version(),
                  dtype=_FLOAT32, grad_dtype=_FLOAT32, slots=-1, pad_multiple=1,
                  policy=_POLICIES.get(policy, -1), device=1 if device == "cuda" else 0,
                  device_index=0, max_recv_rows=0, max_inflight=1, layer_id=-1, num_threads=0,
                  ranks_per_node=0, eplb_period=1, transport=None)
    values.update(fields)
    try:
        c = _LayerConfig(**values)
    except TypeError as e:  # a number that is not an integer
        bad = bad or ValueError(f"{what}: {e}")
        c = _LayerConfig(size=ctypes.sizeof(_LayerConfig), magic=_CONFIG_MAGIC,
                         version=version())
    if bad is not None:
        c.policy = -1
    return c, bad


def _speeds(comm, speeds, bad):
    """The ctypes array of `speeds` (None: none) for a config on `comm`, and the first error: not
    one finite positive number per rank, or a library older than 0.5.0 (which would ignore them).
    With an error the array is None: MoonEP then never reads past a short list."""
    if speeds is None or bad is not None:
        return None, bad
    if isinstance(speeds, (str, bytes)):
        return None, ValueError("speeds must be a sequence of numbers, one per rank (or "
                                "'measured' with costs from measure_costs)")
    try:
        values = [float(v) for v in speeds]
    except (TypeError, ValueError):
        return None, ValueError("speeds must be a sequence of numbers, one per rank")
    if len(values) != comm.size:
        return None, ValueError(f"speeds has {len(values)} values; the communicator has "
                                f"{comm.size} ranks (one speed each)")
    for r, v in enumerate(values):
        if not (math.isfinite(v) and v > 0):
            return None, ValueError(f"speeds[{r}] is {v}; must be finite and positive")
    bad = _version_error("speeds need", 500)
    return (None, bad) if bad else ((ctypes.c_double * len(values))(*values), None)


def _version_error(what_needs, needed):
    """A ValueError "<what_needs> libmoonep X.Y.0 or later; ..." when the library is older."""
    if version() >= needed:
        return None
    return ValueError(f"{what_needs} libmoonep {needed // 10000}.{needed // 100 % 100}.0 or later; "
                      f"the loaded library is "
                      f"{version() // 10000}.{version() // 100 % 100}.{version() % 100}")


def version():
    v = ctypes.c_int()
    _check("moonepGetVersion", _lib().moonepGetVersion(ctypes.byref(v)))
    return v.value


def _ptr(a):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def _array(name, a, dtype, shape):
    """a as a C-contiguous array of dtype with exactly shape, else ValueError naming it. Integer
    arrays are not made from floats (a silent truncation), nor floats from non-numbers."""
    a = np.asarray(a)
    if np.dtype(dtype).kind in "iu" and a.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, not {a.dtype}")
    if np.dtype(dtype).kind == "f" and a.dtype.kind not in "iuf":
        raise ValueError(f"{name} must hold numbers, not {a.dtype}")
    if a.shape != tuple(shape):
        raise ValueError(f"{name} has shape {a.shape}; expected {tuple(shape)}")
    if np.dtype(dtype).kind in "iu" and a.size:
        info = np.iinfo(dtype)
        if a.min() < info.min or a.max() > info.max:  # the cast would wrap to another id
            raise ValueError(f"{name} holds values outside {np.dtype(dtype).name}")
    return np.ascontiguousarray(a, dtype=dtype)


class Comm:
    """A MoonEP communicator (MPI backend: needs an MPI launch)."""

    def __init__(self, handle):
        self._h = handle

    @staticmethod
    def from_env():
        h = ctypes.c_void_p()
        _check("moonepCommInitFromEnv", _lib().moonepCommInitFromEnv(ctypes.byref(h)))
        return Comm(h)

    @staticmethod
    def unique_id():
        uid = UniqueId()
        _check("moonepGetUniqueId", _lib().moonepGetUniqueId(ctypes.byref(uid)))
        return bytes(uid.internal)

    @staticmethod
    def from_unique_id(uid_bytes, nranks, rank):
        uid = UniqueId()
        ctypes.memmove(uid.internal, uid_bytes, 128)
        h = ctypes.c_void_p()
        _check("moonepCommInitRank", _lib().moonepCommInitRank(ctypes.byref(h), nranks, uid, rank))
        return Comm(h)

    @property
    def rank(self):
        r = ctypes.c_int()
        _check("moonepCommRank", _lib().moonepCommRank(self._h, ctypes.byref(r)))
        return r.value

    @property
    def size(self):
        s = ctypes.c_int()
        _check("moonepCommSize", _lib().moonepCommSize(self._h, ctypes.byref(s)))
        return s.value

    def destroy(self):
        if self._h:
            _check("moonepCommDestroy", _lib().moonepCommDestroy(self._h))
            self._h = None


def measure_costs(comm, num_experts, top_k, hidden, intermediate, max_tokens, policy="moonep",
                  slots=-1, num_threads=0, device="cpu", device_index=0, ranks_per_node=0,
                  compute_rows=0, link_rows=0, repetitions=0, forward_only=False, transfer_rows=0):
    """[collective] The cost probe (libmoonep 0.4.0; docs/runtime.md, "Measured costs"): times
    this rank's executor on one expert of the layer's shape and rows sent between ranks, and
    returns the same dict on every rank: token_seconds, row_seconds_intra / _inter and
    transfer_seconds_intra / _inter (0: not measured), intra_measured, inter_measured, ranks, the
    rows timed, the four costs of Layer (COST_FIELDS;
    pass the dict as Layer(costs=...)), and (libmoonep 0.5.0) token_seconds_fastest / _slowest and
    speeds, each rank's speed relative to the median rank (for Layer(speeds=...) where ranks
    differ in more than noise). The layer arguments are Layer's and must be the same on
    every rank; 0 for compute_rows, link_rows, repetitions: the defaults (512 rows on the CPU, 4096
    on a GPU; 5 repetitions; transfer_rows: as many as hold one expert's gradients, or weights when
    forward_only); compute_rows, link_rows and transfer_rows in the dict are the rows timed."""
    if version() < 400:  # the library has no moonepMeasureCosts to join
        raise _version_error("measure_costs needs", 400)
    c, bad = _layer_config("measure_costs", None, policy, device, num_experts=num_experts,
                           top_k=top_k, hidden=hidden, intermediate=intermediate,
                           max_tokens=max_tokens, slots=slots, num_threads=num_threads,
                           device_index=device_index, ranks_per_node=ranks_per_node)
    speeds = (ctypes.c_double * comm.size)()
    try:
        o = _CostProbeOptions(size=ctypes.sizeof(_CostProbeOptions), compute_rows=compute_rows,
                              link_rows=link_rows, repetitions=repetitions,
                              forward_only=1 if forward_only else 0,
                              transfer_rows=transfer_rows, speeds=speeds)
    except TypeError as e:
        bad = bad or ValueError(f"measure_costs: {e}")
        o = _CostProbeOptions(size=ctypes.sizeof(_CostProbeOptions))
        c.policy = -1
    if bad is not None:
        m = _MeasuredCosts(size=ctypes.sizeof(_MeasuredCosts))
        _lib().moonepMeasureCosts(comm._h, ctypes.byref(c), ctypes.byref(o), ctypes.byref(m))
        raise bad
    m = _MeasuredCosts(size=ctypes.sizeof(_MeasuredCosts))
    _check("moonepMeasureCosts", _lib().moonepMeasureCosts(comm._h, ctypes.byref(c),
                                                           ctypes.byref(o), ctypes.byref(m)))
    # A 0.4.0 library fills the fields up to transfer_rows (and says so in size); it neither
    # reads the options' speeds nor times each rank.
    newer = version() >= 500 and m.size == ctypes.sizeof(_MeasuredCosts)
    out = {name: getattr(m, name) for name, _ in _MeasuredCosts._fields_
           if name != "size" and (newer or name not in _SPEED_FIELDS)}
    out["intra_measured"] = bool(out["intra_measured"])
    out["inter_measured"] = bool(out["inter_measured"])
    if newer and m.token_seconds_fastest > 0:  # every rank timed (always, on success)
        out["speeds"] = list(speeds)
    return out


class Layer:
    """A MoE layer over a communicator: forward/backward with MoonEP's executor (fp32 here).

    device="cpu": numpy arrays through forward/backward/bind. device="cuda": GPU memory of GPU
    device_index through the *_ptr methods (raw device pointers and a cudaStream_t, e.g. from
    torch tensors' data_ptr() and torch.cuda.current_stream().cuda_stream).
    replica_cost_intra / replica_cost_inter (tokens, the same on every rank): policy moonep weighs
    replicas, balancing only as far as a replica's transfers cost less than the compute it saves
    (docs/planner.md, "Weighing replicas"); 0 and 0: perfect balance.
    row_cost_intra / row_cost_inter (1/1024 tokens a row, the same on every rank; libmoonep 0.3.0):
    the weighing also counts the rows a plan moves (docs/planner.md, "Rows in the objective").
    costs: a dict from measure_costs (libmoonep 0.4.0), whose four costs are used instead of the
    four arguments above (passing both is a ValueError).
    speeds: None (every rank alike) or one relative compute speed per rank, the same on every
    rank (libmoonep 0.5.0; policies moonep and moonep-greedy): the planner balances time, not
    tokens (docs/runtime.md, "Ranks of different speeds"). speeds="measured" with
    costs=measure_costs(...) takes the probe's speeds and its costs scaled to the unit the
    planner then counts them in (tokens of the fastest rank)."""

    def __init__(self, comm, num_experts, top_k, hidden, intermediate, max_tokens,
                 policy="moonep", slots=-1, max_inflight=1, num_threads=0, device="cpu",
                 device_index=0, replica_cost_intra=0, replica_cost_inter=0, row_cost_intra=0,
                 row_cost_inter=0, costs=None, speeds=None):
        bad = None
        if isinstance(speeds, str) and speeds == "measured":
            # The probe's speeds, and its costs in the unit the planner then counts them in:
            # tokens of the fastest rank, each the median rank's times the largest speed.
            if costs is None or "speeds" not in costs:
                bad = ValueError("speeds='measured' takes the speeds from costs: pass "
                                 "costs=measure_costs(...) (libmoonep 0.5.0)")
            else:
                speeds = list(costs["speeds"])
                fastest = max(speeds)
                costs = {k: round(costs[k] * fastest) for k in COST_FIELDS if k in costs}
        if costs is not None and bad is None:
            missing = [k for k in COST_FIELDS if k not in costs]
            if replica_cost_intra or replica_cost_inter or row_cost_intra or row_cost_inter:
                bad = ValueError("pass either costs (from measure_costs) or the cost arguments")
            elif missing:
                bad = ValueError(f"costs lacks {missing} (pass what measure_costs returned)")
            else:
                replica_cost_intra, replica_cost_inter, row_cost_intra, row_cost_inter = (
                    costs[k] for k in COST_FIELDS)
        if bad is None and (replica_cost_intra or replica_cost_inter):
            # A 0.1.0 library reads the config only up to its own fields: it would plan perfect
            # balance whatever the costs say.
            bad = _version_error("replica costs need", 200)
        if bad is None and (row_cost_intra or row_cost_inter):
            bad = _version_error("row costs need", 300)
        speeds_array, bad = _speeds(comm, speeds, bad)
        c, bad = _layer_config("Layer", bad, policy, device, speeds=speeds_array,
                               num_experts=num_experts, top_k=top_k,
                               hidden=hidden, intermediate=intermediate, slots=slots,
                               device_index=device_index, max_tokens=max_tokens,
                               max_inflight=max_inflight, num_threads=num_threads,
                               replica_cost_intra=replica_cost_intra,
                               replica_cost_inter=replica_cost_inter,
                               row_cost_intra=row_cost_intra, row_cost_inter=row_cost_inter)
        if bad is not None:
            h = ctypes.c_void_p()
            _lib().moonepLayerCreate(comm._h, ctypes.byref(c), ctypes.byref(h))
            raise bad
        h = ctypes.c_void_p()
        _check("moonepLayerCreate", _lib().moonepLayerCreate(comm._h, ctypes.byref(c),
                                                             ctypes.byref(h)))
        self._h, self.comm = h, comm
        self.device, self.device_index = device, device_index
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden, self.intermediate = hidden, intermediate
        self.experts_per_rank = num_experts // comm.size  # creation checked the divisibility
        self._bound = None
        self._saved = []  # (handle, num_tokens) of forwards awaiting backward, in order

    def bind(self, w_gate, w_up, w_down, g_gate=None, g_up=None, g_down=None):
        """This rank's experts: float32 C-contiguous [E/R][H][I] gate and up, [E/R][I][H] down;
        the gradients alike, all three or none. Bound in place (not copied)."""
        grads = (g_gate, g_up, g_down)
        if any(g is None for g in grads) and any(g is not None for g in grads):
            raise ValueError("gradients: pass g_gate, g_up and g_down together, or none of them")
        epn, hid, inter = self.experts_per_rank, self.hidden, self.intermediate
        shapes = {"gate": (epn, hid, inter), "up": (epn, hid, inter), "down": (epn, inter, hid)}
        for prefix, arrays in (("w", (w_gate, w_up, w_down)), ("g", grads)):
            for (part, shape), a in zip(shapes.items(), arrays):
                if a is None and prefix == "g":
                    continue
                name = f"{prefix}_{part}"
                if not isinstance(a, np.ndarray) or a.dtype != np.float32 or \
                        not a.flags.c_contiguous:
                    raise ValueError(f"{name} must be a C-contiguous float32 numpy array (bound "
                                     "in place, so it is not converted)")
                if a.shape != shape:
                    raise ValueError(f"{name} has shape {a.shape}; expected {shape} "
                                     f"(experts per rank E/R = {epn}, hidden, intermediate)")
                if prefix == "g" and not a.flags.writeable:
                    raise ValueError(f"{name} is read-only; gradients accumulate into it")
        w = _ExpertTensors(_ptr(w_gate), _ptr(w_up), _ptr(w_down), _FLOAT32)
        g = _ExpertTensors(_ptr(g_gate), _ptr(g_up), _ptr(g_down), _FLOAT32)
        _check("moonepLayerBindParams", _lib().moonepLayerBindParams(
            self._h, ctypes.byref(w), ctypes.byref(g) if g_gate is not None else None))
        self._bound = (w_gate, w_up, w_down, g_gate, g_up, g_down)  # keep them alive

    def bind_ptr(self, w_gate, w_up, w_down, g_gate=None, g_up=None, g_down=None):
        """Binds fp32 [epn][H][I], [epn][H][I], [epn][I][H] tensors by address (the caller keeps
        them alive)."""
        w = _ExpertTensors(w_gate, w_up, w_down, _FLOAT32)
        g = _ExpertTensors(g_gate, g_up, g_down, _FLOAT32)
        _check("moonepLayerBindParams", _lib().moonepLayerBindParams(
            self._h, ctypes.byref(w), ctypes.byref(g) if g_gate is not None else None))

    def forward_ptr(self, num_tokens, x, topk_ids, topk_weights, y, stream=None):
        """Forward on addresses (device memory for a cuda layer); returns after y is complete."""
        h = ctypes.c_void_p()
        _check("moonepLayerForward", _lib().moonepLayerForward(
            self._h, num_tokens, x, topk_ids, topk_weights, y, ctypes.byref(h), stream))
        self._saved.append((h, num_tokens))

    def backward_ptr(self, dy, dx, d_topk_weights, stream=None):
        """Backward of the most recent forward_ptr, on addresses; gradients += into the bound ones."""
        h, _ = self._last("backward_ptr")
        self._saved.pop()
        _check("moonepLayerBackward", _lib().moonepLayerBackward(self._h, h, dy, dx,
                                                                 d_topk_weights, stream))

    def forward(self, x, topk_ids, topk_weights):
        """x [T][H], topk_ids [T][K] (integers in [0, E)), topk_weights [T][K]; returns y [T][H]."""
        try:
            x = np.asarray(x)
            if x.ndim != 2:
                raise ValueError(f"x has shape {x.shape}; expected (tokens, hidden = {self.hidden})")
            tokens = x.shape[0]
            x = _array("x", x, np.float32, (tokens, self.hidden))
            ids = _array("topk_ids", topk_ids, np.int32, (tokens, self.top_k))
            w = _array("topk_weights", topk_weights, np.float32, (tokens, self.top_k))
        except ValueError as e:
            # The forward is collective: join it refusing, so that every rank fails this forward
            # at once (the peers do not wait for this one until the timeout, and their error gives
            # this reason) and the layer stays usable.
            self._refuse_forward(str(e))
            raise
        y = np.empty_like(x)
        h = ctypes.c_void_p()
        _check("moonepLayerForward", _lib().moonepLayerForward(
            self._h, x.shape[0], _ptr(x), _ptr(ids), _ptr(w), _ptr(y), ctypes.byref(h), None))
        self._saved.append((h, x.shape[0]))
        return y

    def _refuse_forward(self, reason, stream=None):
        lib = _lib()
        if hasattr(lib, "moonepLayerRefuseForward"):
            lib.moonepLayerRefuseForward(self._h, reason.encode(errors="replace"), stream)
        else:  # a library older than that call: an argument it refuses (no handle)
            lib.moonepLayerForward(self._h, 0, None, None, None, None, None, None)

    def _last(self, what):
        if not self._saved:
            raise RuntimeError(f"{what}: no forward awaits it (each forward is backwarded or "
                               "released once, most recent first)")
        return self._saved[-1]

    def backward(self, dy):
        """Backward of the most recent forward not yet backwarded: dy [T][H] of that forward;
        returns dx [T][H] and d topk_weights [T][K]."""
        h, tokens = self._last("backward")
        try:
            dy = _array("dy", dy, np.float32, (tokens, self.hidden))
        except ValueError as e:
            # The backward is collective: MoonEP refuses a NULL dy and tells every peer, which fail
            # their backward at once instead of waiting for this rank until the timeout. The
            # layer is unusable afterwards on every rank.
            self._saved.pop()
            if _lib().moonepLayerBackward(self._h, h, None, None, None, None) != 0:
                raise ValueError(f"{e} (the backward failed on every rank; the layer is "
                                 "unusable now: destroy it)") from None
            raise  # no rows on this rank: MoonEP's backward ran without them
        self._saved.pop()
        dx = np.empty_like(dy)
        dtopk = np.empty((tokens, self.top_k), dtype=np.float32)
        _check("moonepLayerBackward", _lib().moonepLayerBackward(self._h, h, _ptr(dy), _ptr(dx),
                                                                 _ptr(dtopk), None))
        return dx, dtopk

    def release(self):
        """Drops the most recent forward's saved state (inference)."""
        h, _ = self._last("release")
        self._saved.pop()
        _check("moonepLayerRelease", _lib().moonepLayerRelease(self._h, h))

    def stats(self):
        s = _StepStats(size=ctypes.sizeof(_StepStats))
        _check("moonepLayerGetStats", _lib().moonepLayerGetStats(self._h, ctypes.byref(s)))
        return {"step": s.step, "tokens": s.tokens, "max_load_before": s.max_load_before,
                "max_load_after": s.max_load_after, "mean_load": s.mean_load,
                "replicas": s.replicas,
                "bytes_sent": {op: s.bytes_sent[i] for i, op in enumerate(OPS)},
                "time_ms": {p: s.time_ms[i] for i, p in enumerate(PHASES)},
                "forward_ms": s.forward_ms, "backward_ms": s.backward_ms}

    def destroy(self):
        if self._h:
            _check("moonepLayerDestroy", _lib().moonepLayerDestroy(self._h))
            self._h = None


class EpHandle:
    """One dispatch of an EpBuffer: its compute layout, copied out of MoonEP (so it stays valid
    after release): rows [num_rows][H] (padding rows are zero), row_weights [num_rows], and per
    group g (E/R home groups, then the replica slots) group_expert[g] (-1: an unused slot),
    group_offset[g] and group_count[g] (rows holding tokens)."""

    def __init__(self, handle, tokens, layout, hidden):
        self._h, self.tokens = handle, tokens
        n, g = layout.num_rows, layout.num_groups
        self.num_rows, self.num_groups = n, g

        def copy(address, count, ctype, dtype, shape):
            if count == 0:
                return np.zeros(shape, dtype)
            buf = (ctype * count).from_address(address)
            return np.array(np.ctypeslib.as_array(buf), dtype=dtype).reshape(shape)
        self.rows = copy(layout.rows, n * hidden, ctypes.c_float, np.float32, (n, hidden))
        self.row_weights = copy(layout.row_weights, n, ctypes.c_float, np.float32, (n,))
        self.group_expert = copy(layout.group_expert, g, ctypes.c_int32, np.int32, (g,))
        self.group_offset = copy(layout.group_offset, g, ctypes.c_int64, np.int64, (g,))
        self.group_count = copy(layout.group_count, g, ctypes.c_int64, np.int64, (g,))


class EpBuffer:
    """The EP buffer (DeepEP-style, C API level 2) over a communicator, on host memory (float32,
    numpy): MoonEP plans each dispatch and moves rows and expert parameters; the caller computes
    the experts between dispatch and combine.

        buf = moonep.EpBuffer(comm, num_experts=16, top_k=2, hidden=64, intermediate=128,
                              max_tokens=256)
        h = buf.dispatch(x, topk_ids, topk_weights)      # h.rows, h.group_expert, ...
        buf.prefetch(h, (w_gate, w_up, w_down), (r_gate, r_up, r_down))   # writes r_*
        y = buf.combine(h, out_rows)                     # y[t] = sum_k w[t][k] out(t, k)
        dy_rows = buf.combine_backward(h, dy)            # unweighted
        d_topk = buf.topk_weight_grad(h, dy_rows, out_rows)
        dx = buf.dispatch_backward(h, dx_rows)           # dx[t] = sum_k dx_rows(t, k)
        buf.reduce(h, (g_gate, g_up, g_down), (rg_gate, rg_up, rg_down))  # adds into g_*
        buf.release(h)
        buf.destroy()

    Every call but release is collective (every rank, the same dispatch's handle, the same
    order; destroy too, in the same order as the other objects of the communicator). A wrong
    argument is a ValueError (TypeError for a handle that is not an EpHandle) naming it, and the
    call still joins its peers: a refused dispatch fails every rank's dispatch at once (the peers'
    MoonEPError gives this rank's reason) and the buffer stays usable; a refused later call fails
    every rank's call and leaves the buffer unusable (destroy it), as MoonEP does for any failed
    collective call after a dispatch. After a call that failed, the arrays it was given are kept
    alive until destroy (a peer may still write into them: MoonEP's rule for the C API).
    """

    def __init__(self, comm, num_experts, top_k, hidden, max_tokens, intermediate=0,
                 policy="moonep", slots=-1, max_inflight=1, pad_multiple=1, speeds=None):
        speeds_array, bad = _speeds(comm, speeds, None)
        c, bad = _layer_config("EpBuffer", bad, policy, speeds=speeds_array,
                               num_experts=num_experts, top_k=top_k,
                               hidden=hidden, intermediate=intermediate, slots=slots,
                               pad_multiple=pad_multiple, max_tokens=max_tokens,
                               max_inflight=max_inflight, num_threads=1)
        h = ctypes.c_void_p()
        if bad is not None:
            _lib().moonepEpBufferCreate(comm._h, ctypes.byref(c), ctypes.byref(h))
            raise bad
        _check("moonepEpBufferCreate", _lib().moonepEpBufferCreate(comm._h, ctypes.byref(c),
                                                                   ctypes.byref(h)))
        self._h, self.comm = h, comm
        self.num_experts, self.top_k, self.hidden = num_experts, top_k, hidden
        self.intermediate = intermediate
        self.experts_per_rank = num_experts // comm.size
        self.slots = self.experts_per_rank if slots < 0 else slots
        self._failed = []  # arrays given to calls that failed: alive until destroy

    def dispatch(self, x, topk_ids, topk_weights):
        """x [T][H], topk_ids [T][K] (integers in [-1, E)), topk_weights [T][K]: an EpHandle."""
        try:
            x = np.asarray(x)
            if x.ndim != 2:
                raise ValueError(f"x has shape {x.shape}; expected (tokens, "
                                 f"hidden = {self.hidden})")
            tokens = x.shape[0]
            x = _array("x", x, np.float32, (tokens, self.hidden))
            ids = _array("topk_ids", topk_ids, np.int32, (tokens, self.top_k))
            w = _array("topk_weights", topk_weights, np.float32, (tokens, self.top_k))
        except ValueError as e:
            lib = _lib()  # join the peers' dispatch refusing it, with this reason
            if hasattr(lib, "moonepEpRefuseDispatch"):
                lib.moonepEpRefuseDispatch(self._h, str(e).encode(errors="replace"))
            else:  # a library older than that call: an argument it refuses (no handle)
                lib.moonepEpDispatch(self._h, 0, None, None, None, None)
            raise
        h = ctypes.c_void_p()
        code = _lib().moonepEpDispatch(self._h, tokens, _ptr(x), _ptr(ids), _ptr(w),
                                       ctypes.byref(h))
        if code != 0:
            self._failed.append((x, ids, w))
        _check("moonepEpDispatch", code)
        try:
            layout = _EpLayout()
            _check("moonepEpGetLayout", _lib().moonepEpGetLayout(self._h, h,
                                                                 ctypes.byref(layout)))
            if layout.num_groups != self.experts_per_rank + self.slots:
                raise RuntimeError(f"the layout has {layout.num_groups} groups; the binding "
                                   f"expects E/R + slots = {self.experts_per_rank + self.slots}")
            return EpHandle(h, tokens, layout, self.hidden)
        except BaseException:
            _lib().moonepEpRelease(self._h, h)  # local: the handle is not lost
            raise

    def _handle(self, name, handle, call):
        """The C handle of `handle`, else: join the collective call `call(None)` (MoonEP refuses a
        NULL handle on every rank) and raise TypeError."""
        if isinstance(handle, EpHandle):
            return handle._h
        call(None)
        raise TypeError(f"{name}: handle must be an EpHandle from dispatch, not "
                        f"{type(handle).__name__} (the {name} failed on every rank; the EP "
                        "buffer is unusable now: destroy it)")

    def _run(self, name, function, kept, *args):
        """The C call; on failure its arrays stay alive until destroy."""
        code = getattr(_lib(), function)(*args)
        if code != 0:
            self._failed.append(kept)
        _check(function, code)

    def _collective(self, name, arrays, call):
        """Each (label, array, shape) as a float32 C-contiguous array: [(array, pointer)], to keep
        alive over the C call. A wrong array joins the collective call (`call` with NULL
        pointers, which MoonEP refuses on every rank where the array would have elements) and
        raises ValueError."""
        ptrs, error = [], None
        for label, a, shape in arrays:
            try:
                a = _array(label, a, np.float32, shape)
                ptrs.append((a, _ptr(a)))
            except ValueError as e:
                error = error or e
                ptrs.append((None, None))
        if error is not None:
            if call(*[None for _ in ptrs]) == 0:  # nothing to read or write on any rank here
                raise ValueError(f"{error} (MoonEP needed nothing of it: the {name} completed "
                                 "on every rank)") from None
            raise ValueError(f"{error} (the {name} failed on every rank; the EP buffer is unusable "
                             "now: destroy it)") from None
        return ptrs

    def _experts(self, label, tensors, count, writable):
        """Three arrays gate [count][H][I], up [count][H][I], down [count][I][H] as a
        moonepExpertTensors_t (kept alive by the returned list); `writable`: MoonEP writes them."""
        if not isinstance(tensors, (tuple, list)) or len(tensors) != 3:
            raise ValueError(f"{label} must be (gate, up, down)")
        if self.intermediate <= 0:
            raise ValueError(f"{label}: the EP buffer was created with intermediate = "
                             f"{self.intermediate}; expert tensors need intermediate > 0")
        H, I = self.hidden, self.intermediate
        shapes = ((count, H, I), (count, H, I), (count, I, H))
        arrays = []
        for part, a, shape in zip(("gate", "up", "down"), tensors, shapes):
            name = f"{label}_{part}"
            if not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous:
                raise ValueError(f"{name} must be a C-contiguous float32 numpy array (used in "
                                 "place, so it is not converted)")
            if a.shape != shape:
                raise ValueError(f"{name} has shape {a.shape}; expected {shape}")
            if writable and not a.flags.writeable:
                raise ValueError(f"{name} is read-only; MoonEP writes into it")
            arrays.append(a)
        return arrays, _ExpertTensors(*(_ptr(a) for a in arrays), _FLOAT32)

    def _rows_call(self, name, function, handle, label, array, rows_in):
        """A collective call that maps one float32 array to another through the handle's layout:
        `array` [num_rows][H] -> [T][H] (rows_in) or [T][H] -> [num_rows][H]."""
        lib = _lib()
        call = getattr(lib, function)
        hp = self._handle(name, handle, lambda p: call(self._h, p, None, None))
        n_in, n_out = (handle.num_rows, handle.tokens) if rows_in else \
            (handle.tokens, handle.num_rows)
        out = np.empty((n_out, self.hidden), np.float32)
        kept = self._collective(name, [(label, array, (n_in, self.hidden))],
                                lambda p: call(self._h, hp, p, None))
        self._run(name, function, (kept, out), self._h, hp, kept[0][1], _ptr(out))
        return out

    def combine(self, handle, out_rows):
        """out_rows [num_rows][H], the experts' outputs: y [T][H],
        y[t] = sum_k w[t][k] out(t, k)."""
        return self._rows_call("combine", "moonepEpCombine", handle, "out_rows", out_rows,
                               rows_in=True)

    def combine_backward(self, handle, dy):
        """dy [T][H]: dy_rows [num_rows][H] (unweighted: dy of each row's token)."""
        return self._rows_call("combine backward", "moonepEpCombineBackward", handle, "dy", dy,
                               rows_in=False)

    def topk_weight_grad(self, handle, dy_rows, out_rows):
        """d topk_weights [T][K]: <dy[t], out(t, k)> from each row's dy and output."""
        lib = _lib()
        hp = self._handle("top-k weight gradient", handle,
                          lambda p: lib.moonepEpTopkWeightGrad(self._h, p, None, None, None))
        d = np.empty((handle.tokens, self.top_k), np.float32)
        shape = (handle.num_rows, self.hidden)
        kept = self._collective(
            "top-k weight gradient", [("dy_rows", dy_rows, shape), ("out_rows", out_rows, shape)],
            lambda a, b: lib.moonepEpTopkWeightGrad(self._h, hp, a, b, None))
        self._run("top-k weight gradient", "moonepEpTopkWeightGrad", (kept, d), self._h, hp,
                  kept[0][1], kept[1][1], _ptr(d))
        return d

    def dispatch_backward(self, handle, dx_rows):
        """dx_rows [num_rows][H]: dx [T][H], dx[t] = sum_k dx_rows(t, k)."""
        return self._rows_call("dispatch backward", "moonepEpDispatchBackward", handle, "dx_rows",
                               dx_rows, rows_in=True)

    def _weights_call(self, name, function, handle, home, replicas, home_written):
        lib = _lib()
        call = getattr(lib, function)
        hp = self._handle(name, handle, lambda p: call(self._h, p, None, None))
        try:
            home_arrays, home_t = self._experts(f"{name}: home", home, self.experts_per_rank,
                                                writable=home_written)
            replica_arrays, replica_t = self._experts(f"{name}: replica", replicas, self.slots,
                                                      writable=not home_written)
        except ValueError as e:
            call(self._h, hp, None, None)
            raise ValueError(f"{e} (the {name} failed on every rank; the EP buffer is unusable "
                             "now: destroy it)") from None
        self._run(name, function, (home_arrays, replica_arrays), self._h, hp,
                  ctypes.byref(home_t), ctypes.byref(replica_t))

    def prefetch(self, handle, home_weights, replica_weights):
        """The home weights (gate, up, down of this rank's E/R experts; read) of each expert the
        handle's plan replicates, written into the replica slots' arrays (gate, up, down of
        `slots` experts) of the ranks that compute it."""
        self._weights_call("prefetch", "moonepEpPrefetch", handle, home_weights, replica_weights,
                           home_written=False)

    def reduce(self, handle, home_grads, replica_grads):
        """Each replica slot's gradients (read) added (+=) into its home expert's gradients
        (written), in a fixed order."""
        self._weights_call("reduce", "moonepEpReduce", handle, home_grads, replica_grads,
                           home_written=True)

    def release(self, handle):
        """Local: frees the dispatch's state (its layout copy stays in the EpHandle)."""
        if not isinstance(handle, EpHandle):
            raise TypeError(f"release: handle must be an EpHandle, not {type(handle).__name__}")
        _check("moonepEpRelease", _lib().moonepEpRelease(self._h, handle._h))

    def destroy(self):
        """Collective, in the same order as the communicator's other objects on every rank."""
        if self._h:
            _check("moonepEpBufferDestroy", _lib().moonepEpBufferDestroy(self._h))
            self._h = None
            self._failed = []
