"""A torch.autograd.Function over the MoonEP C API, checked against a pure-PyTorch MoE layer
(SwiGLU experts, top-k routing), on CPU tensors or on CUDA tensors:

    mpirun -np 2 python3 examples/torch/moe_torch.py
    mpirun -np 1 python3 examples/torch/moe_torch.py --device cuda   # one rank per GPU (NCCL)

On CUDA, MoonEP reads and writes the tensors in GPU memory (data_ptr()) and orders its work after
the current torch stream (torch.cuda.current_stream()); each rank uses the GPU of its local rank
on its node (one GPU per rank: more ranks on a node than GPUs is an error, exit 2).

MoonEPMoE.apply(x, topk_weights, w_gate, w_up, w_down, layer, topk_ids) runs MoonEP's forward;
its backward returns dx, d topk_weights and this rank's expert weight gradients, so autograd
fills .grad of every parameter as usual. Each rank owns its E/R experts' parameters (expert
parallelism); the pure-PyTorch layer holds every expert and every rank's tokens and is the
reference. Wrong tensors (shapes, dtypes, another device) are refused first, on every rank at
once, with a ValueError naming them. Exit code 0 when every wrong input was refused and forward
and every gradient match (rel. error < 1e-5); exit code 77 (skip) when PyTorch is missing.
"""
import argparse
import os
import sys

try:
    import torch
except ImportError:
    print("SKIPPED: PyTorch is not installed (import torch failed)")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import moonep  # noqa: E402


def _stream(t):
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else None


def _check_inputs(layer, x, topk_ids, topk_weights):
    """What MoonEP cannot see behind raw pointers, checked before they reach it: shapes (a
    narrower tensor would be read past its end), dtypes, the layer's device. The message of a
    ValueError, or None."""
    cuda = layer.device == "cuda"
    device = torch.device("cuda", layer.device_index) if cuda else torch.device("cpu")
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != device:
            return f"{name} is on {t.device}; the layer's tensors are on {device}"
    if x.dim() != 2 or x.shape[1] != layer.hidden:
        return f"x has shape {tuple(x.shape)}; expected (tokens, hidden = {layer.hidden})"
    if x.dtype != torch.float32:
        return f"x is {x.dtype}; the layer computes in torch.float32"
    T, K = x.shape[0], layer.top_k
    if tuple(topk_ids.shape) != (T, K):
        return f"topk_ids has shape {tuple(topk_ids.shape)}; expected {(T, K)}"
    if tuple(topk_weights.shape) != (T, K):
        return f"topk_weights has shape {tuple(topk_weights.shape)}; expected {(T, K)}"
    if topk_ids.dtype not in (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8):
        return f"topk_ids must hold integers, not {topk_ids.dtype}"
    if not topk_weights.is_floating_point():
        return f"topk_weights must be floating point, not {topk_weights.dtype}"
    if topk_ids.dtype == torch.int64 and topk_ids.numel() > 0 and bool(
            ((topk_ids < -2 ** 31) | (topk_ids >= 2 ** 31)).any()):  # would wrap into valid ids
        return "topk_ids holds values outside int32"
    return None


class MoonEPMoE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, w_gate, w_up, w_down, layer, topk_ids):
        ctx.layer = layer
        # A wrong tensor is refused on every rank at once (the peers' error gives this rank's
        # reason, through moonepLayerRefuseForward), and the layer stays usable.
        why = _check_inputs(layer, x, topk_ids, topk_weights)
        if why is not None:
            stream = None  # a CUDA layer's refusal is ordered after its GPU's current stream
            if layer.device == "cuda":
                stream = torch.cuda.current_stream(
                    torch.device("cuda", layer.device_index)).cuda_stream
            layer._refuse_forward(why, stream)
            raise ValueError(why)
        if layer.device == "cpu":
            y = layer.forward(x.detach().contiguous().numpy(), topk_ids.contiguous().numpy(),
                              topk_weights.detach().float().contiguous().numpy())
            return torch.from_numpy(y)
        # Device memory: MoonEP reads x, ids, weights and writes y in place, after the work
        # queued on the current stream; the call returns when y is complete.
        x, ids = x.detach().contiguous(), topk_ids.to(torch.int32).contiguous()
        w = topk_weights.detach().float().contiguous()
        y = torch.empty_like(x)
        layer.forward_ptr(x.shape[0], x.data_ptr(), ids.data_ptr(), w.data_ptr(), y.data_ptr(),
                          _stream(x))
        ctx.shape = (x.shape[0], ids.shape[1])
        return y

    @staticmethod
    def backward(ctx, dy):
        layer = ctx.layer
        for g in layer.grads:  # MoonEP accumulates into the bound buffers: start from zero
            g.zero_()
        if not dy.is_cuda:
            dx, dtopk = layer.backward(dy.contiguous().numpy())
            dx, dtopk = torch.from_numpy(dx), torch.from_numpy(dtopk)
        else:
            dy = dy.contiguous()
            dx = torch.empty_like(dy)
            dtopk = torch.empty(ctx.shape, dtype=torch.float32, device=dy.device)
            layer.backward_ptr(dy.data_ptr(), dx.data_ptr(), dtopk.data_ptr(), _stream(dy))
        return (dx, dtopk, layer.grads[0].clone(), layer.grads[1].clone(),
                layer.grads[2].clone(), None, None)


class MoonEPLayer(torch.nn.Module):
    """This rank's share of a MoE layer: E/R experts' parameters, MoonEP underneath."""

    def __init__(self, comm, num_experts, top_k, hidden, intermediate, max_tokens, w_gate, w_up,
                 w_down, device=torch.device("cpu"), policy="moonep"):
        super().__init__()
        self.w_gate = torch.nn.Parameter(w_gate.clone().contiguous().to(device))
        self.w_up = torch.nn.Parameter(w_up.clone().contiguous().to(device))
        self.w_down = torch.nn.Parameter(w_down.clone().contiguous().to(device))
        cuda = device.type == "cuda"
        self.layer = moonep.Layer(comm, num_experts=num_experts, top_k=top_k, hidden=hidden,
                                  intermediate=intermediate, max_tokens=max_tokens,
                                  num_threads=1, policy=policy,
                                  device="cuda" if cuda else "cpu",
                                  device_index=device.index or 0)
        self.layer.grads = [torch.zeros_like(p) for p in (self.w_gate, self.w_up, self.w_down)]
        params = (self.w_gate, self.w_up, self.w_down)
        if cuda:  # MoonEP reads the parameters and accumulates the gradients in GPU memory
            self.layer.bind_ptr(*(p.data_ptr() for p in params),
                                *(g.data_ptr() for g in self.layer.grads))
        else:  # numpy views share the tensors' memory
            self.layer.bind(*(p.detach().numpy() for p in params),
                            *(g.numpy() for g in self.layer.grads))

    def forward(self, x, topk_ids, topk_weights):
        return MoonEPMoE.apply(x, topk_weights, self.w_gate, self.w_up, self.w_down, self.layer,
                               topk_ids)


class TorchMoE(torch.nn.Module):
    """The pure-PyTorch reference: every expert, SwiGLU FFN, top-k weighted sum."""

    def __init__(self, w_gate, w_up, w_down):
        super().__init__()
        self.w_gate = torch.nn.Parameter(w_gate.clone())
        self.w_up = torch.nn.Parameter(w_up.clone())
        self.w_down = torch.nn.Parameter(w_down.clone())

    def forward(self, x, topk_ids, topk_weights):
        y = torch.zeros_like(x)
        for e in range(self.w_gate.shape[0]):
            t_idx, k_idx = torch.nonzero(topk_ids == e, as_tuple=True)
            if len(t_idx) == 0:
                continue
            xe = x[t_idx]
            h = torch.nn.functional.silu(xe @ self.w_gate[e]) * (xe @ self.w_up[e])
            y = y.index_add(0, t_idx, topk_weights[t_idx, k_idx].unsqueeze(1) * (h @ self.w_down[e]))
        return y


def rel(a, b):
    a, b = a.double(), b.double()
    den = b.abs().max()
    return float((a - b).abs().max() / den) if den > 0 else float((a - b).abs().max())


def main():
    parser = argparse.ArgumentParser(description="A MoonEP MoE layer under PyTorch autograd, "
                                     "checked against a PyTorch reference.")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="tensors on the CPU, or on one GPU per rank")
    # Replicas on one rank come from the test policy only (a single rank has no peer to help).
    parser.add_argument("--policy", default="moonep", choices=sorted(moonep._POLICIES),
                        help="the planner policy (default moonep)")
    args = parser.parse_args()
    cuda, policy = args.device == "cuda", args.policy
    if cuda and not torch.cuda.is_available():
        print("SKIPPED: --device cuda but torch.cuda.is_available() is False")
        return 77
    comm = moonep.Comm.from_env()
    R, rank = comm.size, comm.rank
    # This node's ranks (Open MPI, torchrun, Slurm; else every rank is on this node).
    local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or
                     os.environ.get("LOCAL_WORLD_SIZE") or
                     os.environ.get("SLURM_NTASKS_PER_NODE") or R)
    local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK") or
                     os.environ.get("LOCAL_RANK") or os.environ.get("SLURM_LOCALID") or rank)
    if cuda and local_size > torch.cuda.device_count():
        # One rank per GPU: NCCL refuses two ranks on one GPU (with an error of its own, later).
        print(f"error: {local_size} ranks on this node but {torch.cuda.device_count()} GPUs: "
              "--device cuda needs one GPU per rank", file=sys.stderr)
        return 2
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    epn, K, H, I = 2, 2, 16, 32
    E = epn * R
    tokens = [24 + 5 * r for r in range(R)]
    T = sum(tokens)
    g = torch.Generator().manual_seed(11)
    w_gate = torch.randn(E, H, I, generator=g) / H ** 0.5
    w_up = torch.randn(E, H, I, generator=g) / H ** 0.5
    w_down = torch.randn(E, I, H, generator=g) / I ** 0.5
    x = torch.randn(T, H, generator=g)
    dy = torch.randn(T, H, generator=g)
    popularity = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
    ids = torch.stack([torch.multinomial(popularity, K, replacement=False, generator=g)
                       for _ in range(T)]).to(torch.int32)
    ids[torch.rand(T, K, generator=g) < 0.1] = -1
    logits = torch.randn(T, K, generator=g)

    lo, hi = sum(tokens[:rank]), sum(tokens[:rank + 1])
    mine = slice(rank * epn, (rank + 1) * epn)
    ours = MoonEPLayer(comm, E, K, H, I, max(tokens), w_gate[mine], w_up[mine], w_down[mine],
                       device=device, policy=policy)
    ref = TorchMoE(w_gate.double(), w_up.double(), w_down.double())

    # Wrong tensors, on every rank alike: a ValueError naming the argument, the forward refused
    # on every rank at once, and the layer still usable (the step below checks it).
    n = hi - lo
    xs, ids_s = x[lo:hi].to(device), ids[lo:hi].to(device)
    ws = torch.ones(n, K, device=device)
    other = torch.device("cpu") if cuda else torch.device("meta")
    bad = [(f"x has shape {(n, H + 1)}", lambda: ours(torch.zeros(n, H + 1, device=device),
                                                     ids_s, ws)),
           (f"topk_ids has shape {(n, K - 1)}", lambda: ours(xs, ids_s[:, :K - 1], ws)),
           (f"topk_weights has shape {(n - 1, K)}", lambda: ours(xs, ids_s, ws[:n - 1])),
           ("x is torch.bfloat16", lambda: ours(xs.to(torch.bfloat16), ids_s, ws)),
           ("topk_ids must hold integers", lambda: ours(xs, ids_s.float(), ws)),
           ("topk_ids holds values outside int32",
            lambda: ours(xs, ids_s.long() + 2 ** 32, ws)),
           (f"x is on {other}", lambda: ours(xs.to(other), ids_s, ws))]
    failures = []
    for fragment, call in bad:
        try:
            call()
            failures.append(f"{fragment!r}: the call succeeded")
        except ValueError as e:
            if fragment not in str(e):
                failures.append(f"{fragment!r} not in ValueError: {e}")
        except Exception as e:  # noqa: BLE001 - anything else is a failure (and left peers waiting)
            failures.append(f"{fragment!r}: {type(e).__name__}: {e}")
    for f in failures:
        print(f"[rank {rank}] bad input: FAIL: {f}", flush=True)

    # Router weights from logits, so d topk_weights flows on into the router's input too.
    x_ours = x[lo:hi].clone().to(device).requires_grad_(True)
    logits_ours = logits[lo:hi].clone().to(device).requires_grad_(True)
    ids_ours = ids[lo:hi].contiguous().to(device)
    w_ours = torch.softmax(logits_ours, dim=1) * (ids_ours >= 0)
    y_ours = ours(x_ours, ids_ours, w_ours)
    (y_ours * dy[lo:hi].to(device)).sum().backward()

    x_ref = x.double().requires_grad_(True)
    logits_ref = logits.double().requires_grad_(True)
    w_ref = torch.softmax(logits_ref, dim=1) * (ids >= 0)
    y_ref = ref(x_ref, ids.long(), w_ref)
    (y_ref * dy.double()).sum().backward()

    errors = {"y": rel(y_ours.detach().cpu(), y_ref.detach()[lo:hi]),
              "dx": rel(x_ours.grad.cpu(), x_ref.grad[lo:hi]),
              "dlogits": rel(logits_ours.grad.cpu(), logits_ref.grad[lo:hi]),
              "dWg": rel(ours.w_gate.grad.cpu(), ref.w_gate.grad[mine]),
              "dWu": rel(ours.w_up.grad.cpu(), ref.w_up.grad[mine]),
              "dWd": rel(ours.w_down.grad.cpu(), ref.w_down.grad[mine])}
    ok = all(v < 1e-5 for v in errors.values()) and not failures
    replicas = ours.layer.stats()["replicas"]
    print(f"[rank {rank}] torch {torch.__version__} on {device} ({policy}, {replicas} replicas): "
          "MoonEP autograd.Function vs pure PyTorch: "
          + " ".join(f"{k} {v:.1e}" for k, v in errors.items())
          + f", {len(bad) - len(failures)}/{len(bad)} wrong inputs refused"
          + (" -> PASS" if ok else " -> FAIL"),
          flush=True)
    ours.layer.destroy()
    comm.destroy()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
