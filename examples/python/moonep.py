"""ctypes binding of the MoonEP C API (moonep.h + moonep_runtime.h): communicators and the MoE
layer. Arrays are numpy arrays (C-contiguous); MoonEP reads and writes them in place, so they must
stay alive while MoonEP uses them (weights and gradients: while bound to the layer).

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
                ("eplb_period", ctypes.c_int), ("transport", ctypes.c_char_p)]


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
    _LIB = lib
    return lib


def _check(function, code):
    if code != 0:
        raise MoonEPError(function, code, _lib().moonepGetLastThreadError().decode())


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


class Layer:
    """A MoE layer over a communicator: forward/backward with MoonEP's executor (fp32 here).

    device="cpu": numpy arrays through forward/backward/bind. device="cuda": GPU memory of GPU
    device_index through the *_ptr methods (raw device pointers and a cudaStream_t, e.g. from
    torch tensors' data_ptr() and torch.cuda.current_stream().cuda_stream)."""

    def __init__(self, comm, num_experts, top_k, hidden, intermediate, max_tokens,
                 policy="moonep", slots=-1, max_inflight=1, num_threads=0, device="cpu",
                 device_index=0):
        if device not in ("cpu", "cuda"):
            raise ValueError("device must be 'cpu' or 'cuda'")
        if policy not in _POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {sorted(_POLICIES)}")
        c = _LayerConfig(size=ctypes.sizeof(_LayerConfig), magic=_CONFIG_MAGIC,
                         version=version(), num_experts=num_experts, top_k=top_k, hidden=hidden,
                         intermediate=intermediate, dtype=_FLOAT32, grad_dtype=_FLOAT32,
                         slots=slots, pad_multiple=1, policy=_POLICIES[policy],
                         device=1 if device == "cuda" else 0,
                         device_index=device_index, max_tokens=max_tokens, max_recv_rows=0,
                         max_inflight=max_inflight, layer_id=-1, num_threads=num_threads,
                         ranks_per_node=0, eplb_period=1, transport=None)
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
