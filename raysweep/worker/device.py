"""Device and precision: which precision, compilation and CUDA graphs a rank's device gets, and the host
memory tuning of CPU workers."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

GiB = 2**30
AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# CUDA graphs where launches leave the GPU idle: on an H100 (bf16, compiled) the step at micro-batch 64 ran 4.4×
# faster as a graph (50,980 against 11,651 images/s), at 1024 1.3 % (benchmarks/RESULTS.md); above this the
# graph's private memory pool, which evaluation cannot reuse, costs more than the launches it saves
GRAPH_MAX_MICRO_BATCH = 512


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` → bf16 where the hardware computes it natively (GPUs that support it; CPUs with AVX512-BF16
    or AMX), else fp32.

    Measured on the CPU step (benchmarks/RESULTS.md): an AVX512-BF16 CPU ran bf16 autocast 2-2.5× faster
    than fp32 (batch 64-512, same loss to 0.1 %); an AVX2-only CPU ran it 3× slower, emulated.
    """
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if cpu_has_native_bf16() else "fp32"


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX tiles, as torch's CPU dispatch sees them (private probes: absent → False, fp32)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_compile(setting: bool | str, device: torch.device) -> bool:
    """`auto` → compile on CUDA (Inductor fuses BatchNorm, ReLU, dropout and pooling: 2.2× the eager step at batch
    1024 bf16 on an H100), not on CPU workers (slower there: 42-44 against 64-68 images/s at batch 32, after a
    minute of compiling; benchmarks/RESULTS.md)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def resolve_graphs(setting: bool | str, device: torch.device, precision: str, world_size: int,
                   micro_batch: int) -> bool:
    """Whether a rank replays its optimizer steps as CUDA graphs.

    Only on CUDA, for one-rank trials (a graph cannot hold gloo's collectives, and NCCL ones need DDP's
    static-graph mode: not done), never under fp16 (GradScaler reads its overflow flag on the host). `auto`
    adds: micro-batches up to GRAPH_MAX_MICRO_BATCH, where the saved launches matter.
    """
    possible = device.type == "cuda" and world_size == 1 and precision != "fp16"
    if setting == "auto":
        return possible and micro_batch <= GRAPH_MAX_MICRO_BATCH
    return possible and bool(setting)


_memory_share = 1.0  # what setup_device gave this process of its GPU's memory


def setup_device(device: torch.device, share: float = 1.0) -> None:
    """Once per process. CUDA: cuDNN picks each convolution's fastest algorithm by timing them, once per shape
    (every micro-batch of a trial has the same shape, epoch_plan); where `share` < 1 (scaling.workers_per_gpu ranks
    on one GPU) the caching allocator is capped to that share of the device's memory, so that each rank's probe
    and OOM ladder find its own part, not the whole device another rank also fills. CPU: keep_host_memory."""
    global _memory_share
    # imported now, not by the first trial's optimizer (torch imports it lazily there): its import leaves a frame
    # in a reference cycle (torch.fx.wrap keeps its own frame), which would pin the calling trial's model and
    # optimizer until a garbage collection
    import torch._dynamo

    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        if share < 1.0:
            torch.cuda.set_per_process_memory_fraction(share, device)
            _memory_share = share
    else:
        keep_host_memory(device)


def device_memory(device: torch.device) -> int:
    """Bytes of device memory this process may use: a GPU's whole memory, or its share (setup_device)."""
    return int(torch.cuda.get_device_properties(device).total_memory * _memory_share)


def autocast(device: torch.device, precision: str):
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def device_name(device: torch.device) -> str:
    """What the trial ran on, for MLflow's `device_name` param."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def _libc():
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return None


M_MMAP_THRESHOLD, M_MMAP_MAX = -3, -4  # glibc's malloc.h


def keep_host_memory(device: torch.device) -> bool:
    """CPU workers: serve large tensors from glibc's heap and keep them there between steps.

    Otherwise every activation over 32 MB is a fresh mmap, page-faulted on first touch and unmapped
    when freed, every step. At batch 512 on this project's 2-core CPU the step ran 101-120 images/s
    this way against 65-69 with huge pages alone, at a peak RSS of 6.6 GiB against 3.4 GiB
    (benchmarks/RESULTS.md). `release_host_memory()` at each epoch's end bounds the heap.
    GPU workers keep glibc's default: their activations live on the GPU.
    """
    libc = _libc()
    if device.type != "cpu" or libc is None:
        return False
    m_trim_threshold = -1
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


@contextlib.contextmanager
def own_host_blocks(device: torch.device):
    """CPU workers: a step inside this maps its blocks over 32 MB (glibc's largest automatic mmap threshold) fresh
    and unmaps them when freed, so its resident memory is its own. In a heap that kept a larger step's blocks
    (keep_host_memory), the step's tensors land in the gaps it left, and the probe's bisection read every batch after
    one over the limit as over it too (129 at 1.57 GiB after 128 at 1.33: benchmarks/RESULTS.md, "A Ray Train
    worker's loop thread"). Outside it, the heap keeps its blocks again (keep_host_memory's settings)."""
    libc = _libc()
    if device.type != "cpu" or libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
    libc.mallopt(M_MMAP_MAX, 65536)  # glibc's default
    try:
        yield
    finally:
        keep_host_memory(device)


def release_host_memory() -> None:
    """Give free heap pages back to the OS (once per epoch), so fragmentation cannot accumulate."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def release_trial_memory(device: torch.device) -> None:
    """After a warm group's trial is dropped (`del run`; nothing of a trial is in a reference cycle, so its tensors
    are already freed): give back what the allocator kept for it, so that the next trial starts as on a fresh
    group. CUDA: cuBLAS's workspaces, one per stream the trial's matmuls ran on (CUDA graph warm-ups and captures
    run on streams of their own), then the caching allocator's free blocks, the CUDA graph's private pool among
    them (torch.cuda.empty_cache); else the next trial's other shapes fragment around them. CPU: free heap pages
    back to the OS (release_host_memory)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the trial's last kernels may still use blocks it freed
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # private: what torch's own
        if clear_workspaces is not None:  # CUDA leak check and CUDA graph trees call between runs
            clear_workspaces()
        torch.cuda.empty_cache()
    else:
        release_host_memory()


def distributed() -> bool:
    """A process group is up (several ranks): collectives are real."""
    return dist.is_available() and dist.is_initialized()
