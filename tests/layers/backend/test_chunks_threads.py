"""The chunks of sites of the vote-sized passes shared between threads
(capsctl/layers/backend/chunks.py): same results as one thread, no autograd or inference-mode
trouble inside the workers, errors surface, and a forked child does not wait on its parent's
threads."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from capsctl.layers import chunks
from capsctl.layers.backend.chunks import run_spans, site_spans, site_workers
from capsctl.layers.passes import tiles
from capsctl.layers.passes.em_moments import VoteMoments, VoteQuad
from capsctl.layers.passes.routed import routed_pass
from capsctl.layers.passes.weighted import weighted_pass

# the torch code's own chunks and threads (the compiled loops have their own tests)
pytestmark = pytest.mark.usefixtures("eager_routing")


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch):
    def use(n: int) -> None:
        monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", str(n))

    monkeypatch.setattr(chunks, "CHUNK_BYTES", 4096)  # many chunks of sites
    return use


@pytest.mark.parametrize(("bsz", "bc", "workers"), [(10, 3, 2), (12, 3, 2), (7, 7, 2), (9, 2, 4)])
def test_spans_deal_whole_chunks_in_order(bsz: int, bc: int, workers: int) -> None:
    spans = site_spans(bsz, bc, workers)
    assert len(spans) == min(workers, -(-bsz // bc))
    assert spans[0][0] == 0 and spans[-1][1] == bsz
    for (_, stop), (start, _) in zip(spans, spans[1:], strict=False):
        assert stop == start and start % bc == 0


def test_tiles_give_every_thread_a_chunk() -> None:
    # 32 sites of 640 bytes fit one 2 MiB chunk; with 2 threads there are two chunks of 16
    assert chunks.tile_shape(800, 32, 10, 16, 4, budget=2 * 2**20)[1] == 32
    jc, bc = chunks.tile_shape(800, 32, 10, 16, 4, budget=2 * 2**20, workers=2)
    assert bc == 16 and jc * bc * 10 * 16 * 4 <= 2 * 2**20


def test_the_environment_variable_sets_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.empty(1)
    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", "3")
    assert site_workers(cpu) == 3
    monkeypatch.setenv("CAPSCTL_ROUTING_THREADS", "1")
    assert site_workers(cpu) == 1
    monkeypatch.delenv("CAPSCTL_ROUTING_THREADS")
    assert site_workers(cpu) == torch.get_num_threads()
    assert site_workers(torch.empty(1, device="meta")) == 1


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    j, b, a, x, m, c = 18, 40, 4, 4, 5, 4
    xs = torch.randn(j, b, a, x, generator=g, requires_grad=True)
    w = torch.randn(j, x, m, c, generator=g, requires_grad=True)
    p = torch.randn(b, m, a, c, generator=g, requires_grad=True)
    r = torch.rand(j, b, m, generator=g, requires_grad=True)
    return xs, w, p, r


def _routed(xs, w, p, r):  # noqa: ANN001, ANN202
    s, _ = routed_pass(xs, w, p, 0.5)
    return s, (xs, w, p)


def _weighted(xs, w, p, r):  # noqa: ANN001, ANN202
    return weighted_pass(xs, w, r), (xs, w, r)


def _em(xs, w, p, r):  # noqa: ANN001, ANN202
    j, b, a, x = xs.shape
    m, c = w.shape[2], w.shape[3]
    wc = w.permute(0, 1, 3, 2).reshape(j, x, c * m)  # [J, x, c*m]
    shift = torch.zeros(b, a * c, m)  # [B, d, m]
    act = torch.rand(b, j, generator=torch.Generator().manual_seed(2))  # [B, J]
    moments, mass = VoteMoments.apply(r.transpose(0, 1), act, xs, wc, shift)  # [2, B, d, m]
    quad = VoteQuad.apply(moments.detach(), xs, wc, shift)  # [B, J, m]
    return moments.sum() + mass.square().sum() + quad.sum(), (xs, w, r)


@pytest.mark.parametrize("op", [_routed, _weighted, _em])
def test_threads_give_the_results_of_one_thread(op, threads) -> None:  # noqa: ANN001
    """Outputs and gradients: equal up to the order of a sum over sites, and bit-identical
    from one run with two threads to the next."""
    runs = []
    for n in (1, 2, 2):
        threads(n)
        ins = _inputs()
        out, wrt = op(*ins)
        grads = torch.autograd.grad(
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), wrt
        )
        runs.append((out.detach(), grads))
    (o1, g1), (o2, g2), (o3, g3) = runs
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5)
    for a, b in zip(g2, g1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(o2, o3) and all(torch.equal(a, b) for a, b in zip(g2, g3, strict=True))


def test_the_chunks_run_in_single_threaded_workers(threads, monkeypatch) -> None:  # noqa: ANN001
    threads(2)
    seen: list[tuple[str, int]] = []
    votes = tiles.Chunk.votes
    # each worker's first tile waits for the other's: the two spans run at once, in two
    # threads, however busy the machine is (else one worker may take both in turn)
    both = threading.Barrier(2, timeout=60)

    def spy(self, xc, wc):  # noqa: ANN001, ANN202
        name = threading.current_thread().name
        if all(n != name for n, _ in seen):
            seen.append((name, torch.get_num_threads()))
            both.wait()
        seen.append((name, torch.get_num_threads()))
        return votes(self, xc, wc)

    monkeypatch.setattr(tiles.Chunk, "votes", spy)
    monkeypatch.setattr(chunks, "_POOL", {"size": 0, "pool": None})  # a pool starts here
    before = torch.get_num_threads()
    xs, w, p, _ = _inputs()
    routed_pass(xs, w, p, 0.5)[0].sum().backward()
    names = {name for name, _ in seen}
    assert len(names) == 2 and all(n.startswith("capsctl-sites") for n in names), names
    assert {n for _, n in seen} == {1}
    # the caller's threads are left alone, and so are those of threads started later
    assert torch.get_num_threads() == before
    later: list[int] = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [before]


def test_workers_follow_inference_mode(threads) -> None:  # noqa: ANN001
    """Results allocated in inference mode can only be written in it: the workers enter it."""
    threads(2)
    xs, w, p, r = (t.detach() for t in _inputs())
    with torch.inference_mode():
        s, _ = routed_pass(xs, w, p, 0.5)
        sw = weighted_pass(xs, w, r)
    with torch.no_grad():
        torch.testing.assert_close(s, routed_pass(xs, w, p, 0.5)[0])
        torch.testing.assert_close(sw, weighted_pass(xs, w, r))


def test_an_error_in_a_worker_reaches_the_caller() -> None:
    def part(i: int, lo: int, hi: int) -> None:
        if i == 1:
            raise ValueError(f"sites {lo}:{hi}")

    with pytest.raises(ValueError, match="sites 5:10"):
        run_spans(part, [(0, 5), (5, 10)])


def _child(q) -> None:  # noqa: ANN001
    xs, w, p, _ = _inputs()
    s, _ = routed_pass(xs, w, p, 0.5)
    q.put(float(s.detach().sum()))


def test_a_forked_child_starts_its_own_workers(threads) -> None:  # noqa: ANN001
    threads(2)
    xs, w, p, _ = _inputs()
    expected = float(routed_pass(xs, w, p, 0.5)[0].detach().sum())  # the parent's pool now exists
    assert chunks._POOL["pool"] is not None
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_child, args=(q,))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung on its parent's worker threads")
    assert child.exitcode == 0
    assert q.get(timeout=5) == pytest.approx(expected, rel=1e-6)
