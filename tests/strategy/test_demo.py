"""DeMo: the chunked DCT, extraction of the fast components, what is sent, and the update direction."""

import pytest
import torch
from torch.testing import assert_close

import toy
from exogym import Trainer
from exogym.strategy import DeMoStrategy
from exogym.strategy.demo import ChunkDCT, DeMo, dct_matrix
from strategy_toys import FIT, NODES, node_params, run_linear, watched


def transform(shape, chunk):
    t = ChunkDCT(torch.Size(shape), chunk)
    return t, dct_matrix(t.r, torch.float64), dct_matrix(t.c, torch.float64)


@pytest.mark.parametrize("shape", [(12,), (6, 10), (4, 3, 5), (), (7,)])
def test_the_chunked_dct_round_trip_is_exact(shape):
    t, dr, dc = transform(shape, 4)
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    coeffs = t.encode(x, dr, dc)
    assert coeffs.shape == (t.num_chunks, t.chunk_numel) and coeffs.numel() == max(1, x.numel())
    assert_close(t.decode(coeffs, dr, dc), x, rtol=0, atol=1e-12)
    assert_close(dr @ dr.T, torch.eye(t.r, dtype=torch.float64))


def test_chunks_are_the_largest_divisors_up_to_compression_chunk():
    assert (ChunkDCT(torch.Size([12]), 5).c, ChunkDCT(torch.Size([7]), 4).c) == (4, 1)
    t = ChunkDCT(torch.Size([6, 10]), 4)
    assert (t.r, t.c, t.num_chunks) == (3, 2, 10)


def test_extraction_takes_the_top_k_components_out_of_the_momentum():
    p = torch.nn.Parameter(torch.zeros(4, 6))
    lr = 0.25
    opt = DeMo([p], lr=lr, compression_topk=2, compression_chunk=3, compression_decay=0.5)
    group = opt.param_groups[0]
    g = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    p.grad = g.clone()
    t, dr, dc = transform((4, 6), 3)
    before = t.encode(lr * g.double(), dr, dc)  # the momentum's coefficients (momentum starts at 0, gains lr g)
    idx, values = opt.extract(p, group)
    assert idx.shape == values.shape == (t.num_chunks, 2)
    assert torch.equal(idx.sort(1).values, before.abs().topk(2, dim=1).indices.sort(1).values)  # the largest
    assert_close(values.double(), before.gather(1, idx), rtol=1e-5, atol=1e-6)
    after = t.encode(opt.state[p]["momentum"].double(), dr, dc)
    assert_close(after.gather(1, idx), torch.zeros_like(values, dtype=torch.float64), rtol=0, atol=1e-5)
    rest = torch.ones_like(before, dtype=torch.bool).scatter_(1, idx, False)
    assert_close(after[rest], before[rest], rtol=1e-5, atol=1e-5)  # the rest stays in the momentum
    p.grad = g.clone()
    idx2, values2 = opt.extract(p, group)  # the next step: m <- 0.5 m + lr g, then extract again
    assert_close(values2.double(), (0.5 * after + before).gather(1, idx2), rtol=1e-5, atol=1e-5)


def test_combine_averages_a_coefficient_over_the_nodes_that_sent_it():
    p = torch.nn.Parameter(torch.zeros(3))
    opt = DeMo([p], compression_chunk=3)
    idx = torch.tensor([[0, 2, 0, 1]])  # node 0 sent coefficients 0 and 2, node 1 sent 0 and 1
    values = torch.tensor([[4.0, -1.0, 2.0, 5.0]])
    decoded = opt.combine(p, opt.param_groups[0], idx, values)
    t, dr, dc = transform((3,), 3)
    assert_close(t.encode(decoded.double(), dr, dc), torch.tensor([[3.0, 5.0, -1.0]], dtype=torch.float64))


def test_two_nodes_hand_checked_update_direction_and_momentum_residuals():
    # Chunk 2, top-1; the momentum gains lr g. DCT of [3, 1] is [4, 2]/sqrt2: node 0 sends coefficient 0
    # (lr 2 sqrt2) and keeps lr [1, -1]. DCT of [1, -5] is [-4, 6]/sqrt2: node 1 sends coefficient 1
    # (lr 3 sqrt2) and keeps lr [-2, -2]. The average decodes to lr [5, -1]; the update is -lr sign = [-lr, lr].
    # (No decoded entry is zero in exact arithmetic: the sign of a float-rounded zero is any CPU's guess.)
    lr = 0.1
    strategy = watched(DeMoStrategy)(lr=lr, compression_topk=1, compression_chunk=2, compression_decay=0.9)
    model, t = run_linear(strategy, [[3.0, 1.0], [1.0, -5.0]], [0.0, 0.0], 1)
    assert_close(model.w.detach(), torch.tensor([-lr, lr]))
    for r, residual in ((0, [lr, -lr]), (1, [-2 * lr, -2 * lr])):
        assert_close(node_params(r), torch.tensor([-lr, lr]))
        opt = NODES[r][1].optim
        assert_close(opt.state[opt.param_groups[0]["params"][0]]["momentum"], torch.tensor(residual))
    assert t.record.bytes_per_node == [1 * 1 * (8 + 4)] * 2  # one chunk, top-1, int64 index + fp32 value


def test_bytes_per_step_follow_the_formula():
    def chunk(n, limit):
        return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)

    shapes = [(16, 8), (16,), (3, 16), (3,)]  # TinyMLP
    topk, limit, nodes, steps = 3, 4, 3, 4
    sent = 0
    for shape in shapes:
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape
        r, c = (1 if len(shape) == 1 else chunk(rows, limit)), chunk(cols, limit)
        sent += (rows // r) * (cols // c) * min(topk, r * c) * (8 + 4)
    trainer = Trainer(toy.TinyMLP(), toy.make_classification(128))
    trainer.fit(DeMoStrategy(lr=1e-3, compression_topk=topk, compression_chunk=limit), nodes, batch_size=8,
                max_steps=steps, **FIT)
    assert sent == (8 * 3 + 4 * 3 + 4 * 3 + 1 * 3) * 12
    assert trainer.record.bytes_per_node == [steps * (nodes - 1) * sent] * nodes
    assert trainer.record.comm_per_node[0]["calls_by_op"] == {"all_gather": 2 * steps}  # indices, values
