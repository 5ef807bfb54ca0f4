"""ds_hybrid.staging: the chunked, host-cast copies of the gradient Predict step's device path, and
the queued downloads of its ZeRO 3 gradient shares.

On this CPU both ends are host memory, so the loop runs with plain buffers and no stream; the
GPU test (marked) runs the pinned buffers and the side stream."""
import pytest
import torch

from ds_hybrid.staging import QueuedDownloads, Stager


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1000])
def test_upload_casts_each_chunk_as_the_direct_copy_does(n):
    src = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    dst = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    Stager(chunk=8).upload(dst, src)
    assert torch.equal(dst, src.to(torch.bfloat16))   # round to nearest even, as the direct copy


@pytest.mark.parametrize("n", [1, 8, 17, 1000])
def test_download_hands_every_chunk_once_in_order_and_casts_by_default(n):
    src = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    stager = Stager(chunk=8)
    dst = torch.zeros(n)
    stager.download(dst, src)
    assert torch.equal(dst, src.float())
    seen = []
    stager.download(dst, src, take=lambda staged, a, b: seen.append((a, b, staged.clone())))
    assert [(a, b) for a, b, _ in seen] == [(a, min(a + 8, n)) for a in range(0, n, 8)]
    assert torch.equal(torch.cat([s for _, _, s in seen]), src)


def test_uploads_of_a_chunk_a_call_take_the_two_buffers_in_turn():
    """A caller that uploads one chunk a call (``CompactMoments.fold_real_step``) gets the other
    buffer each time, so its next cast need not wait for the last chunk's copy; the values are the
    direct copy's."""
    stager = Stager(chunk=8)
    srcs = [torch.full((8,), float(k + 1)) for k in range(3)]
    dsts = [torch.empty(8, dtype=torch.bfloat16) for _ in srcs]
    for dst, src in zip(dsts, srcs):
        stager.upload(dst, src)
    assert all(torch.equal(dst, src.to(torch.bfloat16)) for dst, src in zip(dsts, srcs))
    first, second = stager._bufs[(torch.bfloat16, False)]
    assert torch.equal(first, srcs[2].to(torch.bfloat16)) and torch.equal(second, srcs[1].to(torch.bfloat16))


def test_the_stager_refuses_tensors_of_other_sizes():
    with pytest.raises(ValueError, match="5 values into 4"):
        Stager(chunk=8).upload(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="4 values into 5"):
        Stager(chunk=8).download(torch.zeros(5), torch.zeros(4))


def test_queued_downloads_take_every_chunk_once_in_order_off_the_calling_thread():
    """Three tensors (one short of a chunk, one of several, one empty) queued through 2 buffers of
    8 values: every chunk handed to its take once, in the order queued, on the queue's thread; the
    sums added into one target in that order are the direct adds' bit for bit."""
    import threading
    gen = torch.Generator().manual_seed(0)
    srcs = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in (5, 29, 0)]
    q = QueuedDownloads(chunk=8, slots=2)
    seen, total, expect = [], torch.zeros(29), torch.zeros(29)

    def take_for(k):
        def take(staged, a, b):
            seen.append((k, a, b, threading.get_ident()))
            total[a:b].add_(staged)
        return take
    for k, src in enumerate(srcs):
        q.put(src, take_for(k))
        expect[:src.numel()].add_(src)
    q.drain()
    assert [(k, a, b) for k, a, b, _ in seen] == [(0, 0, 5)] + [(1, a, min(a + 8, 29)) for a in range(0, 29, 8)]
    assert threading.get_ident() not in {t for *_, t in seen}
    assert torch.equal(total, expect) and q.chunks == 5
    assert all(not b.is_pinned() for b in q._bufs[(torch.bfloat16, False)])   # (no GPU end: plain buffers)


def test_queued_downloads_re_raise_a_take_error_at_drain_and_free_its_buffer():
    q = QueuedDownloads(chunk=4, slots=1)

    def bad(staged, a, b):
        raise ValueError("boom")
    q.put(torch.zeros(3), bad)
    with pytest.raises(ValueError, match="boom"):
        q.drain()
    got = []
    q.put(torch.ones(3), lambda staged, a, b: got.append(staged.clone()))   # the one buffer is free again
    q.drain()
    assert torch.equal(got[0], torch.ones(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_copies_go_through_pinned_buffers_on_a_side_stream_and_match_the_direct_copy():
    n = (1 << 20) + 3
    stager = Stager(chunk=1 << 16)
    host = torch.randn(n, generator=torch.Generator().manual_seed(0))
    gpu = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    stager.upload(gpu, host)
    assert torch.equal(gpu, host.to("cuda").to(torch.bfloat16))
    assert all(b.is_pinned() for b in stager._bufs[(torch.bfloat16, True)])
    gpu.mul_(2)   # queued on the current stream: the download's copies must wait for it
    back = torch.empty(n)
    stager.download(back, gpu, after=Stager.mark(gpu.device))
    assert torch.equal(back, (host.to(torch.bfloat16) * 2).float())
    chunks = [torch.empty(1 << 16, dtype=torch.bfloat16, device="cuda") for _ in range(16)]
    for k, chunk in enumerate(chunks):   # (a chunk a call: a buffer's next cast waits for its last copy)
        stager.upload(chunk, host[k << 16:(k + 1) << 16])
    assert torch.equal(torch.cat(chunks), host[:16 << 16].to(torch.bfloat16).cuda())
    side = torch.cuda.Stream()   # a thread on a stream of its own orders its work after the copies by join()
    with torch.cuda.stream(side):
        stager.upload(gpu, host * 3)
        stager.join()
        assert torch.equal(gpu, (host * 3).to("cuda").to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_queued_downloads_wait_for_the_producer_and_keep_the_source_alive():
    """Chunks from tensors made by kernels still queued on the current stream, dropped by the
    caller at once (the queue keeps them until their copies end), through pinned buffers: the
    values added on the host thread are the direct copies'."""
    n = (1 << 20) + 3
    q = QueuedDownloads(chunk=1 << 16, slots=3)
    base = torch.randn(n, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    total, expect = torch.zeros(n), torch.zeros(n)
    for k in range(4):
        src = (base * (k + 1)).to(torch.bfloat16)   # queued; the put must wait for it
        expect.add_(src.cpu())
        q.put(src, lambda staged, a, b: total[a:b].add_(staged))
        del src
    q.drain()
    assert torch.equal(total, expect)
    assert all(b.is_pinned() for b in q._bufs[(torch.bfloat16, True)])
