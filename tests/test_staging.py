"""ds_hybrid.staging: the chunked, host-cast copies of the gradient Predict step's device path.

On this CPU both ends are host memory, so the loop runs with plain buffers and no stream; the
GPU test (marked) runs the pinned buffers and the side stream."""
import pytest
import torch

from ds_hybrid.staging import Stager


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


def test_the_stager_refuses_tensors_of_other_sizes():
    with pytest.raises(ValueError, match="5 values into 4"):
        Stager(chunk=8).upload(torch.zeros(4), torch.zeros(5))
    with pytest.raises(ValueError, match="4 values into 5"):
        Stager(chunk=8).download(torch.zeros(5), torch.zeros(4))


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
    side = torch.cuda.Stream()   # a thread on a stream of its own orders its work after the copies by join()
    with torch.cuda.stream(side):
        stager.upload(gpu, host * 3)
        stager.join()
        assert torch.equal(gpu, (host * 3).to("cuda").to(torch.bfloat16))
