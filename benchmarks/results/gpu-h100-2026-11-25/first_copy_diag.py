"""Which enqueue of a device-to-host snapshot blocks while the compute stream is busy?

Each case queues a 0.5 s sleep kernel on the compute stream, then times CopyEngine.enqueue of
two 4 MiB CUDA tensors: an asynchronous enqueue returns in well under a millisecond, a blocking
one only once the sleep is over (~0.5 s). Run on the GPU machine from the repository root.
"""

import time

import torch

from nebula_ckpt import _C

N = 1 << 20


def held_enqueue(eng, srcs, dst):
    torch.cuda._sleep(int(1e9))
    t0 = time.perf_counter()
    job = eng.enqueue(srcs, dst, [0, srcs[0].nbytes])
    t1 = time.perf_counter()
    job.wait()
    torch.cuda.synchronize()
    return t1 - t0


def main():
    eng = _C.CopyEngine(2)
    src0 = [torch.ones(N, device="cuda"), torch.ones(N, device="cuda")]
    dst0 = _C.alloc_host_buffer(8 * N, pinned=True)
    torch.cuda.synchronize()
    rows = [("first enqueue in the process (fresh streams, fresh dst)", held_enqueue(eng, src0, dst0)),
            ("same srcs, same dst", held_enqueue(eng, src0, dst0))]
    src1 = [torch.ones(N, device="cuda"), torch.ones(N, device="cuda")]
    torch.cuda.synchronize()
    rows.append(("fresh srcs, same dst", held_enqueue(eng, src1, dst0)))
    dst1 = _C.alloc_host_buffer(8 * N, pinned=True)
    rows.append(("same srcs, fresh dst (alloc_host_buffer: posix_memalign + cudaHostRegister)",
                 held_enqueue(eng, src0, dst1)))
    rows.append(("same srcs, that dst again", held_enqueue(eng, src0, dst1)))
    dst2 = torch.empty(8 * N, dtype=torch.uint8, pin_memory=True)
    rows.append(("same srcs, fresh dst (torch pin_memory: cudaHostAlloc)", held_enqueue(eng, src0, dst2)))
    dst3 = _C.alloc_host_buffer(8 * N, pinned=True)
    dst3[:4096].copy_(torch.zeros(4096, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    rows.append(("fresh registered dst, first page written by a D2H copy before", held_enqueue(eng, src0, dst3)))
    dst4 = _C.alloc_host_buffer(8 * N, pinned=True)
    dst4.copy_(torch.zeros(8 * N, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    rows.append(("fresh registered dst, all of it written by a D2H copy before", held_enqueue(eng, src0, dst4)))
    dst5 = _C.alloc_host_buffer(64 * N, pinned=True)
    rows.append(("fresh registered dst of 64 MiB", held_enqueue(eng, src0, dst5)))
    big = [torch.ones(8 * N, device="cuda"), torch.ones(8 * N, device="cuda")]
    torch.cuda.synchronize()
    rows.append(("fresh 32 MiB srcs, that 64 MiB dst again", held_enqueue(eng, big, dst5)))
    for name, sec in rows:
        print(f"{sec * 1e3:9.2f} ms  {'BLOCKED' if sec > 0.1 else 'async  '}  {name}")


if __name__ == "__main__":
    main()
